"""Who first computed a tree edge, and a bounded record of what eviction took away.

The radix tree keeps one ``Origin`` per node (never per token): the request that computed the
node's tokens, the program and session key it came with, and when. Splitting a node gives both
halves the same ``Origin``. ``EvictionLog`` remembers, for each evicted edge, a hash of the token
path up to its first page, so a later request whose match stops there can be told "evicted at T".
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Origin:
    """The request that first computed a node's tokens (``created``: Unix time)."""

    rid: str
    program: str | None = None
    prompt_cache_key: str | None = None
    created: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        """The JSON form shown in cache explanations."""
        return {"rid": self.rid, "program": self.program, "prompt_cache_key": self.prompt_cache_key, "created": self.created}


def path_key(tokens: Sequence[int], end: int) -> int:
    """The hash naming the token path ``tokens[:end]`` (ints hash the same in every process)."""
    return hash(tuple(tokens[:end]))


class EvictionLog:
    """The last ``capacity`` evicted edges: path hash up to the edge's first page → (when, end)."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[int, tuple[float, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, key: int, end: int, when: float | None = None) -> None:
        """Remember that the edge named by ``key`` (ending at token ``end``) was evicted."""
        self._entries[key] = (time.time() if when is None else when, end)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def lookup(self, key: int) -> tuple[float, int] | None:
        """(evicted at, end token) of the edge named by ``key``, if it is remembered."""
        return self._entries.get(key)
