"""Triton extend (prefill with a cached prefix) attention over the paged KV pool.

Extend row ``i`` has ``prefix_lens[i]`` cached tokens and ``extend_lens[i]`` new tokens whose
queries sit at ``q[q_starts[i] : q_starts[i] + extend_lens[i]]``. New token ``j`` sees sequence
positions ``0 .. prefix_len + j``.

Design choice: every key and value, the new tokens' included, is read **through the pool**
(``req_to_token[req_rows[i], :prefix_len + extend_len]``), because the backend stores the new
K/V there before calling the kernel. One loop with one causal test (key position <= query
position) then covers prefix and new tokens alike, and the kernel attends to exactly the
values later decode steps will read (the pool's dtype, not the projection's). The cost is an
indirect gather for the new tokens too, which SGLang's two-loop design avoids; the new tokens
are a small share of the keys once a prefix is cached, and without a prefix the gather is the
same as the prefix's.

An 8-bit pool is read as stored and dequantized per ``[BLOCK_N, D]`` block in registers, as in
``triton_decode``; the dots then run in fp32 (so do they for a 16-bit pool under an fp32 ``q``).

A layer's attention spec is honoured as in ``triton_decode``: the scale is an argument; a
sliding window of ``W`` positions masks keys with ``q_pos - k_pos >= W`` and starts each query
block's loop at the first key its earliest query sees, skipping the blocks before it; a soft-cap
maps each score through ``cap * tanh(score / cap)``; sinks join each query's softmax
denominator after the loop. Each is a compile-time flag, off (and compiled away) for plain layers.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from radixlm.kernels.triton_decode import (
    compute_dtype,
    dot_precision,
    full_size_tiles,
    kv_scale_args,
    scaled_scores,
    score_args,
    sinks_arg,
    window_arg,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# Grid (B_ext, H, cdiv(max_extend_len, BLOCK_M)): program (i, h, m) takes query head h of the
# new tokens m * BLOCK_M .. (m + 1) * BLOCK_M of extend row i (a block past the row's end does
# nothing), and runs an online softmax over that row's keys 0 .. prefix + last token of the
# block in steps of BLOCK_N, masking keys that come after each query. KV head = h // GROUP.
# UPCAST: q, K and V go to fp32 before the dots; HAS_SCALES: each loaded K/V row is multiplied
# by its slot's scale for the KV head (an 8-bit pool). HAS_WINDOW: keys window or more positions
# before a query are masked, and the loop starts at the block's earliest query's first visible key;
# SOFTCAP: see ``triton_decode.scaled_scores``; HAS_SINKS: head h's sink logit joins the denominator.
@triton.jit
def _extend_kernel(
    q, k_pool, v_pool, k_scale, v_scale, out, req_to_token, req_rows, prefix_lens, extend_lens, q_starts, sinks,
    stride_qt, stride_qh,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_ksn, stride_ksh, stride_vsn, stride_vsh,
    stride_ot, stride_oh,
    stride_rt,
    qk_scale, softcap, window,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, HAS_SCALES: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M

    row = tl.load(req_rows + i).to(tl.int64)
    prefix = tl.load(prefix_lens + i)
    extend = tl.load(extend_lens + i)
    q_start = tl.load(q_starts + i).to(tl.int64)
    kv_head = h // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < extend
    mask_d = offs_d < HEAD_DIM
    q_pos = prefix + offs_m  # sequence position of each query

    q_ptrs = q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
    qv = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        qv = qv.to(tl.float32)
    else:
        qv = qv.to(k_pool.dtype.element_ty)

    # Keys up to the block's last query; none when the block lies past the row's end.
    end = tl.where(m0 < extend, prefix + tl.minimum(extend, m0 + BLOCK_M), 0)
    if HAS_WINDOW:  # the block's first query (position prefix + m0) sees keys from here on
        first = tl.maximum(prefix + m0 - window + 1, 0)
    else:
        first = 0
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(first, end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < end
        slots = tl.load(req_to_token + row * stride_rt + pos, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        kb = tl.load(k_pool + slots[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        vb = tl.load(v_pool + slots[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            kb = kb.to(tl.float32)
            vb = vb.to(tl.float32)
        if HAS_SCALES:
            ks = tl.load(k_scale + slots * stride_ksn + kv_head * stride_ksh, mask=mask_n, other=0.0)
            vs = tl.load(v_scale + slots * stride_vsn + kv_head * stride_vsh, mask=mask_n, other=0.0)
            kb = kb * ks.to(tl.float32)[:, None]
            vb = vb * vs.to(tl.float32)[:, None]
        scores = scaled_scores(tl.dot(qv, tl.trans(kb), input_precision=DOT_PRECISION), qk_scale, softcap, SOFTCAP)
        visible = (pos[None, :] <= q_pos[:, None]) & mask_n[None, :]  # [BLOCK_M, BLOCK_N]
        if HAS_WINDOW:
            visible = visible & (q_pos[:, None] - pos[None, :] < window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        if HAS_WINDOW:
            # A query may see no key of this step yet (its window starts later): keep its max
            # finite for the exponents so they give 0, not NaN.
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        # Without a window, the loop's first key (key 0) is visible to every query row, so each
        # row's running max is finite after step 1.
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=DOT_PRECISION)
        m_i = m_new

    if HAS_SINKS:  # a term exp(sink) with no value, rescaled with the rest to the larger max
        sink = tl.load(sinks + h).to(tl.float32) * 1.4426950408889634  # to the base-2 domain
        m_all = tl.maximum(m_i, sink)
        rescale = tl.exp2(m_i - m_all)
        l_i = l_i * rescale + tl.exp2(sink - m_all)
        acc = acc * rescale[:, None]
    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, result.to(out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_block_sizes(head_dim: int, kv_dtype: torch.dtype, compute: torch.dtype) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)``: 64x64 up to D=128 (8-bit KV too), half as many keys per step for fp32."""
    if INTERPRET:  # tiny blocks so test shapes still cross block boundaries
        return 16, 16, 4
    # fp32 tiles take twice the shared memory; halving them keeps fp32 under ~64 KiB
    # (8-bit loads are small enough to keep the full sizes: see ``full_size_tiles``).
    shrink = 1 if full_size_tiles(kv_dtype, compute) else 2
    if head_dim <= 128:
        return 64 // shrink, 64 // shrink, 4
    return 32, 32 // shrink, 8


def extend_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    q_starts: torch.Tensor,
    max_extend_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens ``q`` ``[T, H, D]`` over their rows' pool slots; fills ``out``.

    ``req_rows``, ``prefix_lens``, ``extend_lens`` and ``q_starts`` (int32, ``[B_ext]``) describe
    the extend rows; ``q_starts[i]`` indexes into ``q``/``out``. Every row's KV, the new tokens'
    included, must already be written at ``req_to_token[row, :prefix + extend]``. An 8-bit pool
    needs ``k_scale`` and ``v_scale`` ``[num_slots, num_kv_heads]``, read per block in place.
    ``scale`` multiplies q·k (None: ``D ** -0.5``); ``window`` (None or 0: none) limits each query
    to its last ``window`` positions, its own included; ``softcap`` caps scores at
    ``softcap * tanh(s / softcap)``; ``sinks`` ``[H]`` are per-head logits added to the softmax denominator.
    """
    num_rows = req_rows.shape[0]
    _, num_heads, head_dim = q.shape
    num_kv = k_pool.shape[1]
    if num_rows == 0 or max_extend_len == 0:
        return out
    if num_heads % num_kv:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv})")
    if q.stride(2) != 1 or out.stride(2) != 1 or k_pool.stride(2) != 1 or v_pool.stride(2) != 1:
        raise ValueError("the last (head_dim) dimension of q, out and the pools must be contiguous")
    k_scale, v_scale, scale_strides, has_scales = kv_scale_args(k_pool, k_scale, v_scale)
    compute = compute_dtype(q.dtype, k_pool.dtype)
    block_m, block_n, num_warps = extend_block_sizes(head_dim, k_pool.dtype, compute)
    block_d = max(16, triton.next_power_of_2(head_dim))
    qk_scale, cap, has_softcap = score_args(head_dim, scale, softcap)
    window, has_window = window_arg(window)
    sinks, has_sinks = sinks_arg(sinks, num_heads, q_starts)
    grid = (num_rows, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k_pool, v_pool, k_scale, v_scale, out, req_to_token, req_rows, prefix_lens, extend_lens, q_starts, sinks,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        *scale_strides,
        out.stride(0), out.stride(1),
        req_to_token.stride(0),
        qk_scale, cap, window,
        HEAD_DIM=head_dim, GROUP=num_heads // num_kv,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(compute), UPCAST=compute != k_pool.dtype, HAS_SCALES=has_scales,
        HAS_WINDOW=has_window, SOFTCAP=has_softcap, HAS_SINKS=has_sinks,
        num_warps=num_warps, num_stages=2,
    )
    return out
