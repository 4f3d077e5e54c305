"""From scheduled rows to one ForwardBatch, and where each row's logits land.

A row computes positions ``start .. start + length`` of one request. Logits are computed only
where needed: at the positions whose next prompt token has a requested logprob, and, for a row
that reaches the end of its sequence, at the last ``1 + len(draft_ids)`` positions (the one
before each unverified draft token, and the last one, which picks the next token).
A pooling row (``runtime/pooling.py``) asks for final hidden states instead: every position it
computes (mean), or its prompt's last one (last); a score row, for that position's logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixlm.radix_cache.manager import KVManager
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.layers.forward_batch import ForwardBatch
from radixlm.runtime.lora.batch import LoraBatch
from radixlm.runtime.lora.manager import LoraManager
from radixlm.runtime.request import Req


@dataclass
class Row:
    """One request's share of a forward pass."""

    req: Req
    start: int  # first position computed
    length: int  # positions computed
    sample: bool  # the row reaches the end of its sequence and picks tokens


@dataclass
class LogitSpans:
    """Index ranges into the logits tensor, per purpose."""

    prompt: list[tuple[Row, int, int, int]] = field(default_factory=list)  # row, first logit, first position, count
    picks: list[tuple[Row, int, int]] = field(default_factory=list)  # row, first logit, count
    pooled: list[tuple[Row, int, int]] = field(default_factory=list)  # row, first hidden state (of batch.hidden_indices), count
    scores: list[tuple[Row, int]] = field(default_factory=list)  # row, logit of its prompt's last position


def build_forward_batch(rows: list[Row], kv: KVManager, runner: ModelRunner) -> tuple[ForwardBatch, LogitSpans]:
    """Lay the rows out as one batch (decode-shaped rows first) and record the logit spans."""
    rows.sort(key=lambda r: (r.length != 1, r.req.lora or ""))  # each adapter's rows together (runtime/lora/batch.py)
    device = runner.device
    ids: list[int] = []
    positions, out_slots, logit_rows, hidden_rows = [], [], [], []
    spans = LogitSpans()
    n_tokens = 0
    for row in rows:
        req = row.req
        end = row.start + row.length
        ids.extend(req.fill_ids[row.start : end])
        positions.append(torch.arange(row.start, end))
        out_slots.append(kv.slots(req.kv, row.start, end))
        if req.needs_prompt_logprobs():
            lo = max(row.start, max(req.logprob_start_len, 1) - 1)
            hi = min(end, len(req.input_ids) - 1)
            if hi > lo:
                spans.prompt.append((row, len(logit_rows), lo, hi - lo))
                logit_rows.extend(range(n_tokens + lo - row.start, n_tokens + hi - row.start))
        if row.sample:
            count = 1 + len(req.draft_ids)
            spans.picks.append((row, len(logit_rows), count))
            logit_rows.extend(range(n_tokens + row.length - count, n_tokens + row.length))
        if req.pooling is not None:
            _pooling_rows(row, n_tokens, spans, logit_rows, hidden_rows)
        n_tokens += row.length
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.cat(positions).to(device),
        out_slots=torch.cat(out_slots),
        req_rows=torch.tensor([r.req.kv.row for r in rows], dtype=torch.int64, device=device),
        prefix_lens=[r.start for r in rows],
        extend_lens=[r.length for r in rows],
        num_decode=sum(1 for r in rows if r.length == 1),
        logits_indices=torch.tensor(logit_rows, dtype=torch.int64, device=device),
        req_to_token=kv.table.table,
        kv_pool=runner.kv_pool,
        attn_backend=runner.attn_backend,
        hidden_indices=torch.tensor(hidden_rows, dtype=torch.int64, device=device) if hidden_rows else None,
        lora=_lora_batch(rows, getattr(runner, "lora", None)),
        state_pool=runner.state_pool,
        state_keeps=None if runner.state_pool is None else [_state_keep(r) for r in rows],
        state_marks=None if runner.state_pool is None else [[p for p in r.req.state_marks if r.start < p <= r.start + r.length] for r in rows],
    )
    return batch, spans


def _state_keep(row: Row) -> int:
    """After how many of the row's last tokens a linear-attention state must be staged: every
    position from where KV may be cut back after the pass (before the drafts) to the row's end."""
    req, end = row.req, row.start + row.length
    return min(row.length, max(1, end - (req.seq_len - 1 - len(req.draft_ids)) + 1))


def _lora_batch(rows: list[Row], lora: LoraManager | None) -> LoraBatch | None:
    """The LoRA segments of the laid-out rows (None: LoRA is off, or no row has an adapter)."""
    return None if lora is None else lora.batch_for([r.length for r in rows], [r.req.lora for r in rows])


def _pooling_rows(row: Row, n_tokens: int, spans: LogitSpans, logit_rows: list[int], hidden_rows: list[int]) -> None:
    """Ask for what a pooling row needs: hidden states (all its positions for mean, the prompt's
    last for last) or, for a score, the prompt's last position's logits."""
    task, end = row.req.pooling, row.start + row.length
    last = n_tokens + row.length - 1
    if task.mode == "score":
        if end == row.req.seq_len:
            spans.scores.append((row, len(logit_rows)))
            logit_rows.append(last)
    elif task.mode == "mean":
        spans.pooled.append((row, len(hidden_rows), row.length))
        hidden_rows.extend(range(n_tokens, n_tokens + row.length))
    elif end == row.req.seq_len:
        spans.pooled.append((row, len(hidden_rows), 1))
        hidden_rows.append(last)
