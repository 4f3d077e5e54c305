"""A mixture-of-experts feed-forward block: a router, routed experts run grouped, shared experts.

Each token's hidden state goes to the k experts its router picks (``moe_router``); the block's
output is the routing-weighted sum of those experts' gated MLPs, plus the shared experts' MLP
where the family has them (DeepSeek). The routed experts run **grouped**: the (token, expert)
pairs are sorted by expert, and each expert that received tokens multiplies all of its rows in
one call of its own layers; an expert no token chose is not touched, so a decode step reads only
the chosen experts' weights (the reason an MoE decodes faster than a dense model of its size).
A single token (a batch-1 decode step) skips the grouping and runs its k experts one after
another, added in the same order; where they are all GGUF blocks, in one C++ call
(``gguf_experts_token``) that computes the same sum to the bit.

Every expert is a ``nn.Linear`` pair (fused gate/up, then down), so weight quantization
(``--quantization``), stored checkpoint formats and the CPU kernels apply to experts as to any
linear layer; the router's weight is a plain parameter and stays unquantized. Under tensor
parallelism each rank holds a slice of every expert's intermediate size (and of the shared
experts'), and the block's partial output is all-reduced once.

The sum over experts runs in ascending expert order, each expert's contribution added with one
``index_add_``: the order transformers adds them in, so outputs agree to the bit on fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixlm.kernels.cpu_ext import cpu_kernels
from radixlm.runtime.layers.activation import gelu_tanh_and_mul, silu_and_mul
from radixlm.runtime.layers.gguf_linear import GGUFLinear
from radixlm.runtime.layers.moe_router import Router, RouterSpec

if TYPE_CHECKING:
    from radixlm.runtime.distributed.group import TPGroup

Activation = Callable[[torch.Tensor], torch.Tensor]  # fused [.., 2 * inter] gate/up -> [.., inter]


class ExpertMLP(nn.Module):
    """One expert: a gated MLP with a fused gate/up projection (gate rows first)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act_fn: Activation, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, projected back to the hidden size."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def gguf_blocks(self) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor], list[int], bool] | None:
        """Gate/up and down as GGUF row parts and types, and whether the activation is GELU-tanh (else
        SiLU), where both are GGUF blocks without a bias and the activation is one the C++ kernels
        have; else None."""
        up, down = self.gate_up_proj, self.down_proj
        if not (isinstance(up, GGUFLinear) and isinstance(down, GGUFLinear) and up.bias is None and down.bias is None):
            return None
        if self.act_fn is not silu_and_mul and self.act_fn is not gelu_tanh_and_mul:
            return None
        return up.parts, up.types, down.parts, down.types, self.act_fn is gelu_tanh_and_mul


def run_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """``sum_j weights[t, j] * experts[ids[t, j]](x[t])`` for every token ``t``, each expert's tokens in one call."""
    tokens, k = ids.shape
    if tokens == 1:  # a batch-1 decode step: the token's experts one after another, nothing to group
        return _one_token(x, weights[0], ids[0], experts)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens ascending
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    rows_of = order // k
    scale = weights.reshape(-1)[order].to(x.dtype).unsqueeze(-1)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in zip(experts, counts):
        if count == 0:
            continue
        rows = rows_of[start : start + count]
        out.index_add_(0, rows, expert(x.index_select(0, rows)) * scale[start : start + count])
        start += count
    return out


def _one_token(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """``run_experts`` for one token ``x`` ``[1, hidden]``: the same products added in the same order (ascending expert id)."""
    chosen = ids.tolist()
    order = sorted(range(len(chosen)), key=chosen.__getitem__)
    chosen = [chosen[j] for j in order]
    scale = weights.to(x.dtype)[order]
    fused = _gguf_token(x, chosen, scale, experts)
    if fused is not None:
        return fused
    out = torch.zeros_like(x)
    for j, expert in enumerate(chosen):
        out += experts[expert](x) * scale[j]
    return out


def _gguf_token(x: torch.Tensor, chosen: list[int], scale: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor | None:
    """``_one_token``'s sum in one C++ call where every chosen expert is GGUF blocks (float32 on CPU); else None."""
    ext = cpu_kernels() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if ext is None or not hasattr(ext, "gguf_experts_token"):
        return None
    blocks = [experts[e].gguf_blocks() for e in chosen]
    if any(b is None for b in blocks):
        return None
    up, up_types, down, down_types, gelu = zip(*blocks)
    return ext.gguf_experts_token(x, list(up), list(up_types), list(down), list(down_types), scale, gelu[0])


class MoEBlock(nn.Module):
    """Routed experts (and shared experts, where the family has them) in place of a dense MLP."""

    def __init__(
        self,
        hidden_size: int,
        router: RouterSpec,
        intermediate_size: int,
        act_fn: Activation,
        shared_intermediate_size: int = 0,
        group: TPGroup | None = None,
        bias: bool = False,
        shared_gate: bool = False,
    ) -> None:
        super().__init__()
        self.router = Router(hidden_size, router)
        self.experts = nn.ModuleList(ExpertMLP(hidden_size, intermediate_size, act_fn, bias) for _ in range(router.num_experts))
        self.shared_experts = ExpertMLP(hidden_size, shared_intermediate_size, act_fn) if shared_intermediate_size else None
        # Qwen3-Next: the shared expert's output is scaled per token by sigmoid(x . w)
        self.shared_gate = nn.Linear(hidden_size, 1, bias=False) if shared_gate and shared_intermediate_size else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for each token of ``x`` ``[T, hidden]`` (plus the shared experts')."""
        weights, ids = self.router(x)
        out = run_experts(x, weights, ids, self.experts)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out if self.group is None else self.group.all_reduce(out)
