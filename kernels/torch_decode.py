"""Decode attention on the PyTorch path, with shared prefixes attended once (cascade attention).

On a CPU, gathering each row's scattered KV costs more than the attention itself, and rows that
share a cached prefix (a few-shot preamble, a system prompt) would gather the same slots over
and over. So decode rows are grouped by the prefix of their slot-table rows that they share
(same slots, hence same tokens); for each group the queries of all its rows attend to the
prefix in one matmul (the prefix read once, as a slice when its slots are contiguous), every
row attends to its own short suffix, and the two partial softmaxes are merged by their
log-sum-exp::

    row a: [ shared prefix P ......... | a's suffix ]      out_a = merge(attn(q_a, P), attn(q_a, S_a))
    row b: [ shared prefix P ......... | b's longer suffix ]

A layer with a sliding window of ``W`` positions has a plan of its own, without shared prefixes:
a row of ``L`` positions attends to its last ``min(L, W)``, read in place from position
``L - W`` of its slot-table row. Soft-capped scores and attention sinks are per layer and plain
values here (``decode_attention``'s arguments); sinks are applied to the finished softmax from
its log-sum-exp (``out * sigmoid(lse - sink)``), where they join the denominator.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from radixlm.kernels.cpu_ext import cpu_kernels
from radixlm.kernels.kv_quant import PoolLayer
from radixlm.radix_cache.pool import PAD_SLOT

MIN_SHARED_PREFIX = 32  # shorter common prefixes are not worth a separate pass
MIN_SPLIT_TOKENS = 64  # C++ decode: a row is cut into chunks of at least this many positions


@dataclass
class SharedPrefix:
    """Decode rows sharing their first ``length`` slots."""

    rows: torch.Tensor  # indices into the decode rows
    slots: torch.Tensor  # [length]
    start: int | None  # first slot when the prefix slots are contiguous
    length: int


@dataclass
class DecodePlan:
    """Per-step index tensors of the decode rows, reused by every layer."""

    groups: list[SharedPrefix]
    table: torch.Tensor  # the request -> slot table
    rows: torch.Tensor  # [B] its rows
    row_table: torch.Tensor  # [B, Lmax] those rows of the table
    prefix_len: torch.Tensor  # [B] positions before the row's own part: a shared prefix, or outside the window
    suffix_len: torch.Tensor  # [B] positions after them, the row's own part (the new token included)
    _bias: dict = field(default_factory=dict)

    @functools.cached_property
    def suffix_mask(self) -> torch.Tensor:
        """``[B, 1, 1, S]`` bool: which padded suffix positions are real (the PyTorch path's)."""
        offsets = torch.arange(int(self.suffix_len.max()), device=self.suffix_len.device)
        return (offsets[None, :] < self.suffix_len[:, None])[:, None, None, :]

    @functools.cached_property
    def suffix_index(self) -> torch.Tensor:
        """``[B, S]`` slots after each row's shared prefix, padded (the PyTorch path gathers them)."""
        valid = self.suffix_mask[:, 0, 0, :]
        offsets = torch.arange(valid.shape[1], device=valid.device)
        positions = (self.prefix_len[:, None] + offsets[None, :]).clamp(max=self.row_table.shape[1] - 1)
        return self.row_table.gather(1, positions).masked_fill(~valid, PAD_SLOT)

    @functools.cached_property
    def longest_suffix(self) -> int:
        """The most positions a row has after its shared prefix."""
        return int(self.suffix_len.max()) if self.suffix_len.numel() else 0

    def suffix_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The suffix mask as an additive bias (0 / -inf) in ``dtype``, built once per step."""
        if dtype not in self._bias:
            zeros = torch.zeros(self.suffix_mask.shape, dtype=dtype, device=self.suffix_mask.device)
            self._bias[dtype] = zeros.masked_fill(~self.suffix_mask, float("-inf"))
        return self._bias[dtype]


def cpu_decode_splits(tasks: int, longest: int, threads: int, min_tokens: int = MIN_SPLIT_TOKENS) -> int:
    """Chunks per row for the C++ decode: enough (row, chunk) tasks to keep ``threads``
    busy (4 a thread, so uneven ones even out), none of fewer than ``min_tokens`` positions."""
    if threads <= 1 or tasks >= 4 * threads:
        return 1
    return max(1, min(math.ceil(4 * threads / max(tasks, 1)), longest // min_tokens))


def plan_decode(
    req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: list[int], min_shared: int | None = None, window: int | None = None
) -> DecodePlan:
    """Find shared prefixes among the rows; what is left of each row is indexed on demand. With a
    sliding ``window`` that some row outgrows, each row attends to its last ``window`` positions
    instead, and no prefix is shared."""
    min_shared = MIN_SHARED_PREFIX if min_shared is None else min_shared
    device = req_to_token.device
    table = req_to_token.index_select(0, rows)[:, : max(seq_lens)]
    seq = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    if window is not None and max(seq_lens) > window:
        skipped = (seq - window).clamp(min=0)
        return DecodePlan([], req_to_token, rows, table, skipped, seq - skipped)
    prefix_len = torch.zeros(len(seq_lens), dtype=torch.int64, device=device)
    groups: list[SharedPrefix] = []
    if len(seq_lens) >= 2:
        _, inverse, counts = torch.unique(table[:, 0], return_inverse=True, return_counts=True)
        for g in (counts >= 2).nonzero().flatten().tolist():
            idx = (inverse == g).nonzero().flatten()
            sub = table.index_select(0, idx)
            limit = int(seq.index_select(0, idx).min()) - 1  # every row keeps its newest token
            if limit < min_shared:
                continue
            same = (sub[:, :limit] == sub[0, :limit]).all(dim=0)
            length = int(same.to(torch.int64).cumprod(dim=0).sum())
            if length < min_shared:
                continue
            slots = sub[0, :length]
            contiguous = bool((slots[1:] - slots[:-1] == 1).all())
            groups.append(SharedPrefix(idx, slots, int(slots[0]) if contiguous else None, length))
            prefix_len[idx] = length
    return DecodePlan(groups, req_to_token, rows, table, prefix_len, seq - prefix_len)


_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` ``[B, H, Q, D]`` over ``k``/``v`` ``[B, H, L, D]``.

    Returns the normalized output and the log-sum-exp of the scores ``[B, H, Q, 1]`` (fp32),
    using PyTorch's fused CPU kernel where there is one and the scores are not soft-capped.
    The C++ decode stack computes a shared prefix's part with the same ops (decode_stack.cpp's
    ``attend``), so the two paths agree to the bit.
    """
    if softcap is None and _FLASH is not None and q.device.type == "cpu" and v.shape[-1] == q.shape[-1]:
        out, lse = _FLASH(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        return out, lse.unsqueeze(-1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores.float(), dim=-1, keepdim=True)
    return (torch.exp(scores.float() - lse) @ v.float()).to(q.dtype), lse


def _prefix_parts(qd: torch.Tensor, kv: PoolLayer, plan: DecodePlan, scale: float, softcap: float | None):
    """Each shared prefix once for all its rows: ``(rows, output [n, Hkv, G, Dv], lse [n, Hkv, G, 1])``.

    A prefix of a quantized (or other-dtype) pool is converted once per group, then shared by
    every row of the group: the block a shared prefix is, never the pool.
    """
    _, num_kv, group, head_dim = qd.shape
    for g in plan.groups:
        kp, vp = kv.read(slice(g.start, g.start + g.length) if g.start is not None else g.slots, qd.dtype)
        n = len(g.rows)
        rows_q = qd if n == qd.shape[0] else qd.index_select(0, g.rows)  # rows are sorted and distinct
        qg = rows_q.permute(1, 0, 2, 3).reshape(1, num_kv, n * group, head_dim)
        o2, lse2 = _partial(qg, kp.transpose(0, 1)[None], vp.transpose(0, 1)[None], None, scale, softcap)  # [1, Hkv, n*G, ...]
        yield g.rows, o2.view(num_kv, n, group, vp.shape[-1]).transpose(0, 1), lse2.view(num_kv, n, group, 1).transpose(0, 1)


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    plan: DecodePlan,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per row (``q`` ``[B, H, D]``) over the pool, at the positions
    ``plan`` gives each row (a sliding window is the plan's); returns ``[B, H, Dv]``.

    Values may be narrower than keys (``v_pool`` ``[N, Hkv, Dv]``, as a latent pool's, whose
    values are the first ``Dv`` columns of its keys): those run the PyTorch path, not the C++ one.

    The pool may be stored in another dtype than ``q`` (bf16, int8, fp8); 8-bit pools come with
    their ``[N, Hkv]`` scales. ``scale`` multiplies q·k (default ``D ** -0.5``), ``softcap`` caps
    the scores, ``sinks`` ``[H]`` are logits that join each head's softmax denominator.
    """
    bd, num_heads, head_dim = q.shape
    num_kv = k_pool.shape[1]
    group = num_heads // num_kv
    scale = head_dim**-0.5 if scale is None else scale
    qd = q.view(bd, num_kv, group, head_dim)
    kv = PoolLayer(k_pool, v_pool, k_scale, v_scale)
    parts = list(_prefix_parts(qd, kv, plan, scale, softcap))
    value_dim = v_pool.shape[-1]
    ext = cpu_kernels() if q.device.type == "cpu" and value_dim == head_dim else None
    if ext is not None:  # C++: each row's own positions, read in place, continuing its prefix part
        init_out = init_lse = None
        if len(parts) == 1 and len(parts[0][0]) == bd:  # one prefix shared by every row (in order)
            init_out, init_lse = parts[0][1], parts[0][2]
        elif parts:
            init_out = q.new_zeros(bd, num_kv, group, head_dim, dtype=torch.float32)
            init_lse = torch.full((bd, num_kv, group, 1), float("-inf"), device=q.device)
            for rows, o2, lse2 in parts:
                init_out[rows], init_lse[rows] = o2.float(), lse2
        splits = cpu_decode_splits(bd, plan.longest_suffix, torch.get_num_threads())
        out, lse = ext.paged_decode(
            q, k_pool, v_pool, plan.table, plan.rows, plan.prefix_len, plan.suffix_len, scale, init_out, init_lse, k_scale, v_scale, splits,
            softcap or 0.0,
        )  # fmt: skip
        if sinks is not None:  # the same ops as the C++ decode stack's, so the two agree to the bit
            out = out * torch.sigmoid(lse - sinks).unsqueeze(-1)
        return out.to(q.dtype)
    # PyTorch: gather each row's own positions (converted per gather), then merge with the prefix parts by their lse
    smax = plan.suffix_index.shape[1]
    ks, vs = kv.read(plan.suffix_index.reshape(-1), q.dtype)
    ks = ks.view(bd, smax, num_kv, head_dim).transpose(1, 2)
    vs = vs.view(bd, smax, num_kv, value_dim).transpose(1, 2)
    out, lse = _partial(qd, ks, vs, plan.suffix_bias(q.dtype), scale, softcap)  # [B, Hkv, G, D], [B, Hkv, G, 1]
    for rows, o2, lse2 in parts:
        o1, lse1 = out.index_select(0, rows), lse.index_select(0, rows)
        w1 = torch.sigmoid(lse1 - lse2)  # exp(lse1) / (exp(lse1) + exp(lse2))
        out[rows] = (o1 * w1 + o2 * (1 - w1)).to(out.dtype)
        if sinks is not None:  # the merged part's lse, which the sinks weigh against
            lse[rows] = torch.logaddexp(lse1, lse2)
    if sinks is not None:
        out = (out.float() * torch.sigmoid(lse - sinks.float().view(num_kv, group, 1))).to(out.dtype)
    return out.reshape(bd, num_heads, value_dim).to(q.dtype)
