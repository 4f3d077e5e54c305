"""The Triton attention backend: split-KV decode and paged extend kernels over the KV pool.

Per batch, ``init_forward_metadata`` turns the row layout into small int32 device tensors once;
every layer then writes its new K/V into the pool and launches at most three kernels (decode
split, decode reduce, extend). Decode rows come first in the token order, so the decode output
is ``out[:num_decode]`` and extend row ``i`` starts at ``num_decode + sum(extend_lens[:i])``.

A layer's ``AttentionSpec`` goes to the kernels as arguments (scale, window, soft-cap, sinks);
nothing of it is in the per-batch metadata, so one metadata (a CUDA graph's included) serves
every layer: a sliding window is applied inside the kernels from each row's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels.triton_decode import decode_attention, num_kv_splits
from radixlm.kernels.triton_extend import extend_attention
from radixlm.runtime.layers.attention.base import DecodeCapturingBackend
from radixlm.runtime.layers.attention_spec import AttentionSpec
from radixlm.runtime.layers.forward_batch import ForwardBatch


@dataclass
class _TritonMeta:
    num_decode: int
    decode_rows: torch.Tensor  # [Bd] slot-table rows
    decode_seq_lens: torch.Tensor  # [Bd] int32, new token included
    num_splits: int
    extend_rows: torch.Tensor  # [Be] slot-table rows
    prefix_lens: torch.Tensor  # [Be] int32
    extend_lens: torch.Tensor  # [Be] int32
    q_starts: torch.Tensor  # [Be] int32, first token of each extend row in q
    max_extend_len: int
    mid_o: torch.Tensor | None = None  # [Bd, H, S, D] fp32, shared by all layers
    mid_lse: torch.Tensor | None = None  # [Bd, H, S] fp32


class TritonAttentionBackend(DecodeCapturingBackend):
    """Attention with Triton kernels; decode rows use split-KV, extend rows a causal paged kernel."""

    def __init__(self, min_split_tokens: int = 256, max_kv_splits: int = 16) -> None:
        self.min_split_tokens = min_split_tokens
        self.max_kv_splits = max_kv_splits

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build the decode and extend row tensors and choose the number of KV splits."""
        device = batch.req_to_token.device
        nd = batch.num_decode
        seq_lens = batch.seq_lens
        ext_prefix, ext_lens = batch.prefix_lens[nd:], batch.extend_lens[nd:]
        q_starts, start = [], nd
        for e in ext_lens:
            q_starts.append(start)
            start += e
        rows = batch.req_rows.to(device)
        num_kv = batch.kv_pool.num_kv_heads
        batch.attn_meta = _TritonMeta(
            num_decode=nd,
            decode_rows=rows[:nd],
            decode_seq_lens=_int32(seq_lens[:nd], device),
            num_splits=num_kv_splits(nd, num_kv, max(seq_lens[:nd], default=1), self.min_split_tokens, self.max_kv_splits),
            extend_rows=rows[nd:],
            prefix_lens=_int32(ext_prefix, device),
            extend_lens=_int32(ext_lens, device),
            q_starts=_int32(q_starts, device),
            max_extend_len=max(ext_lens, default=0),
        )

    def static_decode_metadata(self, req_rows: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, num_kv_heads: int) -> _TritonMeta:
        """Metadata of a decode-only batch over fixed ``req_rows`` (int64) and ``seq_lens`` (int32) tensors
        (a CUDA graph's inputs); the split count is fixed for ``max_seq_len`` and right for any shorter row."""
        n = req_rows.shape[0]
        empty = torch.zeros(0, dtype=torch.int32, device=req_rows.device)
        return _TritonMeta(
            num_decode=n,
            decode_rows=req_rows,
            decode_seq_lens=seq_lens,
            num_splits=num_kv_splits(n, num_kv_heads, max_seq_len, self.min_split_tokens, self.max_kv_splits),
            extend_rows=req_rows[n:],
            prefix_lens=empty,
            extend_lens=empty,
            q_starts=empty,
            max_extend_len=0,
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, spec: AttentionSpec | None = None
    ) -> torch.Tensor:
        """Write the new KV into the pool, then run the decode and extend kernels, as ``spec`` says, into one output."""
        pool, meta = batch.kv_pool, batch.attn_meta
        pool.write(layer, batch.out_slots, k, v)
        k_pool, v_pool = pool.k[layer], pool.v[layer]
        k_scale, v_scale = pool.k_scale[layer], pool.v_scale[layer]  # None unless the pool is 8-bit
        num_tokens, num_heads, head_dim = q.shape
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        nd = meta.num_decode
        if spec is None:
            spec = AttentionSpec.default(head_dim)
        opts = {"scale": spec.scale, "window": spec.window, "softcap": spec.softcap, "sinks": spec.sinks}
        if nd:
            if meta.mid_o is None or meta.mid_o.shape[1:] != (num_heads, meta.num_splits, head_dim):
                meta.mid_o = torch.empty(nd, num_heads, meta.num_splits, head_dim, dtype=torch.float32, device=q.device)
                meta.mid_lse = torch.empty(nd, num_heads, meta.num_splits, dtype=torch.float32, device=q.device)
            decode_attention(
                q[:nd], k_pool, v_pool, batch.req_to_token, meta.decode_rows, meta.decode_seq_lens,
                out[:nd], meta.num_splits, meta.mid_o, meta.mid_lse, k_scale, v_scale, **opts,
            )
        if meta.max_extend_len:
            extend_attention(
                q, k_pool, v_pool, out, batch.req_to_token, meta.extend_rows, meta.prefix_lens,
                meta.extend_lens, meta.q_starts, meta.max_extend_len, k_scale, v_scale, **opts,
            )
        return out.view(num_tokens, num_heads * head_dim)


def _int32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)
