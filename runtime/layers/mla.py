"""DeepSeek's multi-head latent attention (MLA) over a latent KV pool, in the absorbed form.

Each token's keys and values are compressed into one latent ``c_kv`` (``kv_lora_rank`` wide,
after ``kv_a_layernorm``) plus one RoPE key ``k_pe`` (``qk_rope_head_dim``) shared by every head.
Per head, ``kv_b_proj`` expands the latent into a "nope" key (``W_UK``) and a value (``W_UV``).
The pool keeps only ``[c_kv | k_pe]`` per token and layer (a latent pool, see
``radixlm.radix_cache.pool``). Attention never expands it: the query's nope part is multiplied
into the latent space per head (``q_nope · W_UK``), so every head's score is one dot product
with the stored row, and the output, a mix of latents, is multiplied out per head by ``W_UV``::

    q = [q_nope · W_UK | rope(q_pe)]  [T, H, R + P]      k = [c_kv | rope(k_pe)]  [T, 1, R + P]
    o = softmax(q · kᵀ · scale) · c_kv               [T, H, R]      (MQA: one KV head, v = k[:, :R])
    out = o_proj(o · W_UVᵀ)                          [T, hidden]

``q · k`` here equals ``q_nope · (W_UK c_kv) + q_pe · k_pe``, the expanded form's score, so the
two forms agree up to fp32 rounding (``expanded_attention`` is that form, kept as the reference).
The scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times YaRN's ``mscale²`` where
the RoPE scaling has ``mscale_all_dim`` (as transformers' ``yarn_apply_mscale``).

Under tensor parallelism each rank keeps its heads' rows of ``q_proj``/``q_b_proj`` and
``kv_b_proj`` and its heads' columns of ``o_proj`` (summed by one all-reduce); the latent
projections and norms are whole on every rank, and so is each rank's latent pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixlm.runtime.layers.attention_spec import AttentionSpec
from radixlm.runtime.layers.forward_batch import ForwardBatch
from radixlm.runtime.layers.norm import RMSNorm
from radixlm.runtime.layers.rope import apply_rotary

if TYPE_CHECKING:
    from radixlm.runtime.distributed.group import TPGroup

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers builds them with the default eps, not rms_norm_eps


@dataclass(frozen=True)
class MLASpec:
    """The ranks and head widths of a multi-head latent attention layer (as DeepSeek's configs name them)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: a plain q_proj (DeepSeek-V2-Lite)
    rope_interleave: bool = True  # the checkpoint's RoPE dims rotate in (even, odd) pairs

    @property
    def qk_head_dim(self) -> int:
        """Width of each head's query and key in the expanded form."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def row_dim(self) -> int:
        """Width of one token's row in the latent pool: the latent and the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def softmax_scale(self, rope_scaling: dict[str, Any] | None) -> float:
        """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` where the scaling sets it."""
        scale = self.qk_head_dim**-0.5
        params = rope_scaling or {}
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind != "default" and params.get("mscale_all_dim"):
            factor = float(params["factor"])
            mscale = 1.0 if factor <= 1 else 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale


class LatentProjection(nn.Module):
    """``kv_b_proj``: per head, the rows that expand a latent into its nope key (``W_UK``) and its value (``W_UV``).

    Kept as a plain weight ``[H * (nope + v), R]`` in the checkpoint's layout, not a linear layer:
    the absorbed form multiplies by its per-head blocks, and weight quantization leaves it whole."""

    def __init__(self, num_heads: int, spec: MLASpec) -> None:
        super().__init__()
        self.num_heads, self.nope, self.v = num_heads, spec.qk_nope_head_dim, spec.v_head_dim
        self.weight = nn.Parameter(torch.empty(num_heads * (self.nope + self.v), spec.kv_lora_rank))

    @property
    def w_uk(self) -> torch.Tensor:
        """``[H, nope, R]``: each head's nope key of a latent is ``W_UK[h] @ c_kv``."""
        return self.weight.view(self.num_heads, self.nope + self.v, -1)[:, : self.nope]

    @property
    def w_uv(self) -> torch.Tensor:
        """``[H, v, R]``: each head's value of a latent is ``W_UV[h] @ c_kv``."""
        return self.weight.view(self.num_heads, self.nope + self.v, -1)[:, self.nope :]


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_nope`` ``[T, H, nope]`` into the latent space: ``[T, H, R]`` (per head ``q_nope[h] @ W_UK[h]``)."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def expand_output(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Attention outputs in the latent space ``[T, H, R]`` to the heads' values ``[T, H, v]`` (per head ``o[h] @ W_UV[h]ᵀ``)."""
    return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def expanded_attention(
    q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, kv_b: torch.Tensor, v_head_dim: int, scale: float, mask: torch.Tensor
) -> torch.Tensor:
    """The expanded form (transformers'), for reference: per-head keys and values from the latents, then attention.

    ``q_nope`` ``[T, H, nope]``, ``q_pe`` ``[T, H, P]`` (rotated), ``c_kv`` ``[L, R]``, ``k_pe``
    ``[L, P]`` (rotated), ``kv_b`` ``[H * (nope + v), R]``, ``mask`` ``[T, L]`` (True: visible);
    returns ``[T, H, v]``."""
    num_heads, nope = q_nope.shape[1], q_nope.shape[2]
    kv = (c_kv @ kv_b.t()).view(c_kv.shape[0], num_heads, nope + v_head_dim)
    k = torch.cat([kv[..., :nope], k_pe[:, None, :].expand(-1, num_heads, -1)], dim=-1)  # [L, H, nope + P]
    q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, nope + P]
    scores = torch.einsum("thd,lhd->htl", q.float(), k.float()) * scale
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("htl,lhd->thd", weights, kv[..., nope:].float()).to(q_nope.dtype)


class LatentAttention(nn.Module):
    """Multi-head latent attention of one layer over a latent KV pool (the absorbed form, for prefill and decode alike)."""

    def __init__(
        self, hidden_size: int, num_heads: int, spec: MLASpec, layer_id: int, scale: float, bias: bool = False,
        rope_table: int | None = 0, group: TPGroup | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.spec, self.layer_id, self.num_heads, self.group, self.rope_table = spec, layer_id, num_heads, group, rope_table
        q_out = num_heads * spec.qk_head_dim
        if spec.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, spec.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, spec.row_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentProjection(num_heads, spec)
        self.o_proj = nn.Linear(num_heads * spec.v_head_dim, hidden_size, bias=bias)
        self.attention = AttentionSpec(scale)

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query's nope and (rotated) RoPE parts ``[T, H, nope]``, ``[T, H, P]`` and the pool rows ``[T, 1, R + P]`` of ``x``."""
        spec, tokens = self.spec, x.shape[0]
        q = self.q_proj(x) if spec.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(tokens, self.num_heads, spec.qk_head_dim).split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = q_pe.contiguous(), k_pe.contiguous().view(tokens, 1, spec.qk_rope_head_dim)
        if rope is not None:
            q_pe, k_pe = apply_rotary(q_pe, k_pe, rope)
        rows = torch.cat([self.kv_a_layernorm(c_kv.contiguous()).unsqueeze(1), k_pe], dim=-1)
        return q_nope, q_pe, rows

    def forward(self, ropes: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Write the new tokens' latent rows into the pool and attend every head over its sequence's rows."""
        q_nope, q_pe, rows = self.project(x, None if self.rope_table is None else ropes[self.rope_table])
        q = torch.cat([absorb_query(q_nope, self.kv_b_proj.w_uk), q_pe], dim=-1)  # [T, H, R + P]
        rank = self.spec.kv_lora_rank
        o = batch.attn_backend.forward(q, rows, rows[..., :rank], self.layer_id, batch, self.attention)  # [T, H * R]
        out = self.o_proj(expand_output(o.view(-1, self.num_heads, rank), self.kv_b_proj.w_uv).reshape(x.shape[0], -1))
        return out if self.group is None else self.group.all_reduce(out)
