"""The host-memory tier: KV blocks evicted from the pool, kept in LRU order within a byte budget."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class Block:
    """One block of KV in a lower tier: its chain key, its own tokens and its rows of bytes."""

    key: bytes
    tokens: tuple[int, ...]
    rows: torch.Tensor  # uint8 [block_tokens, codec width], on the CPU
    source: str = "host"  # the tier it was last read from: host, or disk (promoted from a file)
    salt: int = 0  # the cache salt (and adapter) of the sequence it belongs to (keys.salt_key)
    protect_until: float = 0.0  # a retention hint, carried down from the tree (time.monotonic())

    @property
    def nbytes(self) -> int:
        """Bytes its rows hold."""
        return self.rows.numel()


class HostTier:
    """Blocks in host memory by key, least recently used evicted first (hinted blocks last).

    A block evicted from here goes to ``spill`` (the disk tier's writer), outside the lock. Safe
    to use from the engine thread and the prefetch thread at once.
    """

    def __init__(self, capacity_bytes: int, spill: Callable[[Block], None] | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self._spill = spill
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def used(self) -> int:
        """Bytes held now."""
        return self._used

    def get(self, key: bytes) -> Block | None:
        """The block under ``key`` (made most recently used), or None."""
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
            return block

    def touch(self, key: bytes, protect_until: float = 0.0) -> bool:
        """Mark a block as just used (raising its hint); False when it is not here."""
        with self._lock:
            block = self._blocks.get(key)
            if block is None:
                return False
            block.protect_until = max(block.protect_until, protect_until)
            self._blocks.move_to_end(key)
            return True

    def put(self, block: Block) -> bool:
        """Keep ``block``, evicting (spilling) others to make room; False when it can never fit."""
        if block.nbytes > self.capacity:
            if self._spill is not None:
                self._spill(block)
            return False
        with self._lock:
            old = self._blocks.pop(block.key, None)
            if old is not None:
                self._used -= old.nbytes
            self._blocks[block.key] = block
            self._used += block.nbytes
            spilled = self._evict_locked()
        for b in spilled:
            if self._spill is not None:
                self._spill(b)
        return True

    def _evict_locked(self) -> list[Block]:
        out = []
        now = time.monotonic()
        while self._used > self.capacity:
            victim = next((b for b in self._blocks.values() if b.protect_until <= now), None)
            if victim is None:  # only hinted blocks left: the oldest goes anyway (a soft hint)
                victim = next(iter(self._blocks.values()))
            del self._blocks[victim.key]
            self._used -= victim.nbytes
            out.append(victim)
        return out

    def clear(self) -> None:
        """Drop every block (nothing is spilled)."""
        with self._lock:
            self._blocks.clear()
            self._used = 0

    def check(self) -> None:
        """Raise AssertionError if the byte count or the budget is off."""
        with self._lock:
            counted = sum(b.nbytes for b in self._blocks.values())
            assert counted == self._used, f"host tier counts {self._used} bytes, holds {counted}"
            assert self._used <= self.capacity, f"host tier holds {self._used} bytes over its {self.capacity}"
            assert all(k == b.key for k, b in self._blocks.items()), "host block filed under another key"
