"""KVManager: the per-request KV bookkeeping over the pool, the slot table and the radix tree.

A running request's slot-table row is split in three (``P`` = page size)::

    positions: 0 ........ cached_len ........ kv_len ..... alloc_len
               [  tree-owned, locked  ][ owned, KV written ][ owned, reserved ]
               (shared with others)    (freed or handed to  (tail of the last page)
                                        the tree on release)

``cached_len`` and ``alloc_len`` are whole pages. Every slot is at any time exactly one of: free in
the allocator, held by the tree, or owned by one running request (``alloc_len - cached_len`` of
them); ``check_accounting`` verifies that. Only this class changes these lengths: the
scheduler and decoder ask it to (``reserve``, ``mark_computed``, ``truncate``, ``slide``, ``release``).

On a model whose every layer attends within a sliding window of ``W`` positions, the next token
at position ``n`` reads only positions ``n - W + 1 .. n``, so ``slide`` lets go of whole pages
before that (``dropped_len``): owned ones go back to the allocator, and a tree-owned prefix that
slid out entirely is unlocked (it stays in the tree, evictable, for later requests). The row
keeps its stale slot numbers there; every attention path starts reading at the window::

    positions: 0 ...... dropped_len ...... kv_len ..... alloc_len
               [ let go: free, or  ][ owned, KV written ][ reserved ]
                 tree-owned unlocked

A request that let go of anything never hands its KV to the tree: its row has holes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from radixlm.radix_cache.origin import Origin
from radixlm.radix_cache.pool import SlotAllocator
from radixlm.radix_cache.req_table import ReqToTokenTable
from radixlm.radix_cache.tiers import KVTiers
from radixlm.radix_cache.tree import RadixCache, TreeNode

logger = logging.getLogger(__name__)


@dataclass
class KVState:
    """Where one request's KV lives."""

    row: int
    last_node: TreeNode
    cached_len: int = 0
    kv_len: int = 0
    alloc_len: int = 0
    origin: Origin | None = None  # recorded on the tree nodes this request's KV creates
    dropped_len: int = 0  # positions before it slid out of every layer's window and were let go

    @property
    def held_from(self) -> int:
        """The first position whose slot this request owns (after the tree's part and what it let go)."""
        return max(self.cached_len, self.dropped_len)

    @property
    def owned(self) -> int:
        """Slots this request holds that the tree does not."""
        return self.alloc_len - self.held_from


class KVManager:
    """Allocates, shares, caches and frees the KV slots of requests."""

    def __init__(self, allocator: SlotAllocator, table: ReqToTokenTable, tree: RadixCache) -> None:
        self.allocator = allocator
        self.table = table
        self.tree = tree
        self.page_size = allocator.page_size
        self.tiers: KVTiers | None = None

    def attach_tiers(self, tiers: KVTiers) -> None:
        """Keep what the tree evicts in ``tiers`` and load it back at admission (``promote``)."""
        self.tiers = tiers
        tree = self.tree

        def demote(leaf: TreeNode) -> None:
            path = tree.path_tokens(leaf)
            tiers.demote(path, tree.path_slots(leaf), len(path) - len(leaf.key), leaf.protect_until)

        tree.on_evict = demote

    # ------------------------------------------------------------- capacity
    def available(self) -> int:
        """Slots obtainable now: free plus evictable."""
        return self.allocator.available_slots() + self.tree.evictable_size()

    def headroom(self, state: KVState, new_len: int) -> int:
        """Positions below ``new_len`` that have no slot reserved yet."""
        return max(new_len - state.alloc_len, 0)

    def pages_for(self, state: KVState | None, new_len: int) -> int:
        """Slots (whole pages) needed to grow a row from its ``alloc_len`` to ``new_len`` tokens."""
        have = state.alloc_len if state is not None else 0
        need = max(new_len - have, 0)
        return -(-need // self.page_size) * self.page_size

    def _alloc(self, num_slots: int) -> torch.Tensor | None:
        short = num_slots - self.allocator.available_slots()
        if short > 0:
            self.tree.evict(short)
        return self.allocator.alloc_slots(num_slots)

    # ------------------------------------------------------------- lifecycle
    def match(self, tokens: Sequence[int], max_len: int) -> tuple[torch.Tensor, TreeNode]:
        """Cached slots for the longest prefix of ``tokens[:max_len]`` and the node ending it."""
        result = self.tree.match_prefix(tokens[: max(max_len, 0)])
        return result.slots, result.last_node

    def close_tiers(self) -> None:
        """At shutdown: demote every block the tree still holds, then let the tiers finish their writes."""
        tiers = self.tiers
        if tiers is None:
            return
        if tiers.disk is not None and not tiers.disk.stopped:
            tiers.closing = True
            stack = [self.tree.root]
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                if node.is_leaf() and node is not self.tree.root:
                    path = self.tree.path_tokens(node)
                    tiers.demote(path, self.tree.path_slots(node), 0, node.protect_until)
        tiers.close()

    def promote(
        self, tokens: Sequence[int], max_len: int, prefix_slots: torch.Tensor, last_node: TreeNode, staged: dict | None = None
    ) -> tuple[torch.Tensor, TreeNode, dict[str, int]]:
        """Extend a match with the KV the lower tiers hold past it: load it into new slots, hand
        them to the tree, and return the longer match and the tokens it took from each tier.
        ``staged``: blocks a prefetch read for this request. Returns the match unchanged (and
        ``{}``) when the tiers hold nothing or the pool is short."""
        tiers = self.tiers
        start = len(prefix_slots)
        found = tiers.find(tokens, start, max_len, staged) if tiers is not None and not self.tree.disable else None
        if found is None:
            return prefix_slots, last_node, {}
        self.tree.inc_lock_ref(last_node)  # making room must not evict the prefix being extended
        try:
            slots = self._alloc(found.end - start)
        finally:
            self.tree.dec_lock_ref(last_node)
        if slots is None:
            return prefix_slots, last_node, {}
        try:
            tiers.load(found, slots)
        except Exception:
            self.allocator.free_slots(slots)
            raise
        loaded = found.tokens_from()
        kept = self.tree.insert(tokens[: found.end], torch.cat([prefix_slots, slots]), tier=max(loaded, key=loaded.get))
        if kept > start:  # the tree held part of it after all: those slots are duplicates
            self.allocator.free_slots(slots[: kept - start])
        result = self.tree.match_prefix(tokens[: found.end], whole_kv=True)
        return result.slots, result.last_node, loaded

    def admit(self, prefix_slots: torch.Tensor, last_node: TreeNode, origin: Origin | None = None) -> KVState | None:
        """Give a request a table row seeded with its cached prefix; locks the prefix.

        Returns None when no table row is free.
        """
        row = self.table.alloc()
        if row is None:
            return None
        n = len(prefix_slots)
        if n and self.tree.snapshots is not None:  # a hybrid model resumes its linear layers from the match's snapshot
            try:
                self.tree.snapshots.restore(last_node, row, n)
            except BaseException:
                self.table.free(row)
                raise
        self.tree.inc_lock_ref(last_node)
        self.table.write(row, 0, prefix_slots)
        return KVState(row=row, last_node=last_node, cached_len=n, kv_len=n, alloc_len=n, origin=origin)

    def reserve(self, state: KVState, new_len: int) -> bool:
        """Make sure positions ``< new_len`` have slots; False (nothing changed) when short.

        All or nothing: raises ValueError (holding nothing new) past the slot table's width.
        """
        need = self.pages_for(state, new_len)
        if need == 0:
            return True
        if state.alloc_len + need > self.table.max_context_len:
            raise ValueError(f"{new_len} positions do not fit a slot-table row of {self.table.max_context_len}")
        slots = self._alloc(need)
        if slots is None:
            return False
        self.table.write(state.row, state.alloc_len, slots)
        state.alloc_len += need
        return True

    def mark_computed(self, state: KVState, end: int) -> None:
        """Record that positions ``< end`` now hold computed KV."""
        if end > state.alloc_len:
            raise ValueError(f"position {end} has no reserved slot (alloc_len {state.alloc_len})")
        state.kv_len = end

    def truncate(self, state: KVState, length: int) -> None:
        """Forget computed KV from position ``length`` on (rejected drafts) and give the whole
        pages past it back to the allocator at once (never tree-owned ones)."""
        state.kv_len = max(min(state.kv_len, length), state.cached_len)
        keep = -(-max(length, state.kv_len) // self.page_size) * self.page_size
        if keep < state.alloc_len:
            self.allocator.free_slots(self.table.read(state.row, keep, state.alloc_len).clone())
            state.alloc_len = keep

    def slide(self, state: KVState, window: int) -> None:
        """Let go of the whole pages that slid out of a ``window``-position sliding window for
        every layer (positions before ``kv_len - window + 1``, where the next token's window starts)."""
        boundary = (state.kv_len - window + 1) // self.page_size * self.page_size
        if boundary <= state.dropped_len:
            return
        if state.dropped_len == 0 and state.cached_len and boundary >= state.cached_len:
            self.tree.dec_lock_ref(state.last_node)  # the shared prefix is behind the window: evictable again
            state.last_node = self.tree.root
        start = state.held_from
        if boundary > start:
            self.allocator.free_slots(self.table.read(state.row, start, boundary).clone())
        if boundary >= state.cached_len or state.dropped_len:
            state.dropped_len = boundary

    def slots(self, state: KVState, start: int, end: int) -> torch.Tensor:
        """The slots of positions ``start .. end`` of a request."""
        return self.table.read(state.row, start, end)

    def cache_prefix(self, state: KVState, tokens: Sequence[int]) -> None:
        """Share a running request's computed KV (``tokens[:kv_len]``) through the tree.

        The tree adopts the page-aligned part; slots it already had are freed and the request's
        row is pointed at the tree's copies; the lock moves to the new end of the path.
        """
        computed = min(state.kv_len, len(tokens))  # never more than the tokens we can name
        aligned = computed - computed % self.page_size
        if aligned <= state.cached_len or self.tree.disable or state.dropped_len:
            return
        row_slots = self.table.read(state.row, 0, aligned)
        present = self.tree.insert(tokens[:aligned], row_slots, state.origin)
        if present > state.cached_len:
            self.allocator.free_slots(row_slots[state.cached_len : present].clone())
        result = self.tree.match_prefix(tokens[:aligned], whole_kv=True)
        self.table.write(state.row, 0, result.slots)
        self.tree.inc_lock_ref(result.last_node)
        self.tree.dec_lock_ref(state.last_node)
        state.last_node = result.last_node
        state.cached_len = len(result.slots)

    def release(self, state: KVState, tokens: Sequence[int] | None) -> None:
        """Free a request's KV: with ``tokens``, first hand its computed KV to the tree.

        A request that failed passes ``tokens=None``: its KV may be wrong and is never cached.
        """
        if tokens is not None:
            self.cache_prefix(state, tokens)
            snapshots = self.tree.snapshots
            if snapshots is not None and state.cached_len and not state.dropped_len:  # where its KV in the tree ends, if the state there is known
                try:
                    snapshots.take_row(state.last_node, state.row, state.cached_len)
                except Exception:  # a snapshot is an optimisation: never a reason to keep KV
                    logger.exception("taking a state snapshot at release failed")
        if state.alloc_len > state.held_from:
            self.allocator.free_slots(self.table.read(state.row, state.held_from, state.alloc_len).clone())
        self.tree.dec_lock_ref(state.last_node)
        self.table.free(state.row)
        state.alloc_len = state.kv_len = state.cached_len = state.dropped_len = 0

    def snapshot_points(self, tokens: Sequence[int], max_len: int, cached: int) -> list[int]:
        """Where a hybrid model's prompt should leave state snapshots (past its ``cached`` match):
        where its KV match ends, when that is past the deepest snapshot (a prefix other prompts
        share), and the deepest page boundary within ``max_len`` (where an identical prompt's
        match ends)."""
        if self.tree.snapshots is None or self.tree.disable:
            return []
        shared = self.tree.match_prefix(tokens[: max(max_len, 0)], whole_kv=True).length
        last = max(max_len, 0) // self.page_size * self.page_size
        return sorted({p for p in (shared, last) if p > cached})

    def take_snapshots(self, state: KVState, tokens: Sequence[int], positions: Iterable[int]) -> None:
        """Hand a running request's states marked at ``positions`` in its last pass to the tree
        nodes ending there, where its KV up to them is in the tree."""
        for position in positions:
            if position > state.cached_len or state.dropped_len:
                continue
            node = self.tree.match_prefix(tokens[:position], whole_kv=True).last_node  # splits an edge to end exactly there
            self.tree.snapshots.take_row(node, state.row, position)

    def flush(self) -> None:
        """Drop the whole radix cache and the host tier (only when no request holds a lock); the disk tier stays."""
        self.tree.clear()
        if self.tiers is not None:
            self.tiers.clear_host()

    # ------------------------------------------------------------ accounting
    def check_accounting(self, states: Iterable[KVState], full: bool = True) -> None:
        """Assert free + tree + running-owned slots equals the pool, with no slot counted twice.

        ``full=False`` checks the counts and each request's lengths only (cheap: once per step).
        """
        states = list(states)
        for s in states:
            assert s.cached_len <= s.kv_len <= s.alloc_len <= self.table.max_context_len, f"bad KV lengths {s}"
            assert s.dropped_len <= s.kv_len, f"let go of KV past what was computed {s}"
            assert s.cached_len % self.page_size == 0 and s.alloc_len % self.page_size == 0, f"unaligned KV lengths {s}"
            assert s.dropped_len % self.page_size == 0, f"unaligned KV lengths {s}"
        owned = sum(s.owned for s in states)
        total = self.allocator.num_slots
        free = self.allocator.available_slots()
        in_tree = self.tree.total_size()
        assert free + in_tree + owned == total, (
            f"KV slots leaked: free {free} + tree {in_tree} + running {owned} != total {total}"
        )
        if not full:
            return
        self.tree.check_integrity()
        if self.tiers is not None:
            self.tiers.check()
        free_pages = self.allocator.free_page_ids()
        held = [self.table.read(s.row, s.held_from, s.alloc_len) for s in states]
        parts = [self.allocator.page_slots(free_pages), self.tree.all_slots(), *held]
        everything = torch.cat([p.cpu() for p in parts])  # slots may live on the GPU, the empty ones on the CPU
        assert len(torch.unique(everything)) == total, "a KV slot is counted twice"
