"""Batched multi-LoRA in Triton (GPUs): Punica/S-LoRA's segmented gather matmuls ("SGMV").

A batch's tokens are grouped into ``K`` disjoint segments of consecutive rows, ``[seg_start[k],
seg_end[k])``, each using its own adapter; a LoRA delta ``x @ A_k.T @ B_k.T * scaling`` is two
kernels:

- shrink: ``h[t] = x[t] @ a[k]`` for each token ``t`` of segment ``k``, ``a`` ``[K, in, R]`` the
  segments' ``A`` transposed and stacked, ranks zero-padded to ``R``; rows in no segment get zeros.
- expand: ``out[t, lo:lo+N] += h[t, col:col+r] @ b[k]``, in place, ``b`` ``[K, r, N]`` the
  segments' ``B`` transposed (scaling folded in by the caller). ``col`` and ``lo`` pick a slice of
  ``h`` and of ``out``, so a fused projection (q, k and v in one ``out``) takes one call per slice.

Grid: one program per (segment, ``BLOCK_N`` output columns, token block). A segment holds one
token (decode) or hundreds (prefill), and its bounds are loaded in the kernel, never read on the
host, so the token-block axis is sized from what the host knows: ``K`` non-empty disjoint
segments of ``n`` rows hold at most ``n - K + 1`` tokens each (one block for a decode batch),
capped at ``MAX_M_BLOCKS``; each program steps over its segment's ``BLOCK_M``-token blocks by
the grid's stride, and programs past the segment's end do nothing. Both kernels multiply with
``tl.dot`` into fp32 accumulators (fp32 operands use TF32 on GPUs, Triton's default), masking
tails of tokens, ranks (any rank, not only powers of two) and columns.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 16  # tokens per program step: the smallest tensor-core dot; decode rows are masked
MAX_M_BLOCKS = 64  # token blocks of one segment run in parallel; longer segments loop
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, seg_start_ptr, seg_end_ptr,
    IN, R, M_STRIDE,
    stride_xm, stride_xi, stride_ak, stride_ai, stride_ar, stride_hm, stride_hr,
    DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_k = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < R
    start = tl.load(seg_start_ptr + pid_k)
    end = tl.load(seg_end_ptr + pid_k)
    a_seg = a_ptr + pid_k * stride_ak
    for m0 in range(start + tl.program_id(2) * BLOCK_M, end, M_STRIDE):
        rm = m0 + tl.arange(0, BLOCK_M)
        mask_m = rm < end
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, IN, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            mask_k = rk < IN
            xt = tl.load(
                x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xi,
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )
            wt = tl.load(
                a_seg + rk[:, None] * stride_ai + rn[None, :] * stride_ar,
                mask=mask_k[:, None] & mask_n[None, :],
                other=0.0,
            )
            # the interpreter multiplies bf16 operands as raw bits: widen them (exactly) there
            if DOT_F32:
                acc += tl.dot(xt.to(tl.float32), wt.to(tl.float32))
            else:
                acc += tl.dot(xt, wt.to(xt.dtype))
        h_ptrs = h_ptr + rm[:, None] * stride_hm + rn[None, :] * stride_hr
        tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _expand_kernel(
    out_ptr, h_ptr, b_ptr, seg_start_ptr, seg_end_ptr,
    RANK, N, COL, LO, M_STRIDE,
    stride_om, stride_on, stride_hm, stride_hr, stride_bk, stride_br, stride_bn,
    DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_k = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    start = tl.load(seg_start_ptr + pid_k)
    end = tl.load(seg_end_ptr + pid_k)
    b_seg = b_ptr + pid_k * stride_bk
    for m0 in range(start + tl.program_id(2) * BLOCK_M, end, M_STRIDE):
        rm = m0 + tl.arange(0, BLOCK_M)
        mask_m = rm < end
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, RANK, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            mask_k = rk < RANK
            ht = tl.load(
                h_ptr + rm[:, None] * stride_hm + (COL + rk)[None, :] * stride_hr,
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )
            wt = tl.load(
                b_seg + rk[:, None] * stride_br + rn[None, :] * stride_bn,
                mask=mask_k[:, None] & mask_n[None, :],
                other=0.0,
            )
            # the interpreter multiplies bf16 operands as raw bits: widen them (exactly) there
            if DOT_F32:
                acc += tl.dot(ht.to(tl.float32), wt.to(tl.float32))
            else:
                acc += tl.dot(ht, wt.to(ht.dtype))
        o_ptrs = out_ptr + rm[:, None] * stride_om + (LO + rn)[None, :] * stride_on
        o_mask = mask_m[:, None] & mask_n[None, :]
        prev = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
        tl.store(o_ptrs, (prev + acc).to(out_ptr.dtype.element_ty), mask=o_mask)


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, seg_start: torch.Tensor, seg_end: torch.Tensor
) -> torch.Tensor:
    """``h[t, :] = x[t] @ a[k]`` for every token ``t`` in segment ``k`` (rows in no segment: zeros)."""
    if x.dim() != 2 or a.dim() != 3 or a.shape[1] != x.shape[1]:
        raise ValueError(
            f"x must be [n, in] and a [K, in, R] with the same in, got {tuple(x.shape)} and {tuple(a.shape)}"
        )
    if x.dtype not in FLOATS or a.dtype not in FLOATS:
        raise ValueError(f"x and a must be fp32, bf16 or fp16, got {x.dtype} and {a.dtype}")
    _check_segments(seg_start, seg_end, a.shape[0], x)
    n, in_features = x.shape
    k, rank = a.shape[0], a.shape[2]
    h = torch.zeros(n, rank, dtype=x.dtype, device=x.device)
    if n == 0 or k == 0 or rank == 0:
        return h
    block_n = min(_pow2(rank), 32 if INTERPRET else 64)
    block_k = 32 if INTERPRET else 128
    grid_m = _token_blocks(n, k)
    grid = (k, triton.cdiv(rank, block_n), grid_m)
    _shrink_kernel[grid](
        x, a, h, seg_start, seg_end,
        in_features, rank, grid_m * BLOCK_M,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), h.stride(0), h.stride(1),
        DOT_F32=_dot_f32(x, a), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return h


def lora_expand_(
    out: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    seg_start: torch.Tensor,
    seg_end: torch.Tensor,
    col: int,
    lo: int,
) -> torch.Tensor:
    """``out[t, lo:lo+N] += h[t, col:col+r] @ b[k]`` for every token ``t`` in segment ``k``, in place; returns ``out``."""
    if out.dim() != 2 or h.dim() != 2 or b.dim() != 3 or out.shape[0] != h.shape[0]:
        raise ValueError(
            f"out must be [n, out_total], h [n, R_total] and b [K, r, N], got {tuple(out.shape)}, {tuple(h.shape)} and {tuple(b.shape)}"
        )
    k, rank, n_cols = b.shape
    if col < 0 or col + rank > h.shape[1] or lo < 0 or lo + n_cols > out.shape[1]:
        raise ValueError(
            f"h[:, {col}:{col + rank}] and out[:, {lo}:{lo + n_cols}] must lie within h {tuple(h.shape)} and out {tuple(out.shape)}"
        )
    if out.dtype not in FLOATS or h.dtype not in FLOATS or b.dtype not in FLOATS:
        raise ValueError(
            f"out, h and b must be fp32, bf16 or fp16, got {out.dtype}, {h.dtype} and {b.dtype}"
        )
    _check_segments(seg_start, seg_end, k, out)
    n = out.shape[0]
    if n == 0 or k == 0 or rank == 0 or n_cols == 0:
        return out
    block_n = 32 if INTERPRET else 128
    block_k = min(_pow2(rank), 32 if INTERPRET else 64)
    grid_m = _token_blocks(n, k)
    grid = (k, triton.cdiv(n_cols, block_n), grid_m)
    _expand_kernel[grid](
        out, h, b, seg_start, seg_end,
        rank, n_cols, col, lo, grid_m * BLOCK_M,
        out.stride(0), out.stride(1), h.stride(0), h.stride(1), b.stride(0), b.stride(1), b.stride(2),
        DOT_F32=_dot_f32(h, b), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out


def _check_segments(
    seg_start: torch.Tensor, seg_end: torch.Tensor, k: int, like: torch.Tensor
) -> None:
    """Raise ValueError unless both bounds are int64 ``[K]`` on ``like``'s device (their values are the caller's to keep disjoint)."""
    for name, t in (("seg_start", seg_start), ("seg_end", seg_end)):
        if t.shape != (k,) or t.dtype != torch.int64 or t.device != like.device:
            raise ValueError(
                f"{name} must be int64 [{k}] on {like.device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
            )


def _token_blocks(n: int, k: int) -> int:
    """Token blocks per segment in the grid: ``k`` disjoint non-empty segments of ``n`` rows hold at most ``n - k + 1`` tokens each."""
    return max(1, min(triton.cdiv(n - k + 1, BLOCK_M), MAX_M_BLOCKS))


def _pow2(size: int) -> int:
    """The power of two at or above ``size``, at least 16 (``tl.dot``'s smallest side)."""
    return max(16, triton.next_power_of_2(size))


def _dot_f32(act: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the dot must widen its operands to fp32: bf16 under Triton's interpreter."""
    return INTERPRET and torch.bfloat16 in (act.dtype, weight.dtype)
