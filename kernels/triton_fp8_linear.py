"""FP8 (e4m3) weight-only matrix multiplication in Triton (GPUs): ``y = x @ (W * scale).T (+ b)``.

W ``[N, K]`` is the raw bits (uint8) of ``float8_e4m3fn`` values, as FP8 checkpoints store them,
with fp32 scales of one of three shapes: one for the tensor, one per output row ``[N]``, or one
per ``[bn, bk]`` block ``[ceil(N/bn), ceil(K/bk)]`` (DeepSeek's and Qwen's ``weight_scale_inv``).

No fp8 hardware is needed (the kernel runs on any GPU and in Triton's interpreter): a byte's 7
low bits shifted left by 7, with its sign moved to bit 15, are the fp16 bits of the e4m3 value
times 2^-8. The exponent fields line up (e4m3's bias 7 is fp16's 15 less 8), and e4m3's
subnormals land on fp16 subnormals, so the decode is exact; the 2^8 is folded into the scale.
Those values are exact in bf16 and fp16 too, so the dot multiplies the stored weights unrounded
in ``x``'s dtype, and the scale is applied to the fp32 partial sums: per output at the end, or,
for block scales, per step of ``BLOCK_K`` (a divisor of ``bk``) inside one block. Where ``bk``
has no such divisor, each weight is scaled before the dot instead. A decode step reads one byte
per weight (half of bf16).

Grid: one program per ``[BLOCK_M, BLOCK_N]`` output tile, looping over K in ``BLOCK_K`` steps.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from radixlm.kernels.fp8_scales import check_scale

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
PER_TENSOR, PER_CHANNEL, PER_STEP, PER_WEIGHT = 0, 1, 2, 3  # how the scales are applied


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr,
    M, N, K, BN, BK, stride_xm, stride_wn, stride_sn, stride_ym,
    SCALES: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask_m[:, None] & (rk[None, :] < K), other=0.0)
        w_mask = (rk[:, None] < K) & mask_n[None, :]
        bits = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=w_mask, other=0).to(tl.uint16)  # [BLOCK_K, BLOCK_N]
        half = (((bits & 0x7F) << 7) | ((bits & 0x80) << 8)).to(tl.float16, bitcast=True)  # e4m3 * 2^-8, exact
        if SCALES == 3:  # PER_WEIGHT: each weight's block scale before the dot
            s = tl.load(scale_ptr + (rn // BN)[None, :] * stride_sn + (rk // BK)[:, None], mask=w_mask, other=0.0).to(tl.float32)
            acc += tl.dot(x, (half.to(tl.float32) * s).to(x.dtype))
        elif SCALES == 2:  # PER_STEP: the step lies in one block column; one scale per output row
            s = tl.load(scale_ptr + (rn // BN) * stride_sn + k0 // BK, mask=mask_n, other=0.0).to(tl.float32)
            acc += tl.dot(x, half.to(x.dtype)) * s[None, :]
        else:
            acc += tl.dot(x, half.to(x.dtype))
    if SCALES == 1:
        acc = acc * tl.load(scale_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    elif SCALES == 0:
        acc = acc * tl.load(scale_ptr).to(tl.float32)
    acc = acc * 256.0  # the decode's 2^-8
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def scale_mode(scale: torch.Tensor, n: int, k: int, block: tuple[int, int] | None) -> int:
    """``PER_TENSOR``, ``PER_CHANNEL`` or ``PER_STEP`` / ``PER_WEIGHT`` (block scales) for ``scale``
    of a ``[n, k]`` weight; raises ValueError when its shape fits none."""
    check_scale(scale, n, k, block)
    if block is not None:
        return PER_STEP if _step(block[1]) else PER_WEIGHT
    return PER_TENSOR if scale.numel() == 1 else PER_CHANNEL


def _step(bk: int) -> int:
    """The largest ``BLOCK_K`` this device's kernel steps by that divides ``bk`` (0 when none does)."""
    for size in (32, 16) if INTERPRET else (128, 64, 32, 16):
        if bk % size == 0:
            return size
    return 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (fp32, bf16 or fp16) times the e4m3 ``weight`` bits (uint8 ``[N, K]``) scaled
    by ``scale`` (one, ``[N]``, or ``[ceil(N/bn), ceil(K/bk)]`` for ``block = (bn, bk)``), plus
    ``bias`` ``[N]``; returns ``[M, N]`` in ``x``'s dtype."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K] with the same K, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype != torch.uint8:
        raise ValueError(f"weight must be the uint8 bits of float8_e4m3fn, got {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    mode = scale_mode(scale, n, k, block)
    x, weight = x.contiguous(), weight.contiguous()
    scale = scale.reshape(scale.shape[0], -1).contiguous() if mode >= PER_STEP else scale.reshape(-1).contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16  # the smallest tensor-core dot; decode rows are few and masked
    block_n, block_k = (32, 32) if INTERPRET else (32, 128)  # tuned on an H200 at [4096, 4096], 1 and 32 rows
    if mode == PER_STEP:
        block_k = min(block_k, _step(block[1]))
    bn, bk = block if block is not None else (1, 1)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_linear_kernel[grid](
        x, weight, scale, bias if bias is not None else scale, y,
        m, n, k, bn, bk, x.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        SCALES=mode, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        **({} if INTERPRET else {"num_warps": 4, "num_stages": 4}),
    )  # fmt: skip
    return y
