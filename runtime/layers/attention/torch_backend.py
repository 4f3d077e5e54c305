"""The PyTorch attention backend: batched decode over the pool, and extend rows one by one.

The reference the other backends are tested against, and the CPU path (its decode kernel runs
the C++ kernels where they built; see ``radixlm.kernels.torch_decode``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels.attention import extend_attention
from radixlm.kernels.torch_decode import DecodePlan, decode_attention, plan_decode
from radixlm.runtime.layers.attention.base import AttentionBackend, register_attention_backend
from radixlm.runtime.layers.forward_batch import ForwardBatch

VERIFY_AS_DECODE_MAX = 16  # extend rows this short over a cached prefix attend as decode queries


@dataclass
class _TorchMeta:
    decode: DecodePlan | None
    extend_rows: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]]
    # (token start, prefix len, extend len, slots of the whole row or None, mask or None)
    decode_tokens: torch.Tensor | None = None  # token indices of the decode queries, when not 0 .. nd-1


@register_attention_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """Scaled-dot-product attention in PyTorch: batched for decode rows, per row for extends."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build the padded decode index and the per-row extend slot lists once per batch.

        A short extend row over a cached prefix (the token before some drafts, and the drafts:
        a verify row) becomes one decode query per token, query ``i`` seeing ``p + i + 1``
        positions: the decode kernel reads the pool in place and shares the row's prefix among
        its queries, where the extend path would gather the whole prefix for one small block.
        """
        nd = batch.num_decode
        rows, lens, tokens = [], list(batch.seq_lens[:nd]), []  # rows and tokens: of verify queries
        extend_rows = []
        start = nd
        for i in range(nd, batch.batch_size):
            p, e = batch.prefix_lens[i], batch.extend_lens[i]
            if p and e <= VERIFY_AS_DECODE_MAX:
                row = int(batch.req_rows[i])
                rows += [row] * e
                lens += range(p + 1, p + e + 1)
                tokens += range(start, start + e)
                start += e
                continue
            slots = mask = None
            if p:
                slots = batch.req_to_token[batch.req_rows[i], : p + e]
                q_pos = torch.arange(e, device=slots.device)[:, None] + p
                mask = torch.arange(p + e, device=slots.device)[None, :] <= q_pos
            extend_rows.append((start, p, e, slots, mask))
            start += e
        decode = decode_tokens = None
        if lens:
            query_rows = batch.req_rows[:nd]
            if rows:
                device = batch.req_to_token.device
                query_rows = torch.cat([query_rows, torch.tensor(rows, dtype=torch.int64, device=device)])
                decode_tokens = torch.cat([torch.arange(nd, device=device), torch.tensor(tokens, dtype=torch.int64, device=device)])
            decode = plan_decode(batch.req_to_token, query_rows, lens)
        batch.attn_meta = _TorchMeta(decode, extend_rows, decode_tokens)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        """Write the new KV, then attend decode rows together and extend rows one by one.

        Every row attends to the KV as the pool stores it: a row without a cached prefix reads its
        own new tokens back through the pool when the pool converts them (bf16, int8, fp8), so a
        prompt sees the same keys whether or not its prefix was cached, and later decode steps
        see what it saw.
        """
        pool, meta = batch.kv_pool, batch.attn_meta
        pool.write(layer, batch.out_slots, k, v)
        num_tokens, num_heads, head_dim = q.shape
        num_kv = k.shape[1]
        group = num_heads // num_kv
        out = torch.empty_like(q)
        scales = {"k_scale": pool.k_scale[layer], "v_scale": pool.v_scale[layer]}
        if meta.decode_tokens is not None:
            qd = q.index_select(0, meta.decode_tokens)
            out.index_copy_(0, meta.decode_tokens, decode_attention(qd, pool.k[layer], pool.v[layer], meta.decode, **scales))
        elif meta.decode is not None:
            nd = batch.num_decode
            out[:nd] = decode_attention(q[:nd], pool.k[layer], pool.v[layer], meta.decode, **scales)
        converts = pool.dtype != q.dtype
        for start, _prefix, e, slots, mask in meta.extend_rows:
            qe = q[start : start + e]
            if slots is None and not converts:
                ke, ve = k[start : start + e], v[start : start + e]
            else:
                ke, ve = pool.read(layer, batch.out_slots[start : start + e] if slots is None else slots, q.dtype)
            out[start : start + e] = extend_attention(qe, ke, ve, mask, group)
        return out.view(num_tokens, num_heads * head_dim)
