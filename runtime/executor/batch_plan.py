"""The batch plan rank 0 broadcasts each step, so every rank runs the same ForwardBatch.

Two broadcasts per step: a fixed header (what to do and the sizes), then one int64 payload
holding the tokens, positions, KV slots, row layout and, for each row, its slot-table row up to
its sequence length. Workers get a compact slot table (row ``i`` of the batch is table row
``i``), so they never mirror rank 0's request table; slot numbers are the same on every rank.

A hybrid model's plan also carries a state part: each row's state-pool row (rank 0's table row,
which numbers every rank's state pool), how many states it stages and where it marks them, then the
``StateJournal`` of rank 0's commits, snapshots and restores since the last plan, which a worker
repeats before it runs the pass (``radixlm.radix_cache.state_journal``).
"""

from __future__ import annotations

import torch

from radixlm.radix_cache.state_journal import StateJournal, replay
from radixlm.radix_cache.state_pool import StatePool
from radixlm.radix_cache.state_snapshots import StateSnapshots
from radixlm.runtime.distributed.group import TPGroup
from radixlm.runtime.layers.forward_batch import ForwardBatch

OP_STOP, OP_FORWARD = 0, 1
_HEADER = 8  # op, tokens, rows, decode rows, logit rows, table width, inject a worker fault (tests), state part's length


def send_batch(group: TPGroup, batch: ForwardBatch, journal: StateJournal | None = None) -> None:
    """Broadcast ``batch``'s plan from rank 0 (with a hybrid model's state part and the
    ``journal`` drained into it, where one is given)."""
    seq_lens = batch.seq_lens
    width = max(seq_lens)
    table = batch.req_to_token.index_select(0, batch.req_rows)[:, :width]
    rows = torch.tensor([batch.prefix_lens, batch.extend_lens], dtype=torch.int64)
    state = [] if journal is None else _state_part(batch, journal)
    header = torch.tensor(
        [OP_FORWARD, len(batch.input_ids), batch.batch_size, batch.num_decode, len(batch.logits_indices), width, int(batch.inject_worker_fault), len(state)]
    )
    group.broadcast(header.to(group.device))
    parts = [batch.input_ids, batch.positions, batch.out_slots, rows.flatten(), batch.logits_indices, table.flatten(), torch.tensor(state, dtype=torch.int64)]
    group.broadcast(torch.cat([p.to(group.device, torch.int64) for p in parts]))


def _state_part(batch: ForwardBatch, journal: StateJournal) -> list[int]:
    """Each row's state-pool row, staged-state count and mark count, the marks, then the journal."""
    marks = batch.state_marks or [[] for _ in range(batch.batch_size)]
    keeps = [batch.state_keep(i) for i in range(batch.batch_size)]
    return [*batch.pool_rows.tolist(), *keeps, *(len(m) for m in marks), *(p for m in marks for p in m), *journal.drain()]


def send_stop(group: TPGroup) -> None:
    """Tell the workers to leave their loop."""
    group.broadcast(torch.tensor([OP_STOP] + [0] * (_HEADER - 1), device=group.device))


def receive_batch(
    group: TPGroup, kv_pool, attn_backend, state_pool: StatePool | None = None, snapshots: StateSnapshots | None = None
) -> ForwardBatch | None:
    """A worker's copy of rank 0's next batch, or None when told to stop. A hybrid model's
    worker (``state_pool`` and ``snapshots`` given) first repeats rank 0's state journal."""
    header = group.broadcast(torch.zeros(_HEADER, dtype=torch.int64, device=group.device), idle=True).tolist()
    op, tokens, rows, num_decode, num_logits, width, fault, state_len = header
    if op == OP_STOP:
        return None
    payload = group.broadcast(torch.empty(3 * tokens + 2 * rows + num_logits + rows * width + state_len, dtype=torch.int64, device=group.device))
    input_ids, positions, out_slots, lens, logits_indices, table, state = payload.split([tokens, tokens, tokens, 2 * rows, num_logits, rows * width, state_len])
    lens = lens.view(2, rows).tolist()
    state_rows = keeps = marks = None
    if state_len:
        if state_pool is None or snapshots is None:
            raise ValueError("the batch plan carries linear-attention states, but this worker's model keeps none")
        state = state.tolist()
        state_rows, keeps, counts = state[:rows], state[rows : 2 * rows], state[2 * rows : 3 * rows]
        flat, at = state[3 * rows :], 0
        marks = []
        for n in counts:
            marks.append(flat[at : at + n])
            at += n
        replay(flat[at:], state_pool, snapshots)
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        out_slots=out_slots,
        req_rows=torch.arange(rows, device=group.device),
        prefix_lens=lens[0],
        extend_lens=lens[1],
        num_decode=num_decode,
        logits_indices=logits_indices,
        req_to_token=table.view(rows, width),
        kv_pool=kv_pool,
        attn_backend=attn_backend,
        inject_worker_fault=bool(fault),
        state_pool=state_pool if state_len else None,
        state_keeps=keeps,
        state_marks=marks,
        state_rows=None if state_rows is None else torch.tensor(state_rows, dtype=torch.int64),
    )
