"""Weight-only int8 matrix multiplication in Triton (GPUs): ``y = (x @ W_q.T) * scale (+ b)``.

``W_q`` is int8 ``[N, K]`` with one scale per output row, the layout of
``radixlm.runtime.layers.quantized_linear.Int8Linear``. The weights are read as stored (half the bytes of
bf16, a quarter of fp32), converted to ``x``'s dtype in registers block by block, multiplied with
a dot into an fp32 accumulator, and scaled once per output at the end (the row's scale is
constant along K). A decode step is bound by reading the weights, so this is where the bytes pay.

Grid: one program per ``[BLOCK_M, BLOCK_N]`` output tile, looping over K in ``BLOCK_K`` steps.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _int8_linear_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0)
        acc += tl.dot(x, w.to(x.dtype))  # [BLOCK_K, BLOCK_N]: W's block read transposed
    scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    acc = acc * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (fp32, bf16 or fp16) times int8 ``qweight`` ``[N, K]`` scaled by ``scales``
    ``[N]`` per output, plus ``bias`` ``[N]``; returns ``[M, N]`` in ``x``'s dtype."""
    if x.dim() != 2 or qweight.dim() != 2 or x.shape[1] != qweight.shape[1]:
        raise ValueError(f"x must be [M, K] and qweight [N, K] with the same K, got {tuple(x.shape)} and {tuple(qweight.shape)}")
    if qweight.dtype != torch.int8 or scales.numel() != qweight.shape[0]:
        raise ValueError("qweight must be int8 [N, K] with one scale per row")
    x, qweight = x.contiguous(), qweight.contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16  # the smallest tensor-core dot; decode rows are few and masked
    block_n, block_k = (32, 32) if INTERPRET else (64, 128)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_linear_kernel[grid](
        x, qweight, scales, bias if bias is not None else scales, y,
        m, n, k, x.stride(0), qweight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return y
