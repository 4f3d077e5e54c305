"""StateSnapshots: linear-attention states held by radix-tree nodes, so hybrid models reuse prefixes.

A hybrid model's prefix is reusable only where the linear-attention layers' state after it is known:
KV pages can be cut at any page, a recurrent state cannot. So some tree nodes hold a **snapshot**:
the conv and recurrent states of every linear layer after the node's last token (a fixed size per
snapshot, whatever the prefix length). A match stops at the deepest node on its path that holds
one (``RadixCache.match_prefix``), and the request starts from a copy of it in its state-pool slot.

Where snapshots are taken (the scheduler decides, ``radixlm.runtime.scheduler``):

- at the end of every request that hands its KV to the tree (finished or retracted), when its KV
  length is page-aligned;
- while a prompt is computed, at the deepest page boundary before its last token (where an
  identical prompt's match ends), and at the point where its KV match went past the deepest
  snapshot (a branch point other prompts share: a common system prompt is snapshotted there once).

The store has a fixed number of slots; taking one when all are used drops the snapshot of the least
recently used node (its KV stays, still useful under deeper snapshots). A node evicted from the tree
frees its snapshot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from radixlm.radix_cache.state_pool import StatePool

if TYPE_CHECKING:
    from radixlm.radix_cache.state_journal import StateJournal


class TreeNode(Protocol):
    """What the store reads and sets on a node of the radix tree (``radixlm.radix_cache.tree.TreeNode``)."""

    snapshot: int | None
    last_access: int


class StateSnapshots:
    """``capacity`` snapshots of a ``StatePool``'s per-request states, each held by one tree node."""

    def __init__(self, pool: StatePool, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("a snapshot store needs at least one slot")
        self.pool = pool
        self.conv = torch.zeros((capacity, *pool.conv.shape[:1], *pool.conv.shape[2:]), dtype=pool.conv.dtype, device=pool.conv.device)
        self.state = torch.zeros((capacity, *pool.state.shape[:1], *pool.state.shape[2:]), dtype=pool.state.dtype, device=pool.state.device)
        self.holders: dict[int, TreeNode] = {}  # slot -> the node holding it
        self._free = list(range(capacity - 1, -1, -1))
        self.taken = 0  # snapshots written
        self.dropped = 0  # snapshots given up for room (their nodes stay in the tree)
        self.journal: StateJournal | None = None  # rank 0 of a tensor-parallel group: where takes and restores are written for the workers

    @property
    def capacity(self) -> int:
        """Snapshots the store can hold."""
        return self.conv.shape[0]

    def nbytes(self) -> int:
        """Bytes the store holds."""
        return self.conv.nbytes + self.state.nbytes

    def __len__(self) -> int:
        return len(self.holders)

    def take(self, node: TreeNode, conv: torch.Tensor, state: torch.Tensor) -> bool:
        """Give ``node`` the states ``conv`` ``[layers, *conv_shape]`` and ``state`` ``[layers, *state_shape]``
        (the states after its last token); a node that holds one already keeps it (False)."""
        if node.snapshot is not None:
            return False
        if not self._free:
            oldest = min(self.holders, key=lambda s: self.holders[s].last_access)
            self.free(self.holders[oldest])
            self.dropped += 1
        slot = self._free.pop()
        try:
            self._write(slot, conv, state)
        except BaseException:
            self._free.append(slot)
            raise
        self.holders[slot] = node
        node.snapshot = slot
        self.taken += 1
        return True

    def take_row(self, node: TreeNode, row: int, length: int) -> bool:
        """Give ``node`` request-table row ``row``'s states after ``length`` tokens (its node's
        depth); False where the pool no longer (or not yet) knows them."""
        states = self.pool.state_at(row, length)
        if states is None:
            return False
        if self.take(node, *states) and self.journal is not None:
            self.journal.take(node.snapshot, row, length)
        return True

    def restore(self, node: TreeNode, row: int, length: int) -> None:
        """Start request-table row ``row`` from ``node``'s snapshot (the states after ``length`` tokens)."""
        self.restore_slot(node.snapshot, row, length)
        if self.journal is not None:
            self.journal.restore(node.snapshot, row, length)

    def write_row(self, slot: int, row: int, length: int) -> None:
        """Hold row ``row``'s states after ``length`` tokens in ``slot`` (a worker repeating rank 0's take)."""
        states = self.pool.state_at(row, length)
        if states is None:
            raise ValueError(f"state snapshot {slot}: row {row} holds no states after {length} tokens")
        self._write(slot, *states)

    def restore_slot(self, slot: int, row: int, length: int) -> None:
        """Start row ``row`` from the states in ``slot`` (after ``length`` tokens)."""
        self.pool.load(row, self.conv[slot], self.state[slot], length)

    def _write(self, slot: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        self.conv[slot].copy_(conv)
        self.state[slot].copy_(state)

    def free(self, node: TreeNode) -> None:
        """Drop ``node``'s snapshot (it is being evicted, or its slot is needed)."""
        slot = node.snapshot
        if slot is None:
            return
        node.snapshot = None
        del self.holders[slot]
        self._free.append(slot)

    def clear(self) -> None:
        """Drop every snapshot (the tree was reset)."""
        for node in list(self.holders.values()):
            self.free(node)

    def check(self) -> None:
        """Assert every slot is either free or held by exactly one node that points back at it."""
        assert len(self._free) + len(self.holders) == self.capacity, "a snapshot slot leaked"
        assert all(node.snapshot == slot for slot, node in self.holders.items()), "a node lost track of its snapshot"
