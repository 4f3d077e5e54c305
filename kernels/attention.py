"""The attention backend interface and its PyTorch implementation (the CPU path and reference).

A backend serves two kinds of rows in one batch (see ``ForwardBatch``):

- decode rows: one new query token attends to every token of its sequence in the pool;
- extend rows: ``e`` new tokens attend to the ``p`` cached tokens of their sequence and causally
  to each other (new token ``i`` sees positions ``0 .. p + i``).

Before attending, the backend writes the new tokens' K and V into the pool at ``out_slots``; a
row's keys are then read through its slot-table row ``req_to_token[row, :p + e]``.
Grouped-query attention maps query head ``h`` to KV head ``h // (H / Hkv)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.kernels.torch_decode import DecodePlan, decode_attention, plan_decode
from radixlm.runtime.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Computes attention for a ForwardBatch over the paged KV pool."""

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare whatever index tensors every layer of this batch will reuse."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        """Store ``k``/``v`` ``[T, Hkv, D]`` in the pool and attend ``q`` ``[T, H, D]``; returns ``[T, H*D]``."""


@dataclass
class _TorchMeta:
    decode: DecodePlan | None
    extend_rows: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]]
    # (token start, prefix len, extend len, slots of the whole row or None, mask or None)


class TorchAttentionBackend(AttentionBackend):
    """Scaled-dot-product attention in PyTorch: batched for decode rows, per row for extends."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build the padded decode index and the per-row extend slot lists once per batch."""
        nd = batch.num_decode
        decode = plan_decode(batch.req_to_token, batch.req_rows[:nd], batch.seq_lens[:nd]) if nd else None
        extend_rows = []
        start = nd
        for i in range(nd, batch.batch_size):
            p, e = batch.prefix_lens[i], batch.extend_lens[i]
            slots = mask = None
            if p:
                slots = batch.req_to_token[batch.req_rows[i], : p + e]
                q_pos = torch.arange(e, device=slots.device)[:, None] + p
                mask = torch.arange(p + e, device=slots.device)[None, :] <= q_pos
            extend_rows.append((start, p, e, slots, mask))
            start += e
        batch.attn_meta = _TorchMeta(decode, extend_rows)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        """Write the new KV, then attend decode rows together and extend rows one by one."""
        pool, meta = batch.kv_pool, batch.attn_meta
        pool.write(layer, batch.out_slots, k, v)
        num_tokens, num_heads, head_dim = q.shape
        num_kv = k.shape[1]
        group = num_heads // num_kv
        out = torch.empty_like(q)
        nd = batch.num_decode
        if nd:
            out[:nd] = decode_attention(q[:nd], pool.k[layer], pool.v[layer], meta.decode)
        for start, _prefix, e, slots, mask in meta.extend_rows:
            qe = q[start : start + e]
            if slots is None:
                ke, ve = k[start : start + e], v[start : start + e]
            else:
                ke, ve = pool.k[layer].index_select(0, slots), pool.v[layer].index_select(0, slots)
            out[start : start + e] = _extend_attention(qe, ke, ve, mask, group)
        return out.view(num_tokens, num_heads * head_dim)


def _extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, group: int) -> torch.Tensor:
    """Causal GQA for one row: ``q`` ``[e, H, D]``, ``k``/``v`` ``[L, Hkv, D]``, ``mask`` ``[e, L]``."""
    e, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    # Fold each KV head's query group into the query-length axis: rows are (token, group member).
    qg = q.view(e, num_kv, group, head_dim).permute(1, 0, 2, 3).reshape(num_kv, e * group, head_dim)
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)
    if mask is None:  # no prefix: plain causal over the new tokens
        mask = torch.ones(e, e, dtype=torch.bool, device=q.device).tril()
    if group > 1:
        mask = mask.repeat_interleave(group, dim=0)
    o = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=mask)
    return o.view(num_kv, e, group, head_dim).permute(1, 0, 2, 3).reshape(e, num_heads, head_dim)


def reference_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, prefix_len: int
) -> torch.Tensor:
    """Plain-loop attention for one row, for tests: ``q`` ``[e, H, D]`` over ``slots`` ``[p + e]``."""
    k = k_pool[slots].float()
    v = v_pool[slots].float()
    e, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    out = torch.empty(e, num_heads, head_dim)
    for i in range(e):
        visible = prefix_len + i + 1
        for h in range(num_heads):
            scores = (k[:visible, h // group] @ q[i, h].float()) / head_dim**0.5
            out[i, h] = torch.softmax(scores, 0) @ v[:visible, h // group]
    return out
