"""The router's workers: URL, health and in-flight count, and the background health checker.

A worker is unhealthy from the moment a health check fails or a request to it cannot connect
(or gets 503); the next passing check (GET /health every ``interval`` seconds) brings it back.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

logger = logging.getLogger(__name__)


@dataclass
class Worker:
    """One engine server behind the router."""

    url: str
    healthy: bool = False
    in_flight: int = 0  # requests the router sent and has not seen finish
    last_error: str | None = None


class WorkerRegistry:
    """The workers, their health, and the loop that checks it."""

    def __init__(self, urls: list[str], client: httpx.AsyncClient, interval: float) -> None:
        self.workers = [Worker(url.rstrip("/")) for url in urls]
        self.client = client
        self.interval = interval

    def healthy(self) -> list[Worker]:
        """The workers that may take requests, in registry order."""
        return [w for w in self.workers if w.healthy]

    def mark_unhealthy(self, worker: Worker, reason: str) -> None:
        """Take ``worker`` out of rotation until a health check passes."""
        if worker.healthy:
            logger.warning("worker %s is unhealthy: %s", worker.url, reason)
        worker.healthy, worker.last_error = False, reason

    def mark_healthy(self, worker: Worker) -> None:
        """Put ``worker`` back in rotation."""
        if not worker.healthy:
            logger.info("worker %s is healthy", worker.url)
        worker.healthy, worker.last_error = True, None

    async def check(self, worker: Worker) -> bool:
        """One GET /health of ``worker``; updates and returns its health."""
        try:
            resp = await self.client.get(worker.url + "/health", timeout=max(1.0, min(self.interval, 5.0)))
        except httpx.HTTPError as exc:
            self.mark_unhealthy(worker, f"health check failed: {type(exc).__name__}: {exc}")
            return False
        if resp.status_code != 200:
            self.mark_unhealthy(worker, f"health check answered {resp.status_code}")
            return False
        self.mark_healthy(worker)
        return True

    async def check_all(self) -> None:
        """Check every worker once, concurrently."""
        await asyncio.gather(*(self.check(w) for w in self.workers))

    async def run(self) -> None:
        """Check every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            await self.check_all()
