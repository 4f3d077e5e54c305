"""The engine's counters: statistics and dashboard readings, taken from its parts on the loop thread."""

from __future__ import annotations

from typing import Any

from radixlm.runtime.engine.assembly import EngineParts


def engine_stats(rt: EngineParts) -> dict[str, Any]:
    """Queue lengths, KV usage and cache counters (call on the loop thread)."""
    s, tree, runner = rt.scheduler, rt.kv.tree, rt.runner
    return {
        "num_running": len(s.running),
        "num_waiting": len(s.waiting),
        "max_total_tokens": runner.max_total_tokens,
        "kv_cache_dtype": runner.kv_format.name,
        "kv_bytes_per_token": runner.kv_bytes_per_token,  # on rank 0 under tensor parallelism
        "tp_size": runner.tp_size,
        "tp_all_reduce_seconds": 0.0 if runner.group is None else runner.group.reduce_seconds,
        "free_slots": rt.kv.allocator.available_slots(),
        "tree_slots": tree.total_size(),
        "evictable_slots": tree.evictable_size(),
        "running_slots": sum(r.kv.owned for r in s.holding_kv() if r.kv is not None),
        "cache_hit_rate": tree.hit_rate(),
        "forward_passes": s.forward_passes,
        "total_retracted": s.total_retracted,
        "total_preempted": s.total_preempted,
        "retention_hits": tree.retention_hits,
        "evictions_despite_hint": tree.evicted_despite_hint,
        "grammar_masks": s.decoder.grammar_masks,
        "grammar_lazy_picks": s.decoder.grammar_lazy_picks,
        **s.speculator.stats(),
        **(rt.pd.stats() if rt.pd is not None else {}),
        **({"kv_tiers": rt.kv.tiers.snapshot()} if rt.kv.tiers is not None else {}),
    }


def dashboard_counters(rt: EngineParts) -> dict[str, Any]:
    """Pool usage and cumulative counters for the dashboard's history (call on the loop thread)."""
    s, tree = rt.scheduler, rt.kv.tree
    return {
        "max_total_tokens": rt.runner.max_total_tokens,
        "free_slots": rt.kv.allocator.available_slots(),
        "tree_slots": tree.total_size(),
        "evictable_slots": tree.evictable_size(),
        "running_slots": sum(r.kv.owned for r in s.holding_kv() if r.kv is not None),
        "query_tokens": tree.query_tokens,
        "hit_tokens": tree.hit_tokens,
        "output_tokens": s.output_tokens(),
        "prefill_tokens": s.prefill_tokens,
        "num_running": len(s.running),
        "num_waiting": len(s.waiting),
        "clock": tree.root.last_access,  # the LRU clock, as of the last prefix match
        **({"kv_tiers": rt.kv.tiers.snapshot()} if rt.kv.tiers is not None else {}),
    }
