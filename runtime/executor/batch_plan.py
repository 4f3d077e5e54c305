"""The batch plan rank 0 broadcasts each step, so every rank runs the same ForwardBatch.

Two broadcasts per step: a fixed header (what to do and the sizes), then one int64 payload
holding the tokens, positions, KV slots, row layout and, for each row, its slot-table row up to
its sequence length. Workers get a compact slot table (row ``i`` of the batch is table row
``i``), so they never mirror rank 0's request table; slot numbers are the same on every rank.
"""

from __future__ import annotations

import torch

from radixlm.runtime.distributed.group import TPGroup
from radixlm.runtime.layers.forward_batch import ForwardBatch

OP_STOP, OP_FORWARD = 0, 1
_HEADER = 7  # op, tokens, rows, decode rows, logit rows, table width, inject a worker fault (tests)


def send_batch(group: TPGroup, batch: ForwardBatch) -> None:
    """Broadcast ``batch``'s plan from rank 0."""
    seq_lens = batch.seq_lens
    width = max(seq_lens)
    table = batch.req_to_token.index_select(0, batch.req_rows)[:, :width]
    rows = torch.tensor([batch.prefix_lens, batch.extend_lens], dtype=torch.int64)
    header = torch.tensor(
        [OP_FORWARD, len(batch.input_ids), batch.batch_size, batch.num_decode, len(batch.logits_indices), width, int(batch.inject_worker_fault)]
    )
    group.broadcast(header.to(group.device))
    parts = [batch.input_ids, batch.positions, batch.out_slots, rows.flatten(), batch.logits_indices, table.flatten()]
    group.broadcast(torch.cat([p.to(group.device, torch.int64) for p in parts]))


def send_stop(group: TPGroup) -> None:
    """Tell the workers to leave their loop."""
    group.broadcast(torch.tensor([OP_STOP] + [0] * (_HEADER - 1), device=group.device))


def receive_batch(group: TPGroup, kv_pool, attn_backend) -> ForwardBatch | None:
    """A worker's copy of rank 0's next batch, or None when told to stop."""
    header = group.broadcast(torch.zeros(_HEADER, dtype=torch.int64, device=group.device), idle=True).tolist()
    op, tokens, rows, num_decode, num_logits, width, fault = header
    if op == OP_STOP:
        return None
    payload = group.broadcast(torch.empty(3 * tokens + 2 * rows + num_logits + rows * width, dtype=torch.int64, device=group.device))
    input_ids, positions, out_slots, lens, logits_indices, table = payload.split([tokens, tokens, tokens, 2 * rows, num_logits, rows * width])
    lens = lens.view(2, rows).tolist()
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
    )
