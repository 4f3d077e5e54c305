"""The dashboard's server-side history: one sample of the engine's counters per second, bounded.

Samples turn cumulative counters into rates (tokens/s, hit rate over the last second) and keep
the radix tree's LRU clock next to wall time, so a node's last-access tick becomes an age in
seconds. A daemon thread records while the engine lives; the deque keeps the last 10 minutes.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from typing import Any

from radixlm.runtime.engine import Engine

logger = logging.getLogger(__name__)

HISTORY_SECONDS = 600


class CounterHistory:
    """A bounded series of pool-usage and rate samples (thread-safe)."""

    def __init__(self, max_samples: int = HISTORY_SECONDS, min_interval: float = 0.9) -> None:
        if not isinstance(max_samples, int) or max_samples < 2:
            raise ValueError(f"max_samples must be an integer >= 2, got {max_samples!r}")
        self.min_interval = min_interval
        self._samples: deque[dict[str, Any]] = deque(maxlen=max_samples)
        self._raw: deque[tuple[float, dict[str, Any]]] = deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def record(self, counters: dict[str, Any], now: float | None = None) -> bool:
        """Add one sample of ``Engine.dashboard_counters()``; False when the last is too recent."""
        now = time.time() if now is None else now
        with self._lock:
            if self._raw and now - self._raw[-1][0] < self.min_interval:
                return False
            prev = self._raw[-1] if self._raw else None
            sample = {
                "t": round(now, 3),
                "cached": counters["tree_slots"],
                "locked": counters["tree_slots"] - counters["evictable_slots"],
                "in_use": counters["running_slots"],
                "free": counters["free_slots"],
                "running": counters["num_running"],
                "waiting": counters["num_waiting"],
                "hit_rate": None,
                "tok_s": None,
                "prefill_tok_s": None,
            }
            if prev is not None:
                t0, c0 = prev
                dt = max(now - t0, 1e-6)
                queried = counters["query_tokens"] - c0["query_tokens"]
                if queried > 0:
                    sample["hit_rate"] = round((counters["hit_tokens"] - c0["hit_tokens"]) / queried, 4)
                sample["tok_s"] = round(max(counters["output_tokens"] - c0["output_tokens"], 0) / dt, 2)
                sample["prefill_tok_s"] = round(max(counters["prefill_tokens"] - c0["prefill_tokens"], 0) / dt, 2)
            self._raw.append((now, dict(counters)))
            self._samples.append(sample)
            return True

    def since(self, t: float) -> list[dict[str, Any]]:
        """The samples taken after wall time ``t`` (all of them for ``t <= 0``)."""
        with self._lock:
            return [s for s in self._samples if s["t"] > t]

    def ages(self, ticks: list[int], now: float | None = None) -> list[float | None]:
        """Seconds since the tree's LRU clock passed each tick; None where older than the history."""
        now = time.time() if now is None else now
        with self._lock:
            clocks = [c["clock"] for _, c in self._raw]
            times = [t for t, _ in self._raw]
        out: list[float | None] = []
        for tick in ticks:
            if not clocks or tick < clocks[0]:
                out.append(None)
                continue
            i = bisect.bisect_left(clocks, tick)
            out.append(0.0 if i >= len(clocks) else round(max(now - times[i], 0.0), 1))
        return out


class HistorySampler:
    """A daemon thread that records ``engine.dashboard_counters()`` into a CounterHistory each period."""

    def __init__(self, engine: Engine, history: CounterHistory, period: float = 1.0) -> None:
        self.engine, self.history, self.period = engine, history, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixlm-dashboard-history", daemon=True)

    def start(self) -> HistorySampler:
        """Start recording; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop after the current sample."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set() and self.engine.is_alive():
            try:
                self.history.record(self.engine.dashboard_counters())
            except Exception:  # the engine stopped between the check and the call
                if self.engine.is_alive():
                    logger.exception("dashboard history sample failed")
            self._stop.wait(self.period)
