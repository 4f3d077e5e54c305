"""Prometheus metrics of a server: request counts, tokens, KV usage and latency histograms."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_CLASS_LABEL_SPAN = 10  # classes -10..10 get their own label; beyond, one label a side (bounded series)


def class_label(priority: int) -> str:
    """The ``priority`` label of a request's class: its number, or ``<=-11`` / ``>=11`` past the span."""
    if priority < -_CLASS_LABEL_SPAN:
        return f"<={-_CLASS_LABEL_SPAN - 1}"
    if priority > _CLASS_LABEL_SPAN:
        return f">={_CLASS_LABEL_SPAN + 1}"
    return str(priority)


class ServerMetrics:
    """One registry per server (no process-global state)."""

    def __init__(self, per_priority: bool = False) -> None:
        self.per_priority = per_priority  # the server orders by priority class: latency per class
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("radixlm_num_running_requests", "Requests decoding or prefilling.", registry=r)
        self.waiting = Gauge("radixlm_num_waiting_requests", "Requests waiting for admission.", registry=r)
        self.kv_usage = Gauge("radixlm_kv_cache_usage_ratio", "Share of KV slots not free (tree + running).", registry=r)
        self.hit_rate = Gauge("radixlm_cache_hit_rate", "Cached prompt tokens over prompt tokens.", registry=r)
        self.prompt_tokens = Counter("radixlm_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("radixlm_generation_tokens", "Tokens generated.", registry=r)
        self.cached_tokens = Counter("radixlm_cached_tokens", "Prompt tokens served from the radix cache.", registry=r)
        self.requests = Counter("radixlm_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r)
        self.ttft = Histogram("radixlm_time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("radixlm_inter_token_latency_seconds", "Mean time between output tokens, per request.", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("radixlm_e2e_request_latency_seconds", "End-to-end request latency.", buckets=_LATENCY_BUCKETS, registry=r)
        self.retention_hits = Counter("radixlm_cache_retention_hits", "Requests that reused a prefix while a retention hint protected it.", registry=r)
        self.hint_evictions = Counter("radixlm_cache_evictions_despite_hint", "Cache leaves evicted under memory pressure despite a retention hint.", registry=r)
        self.spec_verify_passes = Counter("radixlm_spec_verify_passes", "Forward passes that verified a request's speculative drafts.", registry=r)
        self.spec_draft_tokens = Counter("radixlm_spec_draft_tokens", "Speculative draft tokens verified.", registry=r)
        self.spec_accepted_tokens = Counter("radixlm_spec_accepted_tokens", "Speculative draft tokens accepted.", registry=r)
        self.grammar_masks = Counter("radixlm_grammar_masks", "Grammar masks computed for constrained rows.", registry=r)
        self.grammar_lazy_picks = Counter("radixlm_grammar_lazy_picks", "Constrained picks the grammar took without computing a mask (lazy masking).", registry=r)
        self.preempted = Counter("radixlm_preempted_requests", "Running requests that gave way to a more urgent one (priority policy).", registry=r)
        self.class_queue = Histogram("radixlm_priority_queue_time_seconds", "Time from arrival to first admission, per priority class.", ["priority"], buckets=_LATENCY_BUCKETS, registry=r)
        self.class_ttft = Histogram("radixlm_priority_time_to_first_token_seconds", "Time to first token, per priority class.", ["priority"], buckets=_LATENCY_BUCKETS, registry=r)
        tier = ["tier"]
        self.tier_hits = Counter("radixlm_kv_tier_hit_tokens", "Prompt tokens loaded back from a KV tier (host, disk) instead of computed.", tier, registry=r)
        self.tier_promotions = Counter("radixlm_kv_tier_promoted_blocks", "KV blocks loaded up from a tier (host: into the pool; disk: into host memory).", tier, registry=r)
        self.tier_demotions = Counter("radixlm_kv_tier_demoted_blocks", "KV blocks moved down into a tier (host: evicted from the pool; disk: evicted from host memory).", tier, registry=r)
        self.tier_bytes_read = Counter("radixlm_kv_tier_read_bytes", "Bytes read from a KV tier.", tier, registry=r)
        self.tier_bytes_written = Counter("radixlm_kv_tier_written_bytes", "Bytes written into a KV tier.", tier, registry=r)
        self.tier_load_seconds = Counter("radixlm_kv_tier_load_seconds", "Seconds spent loading KV blocks up from a tier (with radixlm_kv_tier_loads: the mean load latency).", tier, registry=r)
        self.tier_loads = Counter("radixlm_kv_tier_loads", "Loads from a KV tier (one request's blocks from host, or one block from disk).", tier, registry=r)
        self.tier_bytes = Gauge("radixlm_kv_tier_bytes", "Bytes a KV tier holds now.", tier, registry=r)
        self._seen: dict[str, int] = {}  # engine counters already added to the Counters above

    def observe_finished(self, meta: dict[str, Any]) -> None:
        """Count one finished request from its meta_info (a failed request's may lack counts)."""
        self.prompt_tokens.inc(meta.get("prompt_tokens", 0))
        self.generation_tokens.inc(meta.get("completion_tokens", 0))
        self.cached_tokens.inc(max(meta.get("cached_tokens", 0), 0))
        reason = (meta.get("finish_reason") or {}).get("type", "unknown")
        self.requests.labels(finish_reason=reason).inc()
        if "e2e_latency" in meta:
            self.e2e.observe(meta["e2e_latency"])
        if self.per_priority and "priority" in meta:
            label = class_label(meta["priority"])
            if "queue_time" in meta:
                self.class_queue.labels(priority=label).observe(meta["queue_time"])
            if "ttft" in meta:
                self.class_ttft.labels(priority=label).observe(meta["ttft"])
        if "ttft" in meta and "e2e_latency" in meta:
            self.ttft.observe(meta["ttft"])
            if meta.get("completion_tokens", 0) > 1:
                self.itl.observe((meta["e2e_latency"] - meta["ttft"]) / (meta["completion_tokens"] - 1))

    def render(self, stats: dict[str, Any]) -> bytes:
        """The exposition text, with gauges refreshed from the engine's stats."""
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        total = stats["max_total_tokens"]
        self.kv_usage.set((total - stats["free_slots"]) / total if total else 0.0)
        self.hit_rate.set(stats["cache_hit_rate"])
        self._advance(self.retention_hits, "retention_hits", stats.get("retention_hits", 0))
        self._advance(self.hint_evictions, "evictions_despite_hint", stats.get("evictions_despite_hint", 0))
        self._advance(self.preempted, "total_preempted", stats.get("total_preempted", 0))
        for name in ("spec_verify_passes", "spec_draft_tokens", "spec_accepted_tokens", "grammar_masks", "grammar_lazy_picks"):
            self._advance(getattr(self, name), name, stats.get(name, 0))
        if "kv_tiers" in stats:
            self._tiers(stats["kv_tiers"])
        return generate_latest(self.registry)

    def _tiers(self, tiers: dict[str, Any]) -> None:
        """Refresh the KV tiers' counters and gauges from their snapshot."""
        pairs = ((self.tier_hits, "hit_tokens"), (self.tier_promotions, "promoted_blocks"), (self.tier_demotions, "demoted_blocks"),
                 (self.tier_bytes_read, "bytes_read"), (self.tier_bytes_written, "bytes_written"), (self.tier_load_seconds, "load_seconds"),
                 (self.tier_loads, "loads"))
        for tier in ("host", "disk"):
            for counter, name in pairs:
                self._advance(counter.labels(tier=tier), f"tier_{name}_{tier}", tiers[name].get(tier, 0))
            if tier in tiers:
                self.tier_bytes.labels(tier=tier).set(tiers[tier]["bytes"])

    def _advance(self, counter: Counter, name: str, total: float) -> None:
        """Bring ``counter`` up to the engine's running ``total``."""
        delta = total - self._seen.get(name, 0)
        if delta > 0:
            counter.inc(delta)
            self._seen[name] = total
