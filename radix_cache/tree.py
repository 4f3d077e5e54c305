"""RadixCache: a radix tree over token ids whose values are the KV slots of those tokens.

Every edge of the tree carries a run of tokens (``key``) and the slots holding their KV
(``value``, same length). A path from the root spells a token prefix that some earlier request
computed; a new request reuses the KV of its longest cached prefix.

Lock counts protect what running requests use: locking a node locks its whole path to the root,
and only unlocked leaves can be evicted (LRU order)::

    root ── [The cat] ── [ sat]        lock=1  (a running request reads "The cat sat")
              lock=1  └─ [ ran]        lock=0  (evictable leaf)

``evictable_size`` counts slots in unlocked nodes, ``protected_size`` slots in locked ones; their
sum is every slot the tree holds. All lengths are whole pages when ``page_size > 1``.

With ``track_origins`` each node also records its ``Origin`` (who computed it) and how many
requests reused it, and evicted edges go to a bounded ``EvictionLog``. A retention hint
(``protect``) sets ``protect_until`` on a path: eviction takes unhinted leaves first and hinted
ones only when nothing else is left (a soft hint, never a pin).

``on_evict`` (set by the KV tiers) sees each evicted leaf while its slots, and its parents', still
hold their KV: the tiers copy what they keep before the slots are freed.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixlm.radix_cache.origin import EvictionLog, Origin, path_key

if TYPE_CHECKING:
    from radixlm.radix_cache.state_snapshots import StateSnapshots

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass(eq=False)
class TreeNode:
    """One edge of the radix tree and the node it leads to."""

    key: tuple[int, ...] = ()
    value: torch.Tensor = field(default_factory=lambda: _EMPTY)
    parent: TreeNode | None = None
    children: dict = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    origin: Origin | None = None  # who computed these tokens (with track_origins)
    reuse: int = 0  # requests that matched through this node since it was computed
    protect_until: float = 0.0  # time.monotonic() until which a retention hint holds
    tier: str | None = None  # host or disk: the lower tier its KV was loaded back from (None: computed here)
    snapshot: int | None = None  # hybrid models: the StateSnapshots slot of the linear-attention states after this edge

    def is_leaf(self) -> bool:
        """True when no edge leaves this node."""
        return not self.children

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access < other.last_access


@dataclass
class MatchResult:
    """The cached prefix of a query: its slots, the node that ends it, and its length."""

    slots: torch.Tensor
    last_node: TreeNode

    @property
    def length(self) -> int:
        """Number of cached tokens."""
        return len(self.slots)


class RadixCache:
    """A prefix tree of token ids → KV slots with lock counts and LRU eviction."""

    def __init__(
        self,
        free_slots: Callable[[torch.Tensor], None],
        page_size: int = 1,
        disable: bool = False,
        track_origins: bool = False,
    ) -> None:
        self._free_slots = free_slots
        self.page_size = page_size
        self.disable = disable
        self.track_origins = track_origins
        self.evictions = EvictionLog()
        self.retention_hits = 0  # requests whose match reused a prefix under a live hint
        self.evicted_despite_hint = 0  # hinted leaves evicted because nothing else was left
        self._hinted = False  # set by the first ``protect``: until then matches skip the hint walk
        self._clock = itertools.count(1)
        self.on_evict: Callable[[TreeNode], None] | None = None  # sees a leaf before its slots are freed
        # hybrid models: matches stop at the deepest node holding a state snapshot (radix_cache/state_snapshots.py)
        self.snapshots: StateSnapshots | None = None
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Drop every node (the caller must have freed their slots) and zero the counters."""
        if self.snapshots is not None:
            self.snapshots.clear()
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0
        self.query_tokens = 0
        self.hit_tokens = 0

    def evictable_size(self) -> int:
        """Slots held by nodes no running request locks."""
        return self._evictable

    def protected_size(self) -> int:
        """Slots held by locked nodes."""
        return self._protected

    def total_size(self) -> int:
        """Every slot the tree holds."""
        return self._evictable + self._protected

    def hit_rate(self) -> float:
        """Cached tokens over queried tokens since the last reset."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    # ------------------------------------------------------------- helpers
    def _child_key(self, tokens: Sequence[int], start: int):
        if self.page_size == 1:
            return tokens[start]
        return tuple(tokens[start : start + self.page_size])

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _common_len(self, key: tuple[int, ...], tokens: Sequence[int], start: int, end: int) -> int:
        n = min(len(key), end - start)
        i = 0
        while i < n and key[i] == tokens[start + i]:
            i += 1
        return self._aligned(i)

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Split ``child``'s edge after ``at`` tokens; returns the new upper node."""
        upper = TreeNode(
            key=child.key[:at],
            value=child.value[:at],
            parent=child.parent,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
            origin=child.origin,
            reuse=child.reuse,
            protect_until=child.protect_until,
            tier=child.tier,
        )
        upper.children[self._child_key(child.key, at)] = child
        child.parent.children[self._child_key(child.key, 0)] = upper
        child.parent = upper
        child.key = child.key[at:]
        child.value = child.value[at:]
        return upper

    # --------------------------------------------------------------- queries
    def match_prefix(self, tokens: Sequence[int], whole_kv: bool = False) -> MatchResult:
        """Find the longest cached, page-aligned prefix of ``tokens``.

        Splits an edge when the match ends inside it, so ``last_node`` ends exactly at the
        match and can be locked. Touches the path for LRU. Does not count toward the hit rate:
        callers report admitted queries with ``record``. With state ``snapshots`` (hybrid
        models) the match ends at the deepest node holding one, unless ``whole_kv`` asks how far
        the KV alone goes.
        """
        if self.disable or not tokens:
            return MatchResult(_EMPTY, self.root)
        tokens = tokens[: self._aligned(len(tokens))]
        node, pos, parts = self.root, 0, []
        resumable = (node, 0)  # the deepest node so far a request can start after, and its parts
        now = next(self._clock)
        node.last_access = now
        while pos < len(tokens):
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            common = self._common_len(child.key, tokens, pos, len(tokens))
            if common == 0:
                break
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            parts.append(child.value)
            node, pos = child, pos + common
            if child.snapshot is not None:
                resumable = (node, len(parts))
        if self.snapshots is not None and not whole_kv:
            node, parts = resumable[0], parts[: resumable[1]]
        slots = torch.cat(parts) if parts else _EMPTY
        return MatchResult(slots, node)

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one request's prompt length and how much of it came from the cache."""
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def insert(self, tokens: Sequence[int], slots: torch.Tensor, origin: Origin | None = None, tier: str | None = None) -> int:
        """Add ``tokens`` → ``slots``; return how many leading tokens were already cached.

        The caller keeps ownership of ``slots[:returned]`` (duplicates of what the tree already
        holds: free them) and hands ``slots[returned:]`` to the tree. Only the page-aligned part
        of ``tokens`` is inserted; the new node records ``origin`` (when origins are tracked).
        """
        if len(tokens) != len(slots):
            raise ValueError(f"insert got {len(tokens)} tokens but {len(slots)} slots")
        if self.disable:
            return len(tokens)
        n = self._aligned(len(tokens))
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < n:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            common = self._common_len(child.key, tokens, pos, n)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            node, pos = child, pos + common
        if pos < n:
            leaf = TreeNode(
                key=tuple(tokens[pos:n]), value=slots[pos:n].clone(), parent=node, last_access=now,
                origin=origin if self.track_origins else None, tier=tier,
            )
            node.children[self._child_key(tokens, pos)] = leaf
            self._evictable += n - pos
        return pos

    def note_reuse(self, node: TreeNode) -> bool:
        """Count one request reusing the path that ends at ``node``; True if a hint protected it."""
        if not (self.track_origins or self._hinted):
            return False
        now, hinted = time.monotonic(), False
        while node is not self.root:
            node.reuse += 1
            hinted = hinted or node.protect_until > now
            node = node.parent
        if hinted:
            self.retention_hits += 1
        return hinted

    def protect(self, tokens: Sequence[int], ttl: float) -> int:
        """Ask eviction to spare the cached prefix of ``tokens`` for ``ttl`` seconds; returns its length.

        A soft hint: hinted leaves are evicted last, and still evicted when nothing else is left.
        """
        if ttl <= 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl}")
        result = self.match_prefix(tokens)
        until, node = time.monotonic() + ttl, result.last_node
        while node is not self.root:
            node.protect_until = max(node.protect_until, until)
            node = node.parent
        self._hinted = self._hinted or result.length > 0
        return result.length

    def path_slots(self, node: TreeNode) -> torch.Tensor:
        """The slots of every token from the root to the end of ``node``."""
        parts = []
        while node is not self.root:
            parts.append(node.value)
            node = node.parent
        return torch.cat(parts[::-1]) if parts else _EMPTY

    def path_tokens(self, node: TreeNode) -> list[int]:
        """Every token from the root to the end of ``node``."""
        keys = []
        while node is not self.root:
            keys.append(node.key)
            node = node.parent
        return [t for key in reversed(keys) for t in key]

    # ----------------------------------------------------------------- locks
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect the path from ``node`` to the root from eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref`` on the same node."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref on an unlocked node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent

    # -------------------------------------------------------------- eviction
    def evict(self, num_tokens: int, demote: bool = True) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, least recently used first,
        showing each to ``on_evict`` first unless ``demote`` is False.

        Returns how many slots were freed (less than asked when too little is evictable).
        """
        if num_tokens <= 0:
            return 0
        now, order = time.monotonic(), itertools.count()

        def entry(n: TreeNode) -> tuple:  # unhinted first, then least recently used
            return (n.protect_until > now, n.last_access, next(order), n)

        heap = [entry(n) for n in self._iter_nodes() if n.is_leaf() and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            hinted, _, _, leaf = heapq.heappop(heap)
            if hinted:
                self.evicted_despite_hint += 1
            if self.track_origins:
                path = self.path_tokens(leaf)
                start = len(path) - len(leaf.key)
                self.evictions.record(path_key(path, start + self.page_size), len(path))
            if demote and self.on_evict is not None:
                self.on_evict(leaf)
            if self.snapshots is not None:
                self.snapshots.free(leaf)
            self._free_slots(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key, 0)]
            if parent is not self.root and parent.is_leaf() and parent.lock_ref == 0:
                heapq.heappush(heap, entry(parent))
        return freed

    def clear(self) -> None:
        """Free every unlocked slot; raises if a request still locks part of the tree."""
        if self._protected:
            raise RuntimeError("cannot clear the radix cache while requests hold locks")
        self.evict(self._evictable, demote=False)
        self.reset()

    # ----------------------------------------------------------- inspection
    def _iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree holds, for accounting checks."""
        parts = [n.value for n in self._iter_nodes()]
        return torch.cat(parts) if parts else _EMPTY

    def check_integrity(self) -> None:
        """Raise AssertionError if the tree's structure or counters are inconsistent."""
        evictable = protected = 0
        for node in self._iter_nodes():
            assert node.key, "empty edge below the root"
            assert len(node.key) == len(node.value), "edge key and value lengths differ"
            assert len(node.key) % self.page_size == 0, "edge not page-aligned"
            assert node.parent is not None and node.parent.children.get(
                self._child_key(node.key, 0)
            ) is node, "child indexed under the wrong key"
            assert node.lock_ref >= 0, "negative lock count"
            if node.parent is not self.root:
                assert node.parent.lock_ref >= node.lock_ref, "child locked more than its parent"
                assert node.parent.reuse >= node.reuse, "child reused more often than its parent"
                assert node.parent.protect_until >= node.protect_until, "child hinted longer than its parent"
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert evictable == self._evictable, f"evictable {self._evictable} != counted {evictable}"
        assert protected == self._protected, f"protected {self._protected} != counted {protected}"
        slots = self.all_slots()
        assert len(torch.unique(slots)) == len(slots), "a slot appears twice in the tree"
        if self.snapshots is not None:
            self.snapshots.check()
            held = {n.snapshot for n in self._iter_nodes() if n.snapshot is not None}
            assert held == set(self.snapshots.holders), "a snapshot is held by a node no longer in the tree"

    def pretty_print(self) -> str:
        """An indented picture of the tree: each edge's tokens, length and lock count."""
        lines = [f"root (evictable={self._evictable}, protected={self._protected})"]

        def walk(node: TreeNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: c.key):
                shown = " ".join(map(str, child.key[:8])) + (" …" if len(child.key) > 8 else "")
                lines.append(f"{'  ' * depth}[{shown}] len={len(child.key)} lock={child.lock_ref}")
                walk(child, depth + 1)

        walk(self.root, 1)
        return "\n".join(lines)
