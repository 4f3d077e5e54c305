"""Weight-only int4 matrix multiplication in Triton (GPUs): ``y = x @ W.T (+ b)``, W in Q4_1 groups.

W ``[N, K]`` is stored as GGUF's Q4_1 values (``w = code * scale + minimum``, codes 0..15, one fp16
scale and minimum per 32 consecutive inputs of a row) in a layout for this kernel: ``halves``
uint8 ``[N, K/2]`` whose byte ``j`` holds input ``j`` in its low nibble and input ``j + K/2`` in its
high one, beside ``scale`` and ``minimum`` fp16 ``[N, K/32]``. A step over ``BLOCK_K`` bytes of
each row reads two contiguous ``BLOCK_K``-wide slices of ``x`` (one per nibble), so no nibble
has to be interleaved back into place. The codes are dequantized in registers (fp32, then ``x``'s
dtype) and multiplied with two dots into an fp32 accumulator. A decode step reads about 0.63
bytes per weight (a quarter of bf16's two) and is bound by reading them.

AWQ and GPTQ checkpoints store int4 codes with a zero point instead of a minimum
(``w = (code - zero) * scale``, one fp16 scale and a 4-bit zero per ``group`` of 32, 64 or 128
inputs of a row): ``int4_zp_linear`` runs them through the same kernel, in the same ``halves``
layout, with ``zero`` uint8 ``[N, K/group]`` (0..15) in place of the minimum.

Grid: one program per ``[BLOCK_M, BLOCK_N]`` output tile, looping over the bytes of the rows.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GROUP = 32  # inputs per scale and minimum
ZP_GROUPS = (32, 64, 128)  # inputs per scale and zero point that int4_zp_linear takes


@triton.jit
def _int4_linear_kernel(
    x_ptr, w_ptr, scale_ptr, min_ptr, bias_ptr, y_ptr,
    M, N, HALF, stride_xm, stride_wn, stride_sn, stride_ym,
    HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, ZERO_POINT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HALF, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)  # byte j: inputs j (low nibble) and j + HALF (high nibble)
        w_mask = (rk[:, None] < HALF) & mask_n[None, :]
        packed = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=w_mask, other=0)  # [BLOCK_K, BLOCK_N]
        g_lo = rk // GROUP
        g_hi = (rk + HALF) // GROUP
        s_lo = tl.load(scale_ptr + rn[None, :] * stride_sn + g_lo[:, None], mask=w_mask, other=0.0).to(tl.float32)
        m_lo = tl.load(min_ptr + rn[None, :] * stride_sn + g_lo[:, None], mask=w_mask, other=0).to(tl.float32)
        s_hi = tl.load(scale_ptr + rn[None, :] * stride_sn + g_hi[:, None], mask=w_mask, other=0.0).to(tl.float32)
        m_hi = tl.load(min_ptr + rn[None, :] * stride_sn + g_hi[:, None], mask=w_mask, other=0).to(tl.float32)
        x_mask = mask_m[:, None] & (rk[None, :] < HALF)
        x_lo = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=x_mask, other=0.0)
        x_hi = tl.load(x_ptr + rm[:, None] * stride_xm + (rk + HALF)[None, :], mask=x_mask, other=0.0)
        if ZERO_POINT:  # min_ptr holds the zero points: w = (code - zero) * scale
            w_lo = ((packed & 0xF).to(tl.float32) - m_lo) * s_lo
            w_hi = ((packed >> 4).to(tl.float32) - m_hi) * s_hi
        else:  # Q4_1: w = code * scale + minimum
            w_lo = (packed & 0xF).to(tl.float32) * s_lo + m_lo
            w_hi = (packed >> 4).to(tl.float32) * s_hi + m_hi
        acc += tl.dot(x_lo, w_lo.to(x_lo.dtype))
        acc += tl.dot(x_hi, w_hi.to(x_hi.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def pack_halves(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[N, K/G, G]`` or ``[N, K]`` (0..15) as this kernel's ``[N, K/2]`` bytes: input j low, j + K/2 high."""
    n = codes.shape[0]
    flat = codes.reshape(n, -1)
    half = flat.shape[1] // 2
    return (flat[:, :half] | (flat[:, half:] << 4)).contiguous()


def int4_linear(x: torch.Tensor, halves: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (fp32, bf16 or fp16) times the Q4_1 weight ``halves`` ``[N, K/2]`` (see
    ``pack_halves``) with ``scale`` and ``minimum`` ``[N, K/32]``, plus ``bias`` ``[N]``; returns
    ``[M, N]`` in ``x``'s dtype."""
    if x.dim() != 2 or halves.dim() != 2 or x.shape[1] != 2 * halves.shape[1] or x.shape[1] % GROUP:
        raise ValueError(f"x must be [M, K] with K a multiple of {GROUP} and halves [N, K/2], got {tuple(x.shape)} and {tuple(halves.shape)}")
    n, k = halves.shape[0], x.shape[1]
    if halves.dtype != torch.uint8 or scale.shape != (n, k // GROUP) or minimum.shape != scale.shape:
        raise ValueError(f"halves must be uint8 [N, K/2] with scale and minimum [N, K/{GROUP}] = {[n, k // GROUP]}")
    return _launch(x, halves, scale, minimum, bias, GROUP, zero_point=False)


def int4_zp_linear(x: torch.Tensor, halves: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (fp32, bf16 or fp16) times the AWQ/GPTQ int4 weight ``halves`` ``[N, K/2]``
    (``pack_halves``' layout) with ``w = (code - zero) * scale`` per ``group`` (32, 64 or 128)
    inputs, ``scale`` fp16 and ``zero`` uint8 (0..15) ``[N, K/group]``, plus ``bias`` ``[N]``;
    returns ``[M, N]`` in ``x``'s dtype."""
    if group not in ZP_GROUPS:
        raise ValueError(f"group must be one of {ZP_GROUPS}, got {group}")
    if x.dim() != 2 or halves.dim() != 2 or x.shape[1] != 2 * halves.shape[1] or x.shape[1] % group:
        raise ValueError(f"x must be [M, K] with K a multiple of {group} and halves [N, K/2], got {tuple(x.shape)} and {tuple(halves.shape)}")
    n, k = halves.shape[0], x.shape[1]
    if halves.dtype != torch.uint8 or scale.shape != (n, k // group) or zero.shape != scale.shape or zero.dtype != torch.uint8:
        raise ValueError(f"halves must be uint8 [N, K/2] with scale and uint8 zero [N, K/{group}] = {[n, k // group]}")
    return _launch(x, halves, scale, zero, bias, group, zero_point=True)


def _launch(x: torch.Tensor, halves: torch.Tensor, scale: torch.Tensor, second: torch.Tensor, bias: torch.Tensor | None, group: int, zero_point: bool) -> torch.Tensor:
    """Run the kernel; ``second`` is the minimum (Q4_1) or the zero point."""
    x, halves, scale, second = x.contiguous(), halves.contiguous(), scale.contiguous(), second.contiguous()
    m, n, k = x.shape[0], halves.shape[0], x.shape[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16  # the smallest tensor-core dot; decode rows are few and masked
    block_n, block_k = (32, 16) if INTERPRET else (64, 64)
    launch = {}
    if zero_point and not INTERPRET:  # tuned on an H200 at [4096, 4096], group 128, 1 and 32 rows: 3.5x faster than (64, 64)
        block_n, block_k = 16, 128
        launch = {"num_warps": 4, "num_stages": 3}
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_linear_kernel[grid](
        x, halves, scale, second, bias if bias is not None else scale, y,
        m, n, k // 2, x.stride(0), halves.stride(0), scale.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, GROUP=group, ZERO_POINT=zero_point, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **launch,
    )  # fmt: skip
    return y
