"""The router's Prometheus metrics, and its workers' metrics re-labelled with ``worker="URL"``."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Metric, generate_latest
from prometheus_client.parser import text_string_to_metric_families


class RouterMetrics:
    """One registry per router (no process-global state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("radixlm_router_requests", "Requests sent to each worker (retries count again).", ["worker"], registry=r)
        self.retries = Counter("radixlm_router_retries", "Requests sent again to another worker after one failed before its first byte.", registry=r)
        self.failures = Counter("radixlm_router_worker_failures", "Requests a worker failed (no connection, 5xx, or a broken stream).", ["worker"], registry=r)
        self.healthy = Gauge("radixlm_router_healthy_workers", "Workers passing their health check.", registry=r)
        self.in_flight = Gauge("radixlm_router_in_flight_requests", "Requests sent to each worker and not yet finished.", ["worker"], registry=r)
        self.tree_chars = Gauge("radixlm_router_tree_chars", "Characters of text the cache-aware tree holds for each worker.", ["worker"], registry=r)

    def render(self) -> bytes:
        """The router's own exposition text."""
        return generate_latest(self.registry)


class _Families:
    """A one-shot collector of already-built metric families."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def relabel(texts: dict[str, str]) -> bytes:
    """Every worker's exposition text (by URL) as one, each sample labelled ``worker="URL"``;
    a family several workers export is written once with all their samples."""
    merged: dict[tuple[str, str], Metric] = {}
    for url, text in texts.items():
        for fam in text_string_to_metric_families(text):
            out = merged.get((fam.name, fam.type))
            if out is None:
                out = merged[(fam.name, fam.type)] = Metric(fam.name, fam.documentation, fam.type)
            for s in fam.samples:
                out.samples.append(s._replace(labels={**s.labels, "worker": url}))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merged.values()))  # type: ignore[arg-type]
    return generate_latest(registry)
