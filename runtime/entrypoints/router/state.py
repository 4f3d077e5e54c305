"""RouterState: what the router's routes share."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from radixlm.runtime.entrypoints.router.config import RouterConfig
from radixlm.runtime.entrypoints.router.metrics import RouterMetrics
from radixlm.runtime.entrypoints.router.policy import Policy
from radixlm.runtime.entrypoints.router.workers import Worker, WorkerRegistry


@dataclass
class RouterState:
    """The config, workers, policy, the one HTTP client to the workers, and metrics."""

    config: RouterConfig
    registry: WorkerRegistry
    policy: Policy
    client: httpx.AsyncClient
    metrics: RouterMetrics
    shutting_down: bool = False

    def started(self, worker: Worker) -> None:
        """Count a request sent to ``worker``."""
        worker.in_flight += 1
        self.metrics.requests.labels(worker=worker.url).inc()

    def finished(self, worker: Worker) -> None:
        """Count a request of ``worker`` as finished (done, failed or abandoned)."""
        worker.in_flight -= 1

    def failed(self, worker: Worker, reason: str, unhealthy: bool) -> None:
        """Count a failure of ``worker``; take it out of rotation when ``unhealthy``."""
        self.metrics.failures.labels(worker=worker.url).inc()
        if unhealthy:
            self.registry.mark_unhealthy(worker, reason)
