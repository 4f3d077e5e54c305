"""Triton decode attention over the paged KV pool, split-KV ("flash-decoding") style.

Each decode row has one query token. Its sequence (``seq_lens[b]`` tokens, whose slots are
``req_to_token[req_rows[b], :seq_lens[b]]``) is cut into ``num_splits`` chunks::

    stage 1, grid (B, Hkv, S):  chunk s of row b, all query heads of KV head g
        -> partial output o[b, h, s, :] (already divided by its softmax sum) and
           lse[b, h, s] = log-sum-exp of the chunk's scores (-inf for an empty chunk)
    stage 2, grid (B, H):       o[b, h] = sum_s exp(lse_s - max lse) o_s / sum_s exp(lse_s - max lse)

Splitting keeps the GPU busy when the batch is small and sequences are long; with one split
stage 2 is a plain copy. ``num_splits`` is a runtime argument of both kernels, not a compile-time
constant: a step with another split count reuses the compiled kernels, and a captured CUDA graph
stays correct for any sequence lengths with the split count it was captured with (each program
derives its chunk from its row's length). Scores are kept in the base-2 domain (``exp2``) with ``log2(e)`` folded
into the scale; everything is accumulated in fp32 and the output is cast to ``q``'s dtype.

An 8-bit pool (int8, float8) is read as stored, one ``[BLOCK_N, D]`` block at a time, and
dequantized in registers (fp32 values times the block's per-slot scales of this KV head); the
dots then run in fp32. A 16-bit pool under an fp32 ``q`` is converted to fp32 the same way.

A layer's attention spec (see ``radixlm.runtime.layers.attention_spec``) is honoured in the
kernels: the scale is an argument; a sliding window of ``W`` positions narrows each row's key
range to ``[max(0, seq_len - W), seq_len)``, derived in stage 1 from ``seq_lens`` (so a captured
CUDA graph stays right) and split into the chunks as the whole sequence would be; a logit
soft-cap runs ``cap * tanh(score / cap)`` on each score; sinks (one logit per query head) join
the denominator in stage 2. Each is a compile-time flag, off for plain layers, whose kernels are
then the same as without them.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
REDUCE_BLOCK_S = 16  # stage 2 reads this many split slots (masked): one compiled variant for 1-16 splits
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# Scores in the base-2 domain from raw dot products q·k. Without SOFTCAP: dots * qk_scale, where
# qk_scale = scale * log2(e). With SOFTCAP (cap c): c * tanh(scale * dots / c) * log2(e), where
# qk_scale = 2 * log2(e) * scale / c and softcap = c * log2(e). tanh(x) = 1 - 2 / (exp(2x) + 1)
# (Triton has no portable tanh): exp2 overflows to inf for large x, giving 1, and underflows to 0
# for very negative x, giving -1, so no NaN arises.
@triton.jit
def scaled_scores(dots, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """Base-2 scores from raw q·k dot products: scaled, and soft-capped when SOFTCAP."""
    if SOFTCAP:
        return softcap * (1.0 - 2.0 / (tl.exp2(dots * qk_scale) + 1.0))
    else:
        return dots * qk_scale


# Stage 1. Grid (B, Hkv, S): program (b, g, s) handles KV head g of decode row b over chunk s of
# its sequence, for all query heads h = g * GROUP + i (i < GROUP, padded to BLOCK_H >= 16 rows
# so the score and value products are tensor-core dots). It runs an online softmax over the
# chunk in steps of BLOCK_N tokens and stores the normalized partial output and its log-sum-exp.
# UPCAST: q, K and V go to fp32 before the dots (the pool's dtype differs from q's); HAS_SCALES:
# the pool is 8-bit and each loaded K/V row is multiplied by its slot's scale for KV head g.
# HAS_WINDOW: the row's keys start at max(0, seq_len - window); SOFTCAP: see ``scaled_scores``.
@triton.jit
def _decode_split_kernel(
    q, k_pool, v_pool, k_scale, v_scale, req_to_token, req_rows, seq_lens, mid_o, mid_lse,
    stride_qb, stride_qh,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_ksn, stride_ksh, stride_vsn, stride_vsh,
    stride_rt,
    stride_mb, stride_mh, stride_ms,
    stride_lb, stride_lh,
    qk_scale, softcap, window, num_splits,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, HAS_SCALES: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)

    seq_len = tl.load(seq_lens + b)
    row = tl.load(req_rows + b).to(tl.int64)
    if HAS_WINDOW:  # the new token (position seq_len - 1) sees the last `window` positions
        first = tl.maximum(seq_len - window, 0)
    else:
        first = 0
    chunk = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + s * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = g * GROUP + offs_h

    q_ptrs = q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    qv = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        qv = qv.to(tl.float32)
    else:
        qv = qv.to(k_pool.dtype.element_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < end
        slots = tl.load(req_to_token + row * stride_rt + pos, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        kb = tl.load(k_pool + slots[:, None] * stride_kn + g * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        vb = tl.load(v_pool + slots[:, None] * stride_vn + g * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            kb = kb.to(tl.float32)
            vb = vb.to(tl.float32)
        if HAS_SCALES:
            kb = kb * tl.load(k_scale + slots * stride_ksn + g * stride_ksh, mask=mask_n, other=0.0).to(tl.float32)[:, None]
            vb = vb * tl.load(v_scale + slots * stride_vsn + g * stride_vsh, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        scores = scaled_scores(tl.dot(qv, tl.trans(kb), input_precision=DOT_PRECISION), qk_scale, softcap, SOFTCAP)
        scores = tl.where(mask_n[None, :], scores, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty chunk (start >= end) stores lse = -inf and a zero output; stage 2 gives it weight 0.
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    o_ptrs = mid_o + b * stride_mb + heads[:, None] * stride_mh + s * stride_ms + offs_d[None, :]
    tl.store(o_ptrs, out, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(mid_lse + b * stride_lb + heads * stride_lh + s, lse, mask=mask_h)


# Stage 2. Grid (B, H): program (b, h) loads the num_splits partial outputs and log-sum-exps of
# query head h of row b, weights each chunk by exp2(lse_s - max_s lse_s) and writes the
# normalized sum to out[b, h] in the output's dtype. HAS_SINKS: head h's sink logit (natural
# units, fp32 or 16-bit) joins the denominator as a chunk with no value.
@triton.jit
def _decode_reduce_kernel(
    mid_o, mid_lse, out, sinks,
    stride_mb, stride_mh, stride_ms,
    stride_lb, stride_lh,
    stride_ob, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(mid_lse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    top = tl.max(lse, 0)  # the first chunk is never empty, so the max is finite
    if HAS_SINKS:
        sink = tl.load(sinks + h).to(tl.float32) * 1.4426950408889634  # to the base-2 domain
        top = tl.maximum(top, sink)
    weights = tl.exp2(lse - top)
    o_ptrs = mid_o + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :]
    parts = tl.load(o_ptrs, mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    total = tl.sum(weights, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - top)
    result = tl.sum(parts * weights[:, None], 0) / total
    tl.store(out + b * stride_ob + h * stride_oh + offs_d, result.to(out.dtype.element_ty), mask=mask_d)


def compute_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype the dots run in: the pool's when ``q`` has it, else fp32 (8-bit pools, bf16 KV under fp32 q)."""
    return kv_dtype if kv_dtype == q_dtype else torch.float32


def full_size_tiles(kv_dtype: torch.dtype, compute: torch.dtype) -> bool:
    """Whether the 16-bit tile sizes fit shared memory: yes unless fp32 dots read >= 2-byte KV.

    Shared memory holds the pipelined loads (``num_stages`` tiles in the pool's dtype) and the
    dot operands (in ``compute``). At the 16-bit sizes a 1-byte pool's loads take half of what
    an fp32 pool's take at its halved sizes, and its fp32 operands twice: about the same total,
    so 8-bit KV keeps the 16-bit sizes (fewer steps, fewer scale loads); fp32 KV, or 16-bit KV
    under fp32 dots (loads as large as the 16-bit path's, operands twice), halves them.
    """
    return compute != torch.float32 or kv_dtype.itemsize == 1


def decode_block_n(head_dim: int, kv_dtype: torch.dtype, compute: torch.dtype) -> int:
    """Tokens per inner-loop step: 64 for 16- and 8-bit KV, fewer for fp32 so tiles fit shared memory."""
    if INTERPRET:  # small, so tiny test shapes still take several steps and chunks
        return 16
    if not full_size_tiles(kv_dtype, compute):
        return 32 if head_dim <= 128 else 16
    return 64


def dot_precision(dtype: torch.dtype) -> str:
    """The ``tl.dot`` input precision for a compute dtype: exact ``ieee`` for fp32, default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def kv_scale_args(
    k_pool: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int], bool]:
    """``(k_scale, v_scale, their strides, has_scales)`` for a kernel; the pool stands in when unscaled."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass both k_scale and v_scale, or neither")
    if k_scale is None:
        if k_pool.element_size() == 1:
            raise ValueError(f"a {k_pool.dtype} KV pool needs its k_scale and v_scale")
        return k_pool, k_pool, (0, 0, 0, 0), False  # never read: HAS_SCALES=False drops the loads
    if k_scale.shape != k_pool.shape[:2] or v_scale.shape != k_pool.shape[:2]:
        raise ValueError(f"scales must be [num_slots, num_kv_heads] = {list(k_pool.shape[:2])}")
    return k_scale, v_scale, (*k_scale.stride(), *v_scale.stride()), True


def score_args(head_dim: int, scale: float | None, softcap: float | None) -> tuple[float, float, bool]:
    """``(qk_scale, softcap, has_softcap)`` kernel arguments for a score scale (None: ``head_dim ** -0.5``) and soft-cap."""
    if scale is None:
        scale = head_dim**-0.5
    if softcap is None or softcap == 0:
        return scale * _LOG2E, 0.0, False
    if softcap < 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    return 2.0 * _LOG2E * scale / softcap, softcap * _LOG2E, True


def window_arg(window: int | None) -> tuple[int, bool]:
    """``(window, has_window)`` kernel arguments for a sliding window (None or 0: none)."""
    if not window:
        return 0, False
    if window < 0:
        raise ValueError(f"window must be positive, got {window}")
    return int(window), True


def sinks_arg(sinks: torch.Tensor | None, num_heads: int, stand_in: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(sinks, has_sinks)`` kernel arguments: the ``[H]`` sink logits, contiguous; ``stand_in`` (never read) when None."""
    if sinks is None:
        return stand_in, False
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks must be [num_heads] = [{num_heads}], got {list(sinks.shape)}")
    if sinks.device != stand_in.device:
        raise ValueError(f"sinks are on {sinks.device}, the attention's tensors on {stand_in.device}")
    return sinks.contiguous(), True


def num_kv_splits(
    batch_size: int,
    num_kv_heads: int,
    max_seq_len: int,
    min_split_tokens: int = 256,
    max_splits: int = 16,
    target_programs: int = 512,
) -> int:
    """Chunks per decode sequence: enough programs to fill a GPU, none under ``min_split_tokens``."""
    by_length = math.ceil(max_seq_len / max(min_split_tokens, 1))
    by_occupancy = math.ceil(target_programs / max(batch_size * num_kv_heads, 1))
    return max(1, min(by_length, by_occupancy, max_splits))


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
    mid_o: torch.Tensor | None = None,
    mid_lse: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend ``q`` ``[B, H, D]`` (one token per row) over the pool; writes and returns ``out`` ``[B, H, D]``.

    ``seq_lens`` (int32, ``[B]``) counts each row's tokens including the new one, whose KV must
    already be in the pool. ``mid_o`` ``[B, H, S, D]`` and ``mid_lse`` ``[B, H, S]`` (fp32) are the
    partial-result buffers; pass them to reuse one allocation across layers. An 8-bit pool
    needs ``k_scale`` and ``v_scale`` ``[num_slots, num_kv_heads]``, read per block in place.
    ``scale`` multiplies q·k (None: ``D ** -0.5``); ``window`` (None or 0: none) limits each row
    to its last ``window`` positions; ``softcap`` caps scores at ``softcap * tanh(s / softcap)``;
    ``sinks`` ``[H]`` are per-head logits added to the softmax denominator.
    """
    batch, num_heads, head_dim = q.shape
    num_kv = k_pool.shape[1]
    if batch == 0:
        return out
    if num_heads % num_kv:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv})")
    group = num_heads // num_kv
    if q.stride(2) != 1 or out.stride(2) != 1 or k_pool.stride(2) != 1 or v_pool.stride(2) != 1:
        raise ValueError("the last (head_dim) dimension of q, out and the pools must be contiguous")
    if mid_o is None:
        mid_o = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    if mid_lse is None:
        mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_h = max(16, triton.next_power_of_2(group))
    k_scale, v_scale, scale_strides, has_scales = kv_scale_args(k_pool, k_scale, v_scale)
    compute = compute_dtype(q.dtype, k_pool.dtype)
    qk_scale, cap, has_softcap = score_args(head_dim, scale, softcap)
    window, has_window = window_arg(window)
    sinks, has_sinks = sinks_arg(sinks, num_heads, mid_lse)
    _decode_split_kernel[(batch, num_kv, num_splits)](
        q, k_pool, v_pool, k_scale, v_scale, req_to_token, req_rows, seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        *scale_strides,
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        qk_scale, cap, window, num_splits,
        HEAD_DIM=head_dim, GROUP=group,
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=decode_block_n(head_dim, k_pool.dtype, compute),
        DOT_PRECISION=dot_precision(compute), UPCAST=compute != k_pool.dtype, HAS_SCALES=has_scales,
        HAS_WINDOW=has_window, SOFTCAP=has_softcap,
        num_warps=4 if block_d <= 128 else 8, num_stages=2,
    )
    _decode_reduce_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, sinks,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), num_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=max(REDUCE_BLOCK_S, triton.next_power_of_2(num_splits)), BLOCK_D=block_d, HAS_SINKS=has_sinks,
        num_warps=2 if block_d <= 128 else 4,
    )
    return out
