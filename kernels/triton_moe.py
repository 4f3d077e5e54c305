"""Fused mixture-of-experts in Triton (GPUs): every routed expert's gated MLP in two grouped GEMMs.

A batch of ``T`` tokens, each routed to ``k`` experts, makes ``T * k`` (token, slot) *pairs*; pair
``p = t * k + j`` is token ``t``'s ``j``-th choice, expert ``topk_ids[t, j]`` with routing weight
``topk_weights[t, j]``. The experts' weights are stacked: ``w[e]`` ``[N, K]`` is expert ``e``'s
``nn.Linear`` weight (``w_gate_up`` ``[E, 2I, H]`` with the gate rows first, ``w_down`` ``[E, H, I]``),
with optional biases ``[E, N]``.

Alignment (``align_blocks``, PyTorch ops on the device, no host sync): the pairs sorted by expert
(stable, so tokens ascending within an expert), each expert's run padded to a multiple of
``BLOCK_M`` with the sentinel ``T * k`` (masked rows), and the expert of each ``BLOCK_M`` block.
An expert no pair chose gets no block, so its weights are never read. The host sizes the grid
from what it knows: ``T * k`` pairs over at most ``min(E, T * k)`` experts fill at most
``(T * k + min(E, T * k) * (BLOCK_M - 1)) // BLOCK_M`` blocks; blocks past the last expert's are
marked ``-1`` and their programs return at once (a decode step of ``k`` distinct experts has
exactly ``k`` blocks).

The grouped GEMM (``_grouped_gemm_kernel``): one program per (``BLOCK_M`` block of sorted pairs,
``BLOCK_N`` output columns). It gathers its pairs' input rows (token ``p // k`` of ``x`` for the
gate/up product, row ``p`` of the activated intermediate for the down one), steps over ``K`` by
``BLOCK_K`` multiplying with its block's expert ``w[e]`` into an fp32 accumulator (``tl.dot``;
fp32 operands exact, not TF32), adds the expert's bias, optionally scales each row by its pair's
routing weight, and writes row ``p`` of a ``[T * k, N]`` output in the input's dtype.

``fused_experts``: the gate/up GEMM for every pair, the activation in PyTorch on the
``[T * k, 2I]`` intermediate (any ``act_fn``: SiLU, GELU-tanh, GPT-OSS's clamped SwiGLU), the down
GEMM scaled by the routing weights, then each token's ``k`` rows summed in ascending expert order.
Tile sizes are untuned (not yet timed on a GPU: ``benchmarks/gpu_check.py`` has the section).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, sorted_ptr, block_expert_ptr,
    N, K, PAIRS, ROWS_PER_A,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_be, stride_om,
    HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:  # past the last expert's blocks
        return
    pair = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = pair < PAIRS  # padding rows hold the sentinel PAIRS
    a_row = pair // ROWS_PER_A  # the token (gate/up: k pairs per row of x) or the pair itself (down)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    w_expert = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask_k = rk < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + rk[None, :] * stride_ak, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_expert + rn[None, :] * stride_wn + rk[:, None] * stride_wk, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if DOT_F32:  # the interpreter multiplies bf16 operands as raw bits: widen them (exactly) there
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
        else:
            acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if SCALE:
        acc *= tl.load(scale_ptr + pair, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pair[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def align_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of ``topk_ids`` ``[T, k]`` sorted by expert, each expert's run padded to a multiple
    of ``block_m`` with the sentinel ``T * k``: int32 ``[blocks * block_m]``; and each block's expert,
    int32 ``[blocks]``, ``-1`` for the blocks past the last expert's. ``blocks`` is a bound the host
    knows without reading the ids (see the module docstring)."""
    pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1).long()
    blocks = (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, ascending within each
    counts = torch.bincount(flat, minlength=num_experts)
    expert_blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(expert_blocks, 0)
    run_start = (block_end - expert_blocks) * block_m  # each expert's first padded row
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in ``order``
    experts = flat[order]
    dest = run_start[experts] + torch.arange(pairs, device=flat.device) - first[experts]
    sorted_pairs = torch.full((blocks * block_m,), pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[dest] = order.to(torch.int32)
    owner = torch.searchsorted(block_end, torch.arange(blocks, device=flat.device), right=True)  # empty experts own none
    block_expert = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return sorted_pairs, block_expert


def _grouped_gemm(
    a: torch.Tensor, rows_per_a: int, w: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None,
    sorted_pairs: torch.Tensor, block_expert: torch.Tensor, pairs: int, block_m: int,
) -> torch.Tensor:  # fmt: skip
    """``out[p] = (a[p // rows_per_a] @ w[e].T + bias[e]) * scale[p]`` for every pair ``p`` of expert ``e``: ``[pairs, N]``."""
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(pairs, n, dtype=a.dtype, device=a.device)
    block_n, block_k = (32, 16) if INTERPRET else (64, 64)
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, bias if bias is not None else w, scale if scale is not None else w, out, sorted_pairs, block_expert,
        n, k, pairs, rows_per_a,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), bias.stride(0) if bias is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, SCALE=scale is not None, DOT_F32=INTERPRET and a.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out


def fused_experts(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor], b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
    block_m: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """``sum_j topk_weights[t, j] * down_e(act_fn(gate_up_e(x[t])))`` with ``e = topk_ids[t, j]``, for
    every token of ``x`` ``[T, H]`` (fp32, bf16 or fp16); the stacked weights ``w_gate_up`` ``[E, 2I, H]``
    (gate rows first) and ``w_down`` ``[E, H, I]`` and the biases ``[E, 2I]``, ``[E, H]`` in ``x``'s
    dtype; ``act_fn`` maps ``[.., 2I]`` to ``[.., I]``. Returns ``[T, H]`` in ``x``'s dtype.
    ``block_m``: pairs per block (default 16, 64 where the average expert gets 64 pairs or more)."""
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3 or topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"x must be [T, H], the weights [E, N, K] and topk_weights/ids [T, k], got {tuple(x.shape)}, {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}, {tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}")
    tokens, hidden = x.shape
    experts, inter2 = w_gate_up.shape[0], w_gate_up.shape[1]
    if w_gate_up.shape[2] != hidden or w_down.shape[0] != experts or w_down.shape[1] != hidden or topk_ids.shape[0] != tokens:
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)}, topk_ids {tuple(topk_ids.shape)}")
    if x.dtype not in FLOATS or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"x and the weights must share one of fp32, bf16, fp16, got {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}")
    for name, b, n in (("b_gate_up", b_gate_up, inter2), ("b_down", b_down, hidden)):
        if b is not None and (b.shape != (experts, n) or b.dtype != x.dtype):
            raise ValueError(f"{name} must be [{experts}, {n}] in {x.dtype}, got {b.dtype} {tuple(b.shape)}")
    pairs = topk_ids.numel()
    if pairs == 0:
        return torch.zeros_like(x)
    if block_m is None:
        block_m = 64 if pairs >= 64 * min(experts, pairs) and not INTERPRET else 16
    sorted_pairs, block_expert = align_blocks(topk_ids, experts, block_m)
    gate_up = _grouped_gemm(x, topk_ids.shape[1], w_gate_up, b_gate_up, None, sorted_pairs, block_expert, pairs, block_m)
    hidden_act = act_fn(gate_up)
    if hidden_act.shape != (pairs, w_down.shape[2]):
        raise ValueError(f"act_fn mapped [{pairs}, {inter2}] to {tuple(hidden_act.shape)}, not [{pairs}, {w_down.shape[2]}]")
    scale = topk_weights.reshape(-1).float().contiguous()
    down = _grouped_gemm(hidden_act.to(x.dtype), 1, w_down, b_down, scale, sorted_pairs, block_expert, pairs, block_m)
    ascending = torch.argsort(topk_ids, dim=1, stable=True)  # each token's rows in ascending expert order
    rows = down.view(tokens, -1, hidden).gather(1, ascending.unsqueeze(-1).expand(-1, -1, hidden))
    return rows.sum(dim=1, dtype=torch.float32).to(x.dtype)
