"""StateJournal: what rank 0 did to its linear-attention states between two passes, for the workers to repeat.

Under tensor parallelism every rank keeps the states of its own heads (``StatePool``) and snapshots
of them (``StateSnapshots``), but only rank 0 runs the scheduler and the radix tree: it alone knows
how many of a row's tokens were kept, which node gets a snapshot in which slot, and which
snapshot a new request resumes from. Its pool and store write each such decision here, as a run of
integers; the batch plan of the next pass carries them (``radixlm.runtime.executor.batch_plan``)
and each worker repeats them, in order, before that pass begins, while its pool still holds what
its last pass staged::

    commit  kept_1 .. kept_n  (a row's kept length, -1 for a row whose request ended)
    take    slot row length   (the row's states after ``length`` tokens into snapshot ``slot``)
    restore slot row length   (snapshot ``slot`` into the row, which resumes after ``length`` tokens)

Slots are rank 0's choice, so the workers' stores never choose: they hold what they are told.
Freeing a snapshot writes nothing (a worker's slot is simply written over when reused).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_COMMIT, _TAKE, _RESTORE = 1, 2, 3


class Commits(Protocol):
    """What a replay calls on a worker's ``StatePool`` (which writes this journal on rank 0)."""

    def commit(self, kept: list[int | None]) -> None:
        """Keep each row's staged state at its kept length."""


class Slots(Protocol):
    """What a replay calls on a worker's ``StateSnapshots``."""

    def write_row(self, slot: int, row: int, length: int) -> None:
        """Hold a row's states in a snapshot slot."""

    def restore_slot(self, slot: int, row: int, length: int) -> None:
        """Start a row from a snapshot slot."""


class StateJournal:
    """Rank 0's state decisions since the last batch plan was sent."""

    def __init__(self) -> None:
        self.ops: list[int] = []

    def commit(self, kept: Sequence[int | None]) -> None:
        """Rows kept these lengths of the last pass (None: nothing kept)."""
        self.ops += [_COMMIT, len(kept), *(-1 if k is None else k for k in kept)]

    def take(self, slot: int, row: int, length: int) -> None:
        """Snapshot ``slot`` now holds ``row``'s states after ``length`` tokens."""
        self.ops += [_TAKE, slot, row, length]

    def restore(self, slot: int, row: int, length: int) -> None:
        """``row`` resumes from snapshot ``slot``, after ``length`` tokens."""
        self.ops += [_RESTORE, slot, row, length]

    def drain(self) -> list[int]:
        """The operations written since the last drain, which are forgotten here."""
        ops, self.ops = self.ops, []
        return ops


def replay(ops: Sequence[int], pool: Commits, snapshots: Slots) -> None:
    """Repeat rank 0's ``ops`` (``StateJournal.drain``) on this rank's pool and snapshots; raises
    ValueError on a run that does not parse or a state this rank does not hold (the ranks diverged)."""
    i = 0
    while i < len(ops):
        op = ops[i]
        if op == _COMMIT:
            n = ops[i + 1]
            pool.commit([None if k < 0 else k for k in ops[i + 2 : i + 2 + n]])
            i += 2 + n
        elif op in (_TAKE, _RESTORE) and i + 4 <= len(ops):
            slot, row, length = ops[i + 1 : i + 4]
            if op == _TAKE:
                snapshots.write_row(slot, row, length)
            else:
                snapshots.restore_slot(slot, row, length)
            i += 4
        else:
            raise ValueError(f"state journal: operation {op} at {i} of {len(ops)} is not one rank 0 writes")
