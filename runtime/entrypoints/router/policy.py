"""Routing policies: which healthy worker takes a request.

- ``round_robin``: each in turn.
- ``shortest_queue``: the fewest requests in flight (sent by the router, not yet finished).
- ``cache_aware`` (SGLang's): while the load is balanced, the worker whose text shares the
  longest prefix with the request (the least loaded of several that hold it equally), if that
  is at least ``cache_threshold`` of the request, else the worker holding the least text; when
  the load is imbalanced, the least loaded.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from radixlm.runtime.entrypoints.router.prefix_tree import PrefixTree
from radixlm.runtime.entrypoints.router.workers import Worker

POLICIES = ("cache_aware", "round_robin", "shortest_queue")


@dataclass
class CacheAwareSettings:
    """The thresholds of ``cache_aware``."""

    cache_threshold: float = 0.5
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5
    max_tree_chars: int = 2_000_000


class Policy(ABC):
    """Chooses one of the candidate workers for a request's routing text."""

    name: str

    @abstractmethod
    def choose(self, text: str, candidates: list[Worker]) -> Worker:
        """The worker for ``text``; ``candidates`` (healthy, not yet tried) is never empty."""

    def tree_chars(self, worker: Worker) -> int:
        """Characters of text the policy remembers for ``worker`` (0 without a tree)."""
        return 0

    def forget(self, worker: Worker) -> None:
        """Forget what ``worker`` caches (its cache was flushed); nothing to forget by default."""
        return None


class RoundRobin(Policy):
    """Each candidate in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, text: str, candidates: list[Worker]) -> Worker:
        worker = candidates[self._next % len(candidates)]
        self._next += 1
        return worker


class ShortestQueue(Policy):
    """The candidate with the fewest requests in flight (the first of them on a tie)."""

    name = "shortest_queue"

    def choose(self, text: str, candidates: list[Worker]) -> Worker:
        return min(candidates, key=lambda w: w.in_flight)


class CacheAware(Policy):
    """Longest prefix match while balanced, least loaded when not; remembers what it sent where."""

    name = "cache_aware"

    def __init__(self, settings: CacheAwareSettings) -> None:
        self.settings = settings
        self.tree = PrefixTree(settings.max_tree_chars)

    def choose(self, text: str, candidates: list[Worker]) -> Worker:
        s = self.settings
        loads = [w.in_flight for w in candidates]
        lo, hi = min(loads), max(loads)
        if hi - lo > s.balance_abs_threshold and hi > s.balance_rel_threshold * lo:
            chosen = min(candidates, key=lambda w: w.in_flight)
        else:
            by_url = {w.url: w for w in candidates}
            holders, matched = self.tree.holders(text, by_url)
            if holders and text and matched / len(text) >= s.cache_threshold:
                # several hold it (a shared system prompt): the least loaded, the most recent on a tie
                chosen = min((by_url[u] for u in holders), key=lambda w: w.in_flight)
            else:
                chosen = min(candidates, key=lambda w: (self.tree.size(w.url), w.in_flight))
        self.tree.insert(text, chosen.url)
        return chosen

    def tree_chars(self, worker: Worker) -> int:
        return self.tree.size(worker.url)

    def forget(self, worker: Worker) -> None:
        self.tree.remove_worker(worker.url)


def make_policy(name: str, settings: CacheAwareSettings) -> Policy:
    """The policy called ``name``."""
    if name == "cache_aware":
        return CacheAware(settings)
    if name == "round_robin":
        return RoundRobin()
    if name == "shortest_queue":
        return ShortestQueue()
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {name!r}")
