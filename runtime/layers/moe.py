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

On a GPU the PyTorch grouping launches two matmuls per expert that received tokens; there the
block runs its routed experts **fused** instead (``radixlm.kernels.triton_moe.fused_experts``:
two grouped Triton GEMMs over all pairs, the activation between them in PyTorch), where every
expert's two layers are plain ``nn.Linear`` of one dtype. The kernel reads the experts' weights
stacked (``[E, 2I, H]`` and ``[E, H, I]``): on the first forward that takes the fused path the
block stacks them once and makes each expert's ``weight`` (and ``bias``) a view into the stacked
tensors, so memory is not doubled and the modules (state dicts, tensor-parallel slices, in-place
``copy_``) stay as they were. Stacking after construction lets loading, sharding and quantization
finish first: the model runner stacks every block then (``stack_experts``, before it sizes the KV
pool from the free memory, since stacking briefly holds a layer's experts twice), and a block
used on its own stacks on its first fused forward. Each fused forward checks that the first and
the last expert's layers still lie in the stacks (quantizing replaces every expert's layers), and
moving the block (``.to``) drops them; either way the next forward stacks again. New weights for
a stacked expert go in place (``weight.copy_``); a new ``Parameter`` of a middle expert is not seen.
Quantized experts (int8, int4, GGUF, FP8) keep the grouped PyTorch path on every device (their
own layers run their own kernels). ``kernel``: ``auto`` (fused on CUDA where Triton is installed,
else the grouped path), ``torch`` (always the grouped path) or ``triton`` (always fused, also on
CPU tensors under Triton's interpreter; an error where the experts cannot be stacked). Under
tensor parallelism each rank stacks its own slices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from radixlm.kernels import triton_available
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
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.kernel = kernel
        self.router = Router(hidden_size, router)
        self.experts = nn.ModuleList(ExpertMLP(hidden_size, intermediate_size, act_fn, bias) for _ in range(router.num_experts))
        self.shared_experts = ExpertMLP(hidden_size, shared_intermediate_size, act_fn) if shared_intermediate_size else None
        # Qwen3-Next: the shared expert's output is scaled per token by sigmoid(x . w)
        self.shared_gate = nn.Linear(hidden_size, 1, bias=False) if shared_gate and shared_intermediate_size else None
        self.group = group
        self._stacked: StackedExperts | None = None  # built on the first fused forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for each token of ``x`` ``[T, hidden]`` (plus the shared experts')."""
        weights, ids = self.router(x)
        stacked = self._stacked_for(x)
        if stacked is not None:
            from radixlm.kernels.triton_moe import fused_experts

            out = fused_experts(x, stacked.gate_up, stacked.down, weights, ids, self.experts[0].act_fn, stacked.gate_up_bias, stacked.down_bias)
        else:
            out = run_experts(x, weights, ids, self.experts)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out if self.group is None else self.group.all_reduce(out)

    def stack_experts(self) -> bool:
        """Stack the routed experts now where forwards on their device take the fused path; True
        where they are stacked. The model runner calls it after loading and quantizing, before it
        sizes the KV pool from the free memory, so the one-time copy is not taken from the cache."""
        first = next(self.experts.parameters(), None)
        return first is not None and self._fused_on(first.device) and self._current_stack() is not None

    def _fused_on(self, device: torch.device) -> bool:
        """Whether forwards on ``device`` take the fused path (where the experts can be stacked)."""
        return self.kernel == "triton" or (self.kernel == "auto" and device.type == "cuda" and _have_triton())

    def _current_stack(self) -> StackedExperts | None:
        """The stacked expert weights, (re)built on first use and where the first or last expert's
        layers no longer lie in them (replaced: quantization replaces every expert's)."""
        ends = [self.experts[0], self.experts[-1]]
        if self._stacked is None or not _views_of(self._stacked, [e.gate_up_proj for e in ends], [e.down_proj for e in ends], [0, len(self.experts) - 1]):
            self._stacked = _stack(self.experts, self._stacked)
        return self._stacked

    def _stacked_for(self, x: torch.Tensor) -> StackedExperts | None:
        """The stacked expert weights where ``x`` takes the fused path, else None (see the module docstring)."""
        if not self._fused_on(x.device):
            return None
        stacked = self._current_stack()
        if stacked is not None and stacked.gate_up.dtype == x.dtype and stacked.gate_up.device == x.device:
            return stacked
        if self.kernel == "triton":
            why = "are not all plain nn.Linear of one dtype, device and bias" if stacked is None else f"are {stacked.gate_up.dtype} on {stacked.gate_up.device}, x {x.dtype} on {x.device}"
            raise ValueError(f"kernel 'triton' runs routed experts stacked; this block's experts {why}")
        return None

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> MoEBlock:
        """``.to()``, ``.half()`` and the like give each expert its own converted tensors: stack them again on next use."""
        self._stacked = None
        return super()._apply(fn, recurse)


KERNELS = ("auto", "torch", "triton")


@functools.cache
def _have_triton() -> bool:
    """``triton_available()``, asked once (a module lookup each forward would cost more than the check)."""
    return triton_available()


class StackedExperts(NamedTuple):
    """A block's routed experts' weights as ``fused_experts`` reads them; each expert's own
    parameters are views into these."""

    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    gate_up_bias: torch.Tensor | None  # [E, 2I]
    down_bias: torch.Tensor | None  # [E, H]


def _stack(experts: nn.ModuleList, previous: StackedExperts | None) -> StackedExperts | None:
    """The experts' weights stacked, their parameters made views into the stacks (kept where they
    already are ``previous``' views); None where some expert's layer is not a plain ``nn.Linear``
    or they differ in dtype, device or having a bias."""
    ups = [expert.gate_up_proj for expert in experts]
    downs = [expert.down_proj for expert in experts]
    layers = ups + downs
    if any(type(m) is not nn.Linear for m in layers) or len({(m.weight.dtype, m.weight.device) for m in layers}) != 1:
        return None
    if len({m.bias is None for m in ups}) != 1 or len({m.bias is None for m in downs}) != 1:
        return None
    if previous is not None and _views_of(previous, ups, downs):
        return previous
    with torch.inference_mode(False), torch.no_grad():  # plain tensors, even under the runner's inference mode
        parts = [_stack_into(ups, "weight"), _stack_into(downs, "weight")]
        parts += [None if ups[0].bias is None else _stack_into(ups, "bias"), None if downs[0].bias is None else _stack_into(downs, "bias")]
    return StackedExperts(*parts)


def _stack_into(layers: list[nn.Linear], name: str) -> torch.Tensor:
    """The layers' parameter ``name`` stacked along a new first axis; each layer's becomes a view of its row."""
    stacked = torch.stack([getattr(m, name).detach() for m in layers])
    for e, m in enumerate(layers):
        getattr(m, name).data = stacked[e]  # the same Parameter, now over the stack's storage (the old tensor is freed)
    return stacked


def _views_of(stacked: StackedExperts, ups: list[nn.Module], downs: list[nn.Module], rows: list[int] | None = None) -> bool:
    """Whether the experts' layers (those at ``rows`` of the stacks; all when None) are plain
    ``nn.Linear`` whose parameters still lie where ``stacked`` holds them."""
    if any(type(m) is not nn.Linear for m in ups + downs):
        return False
    pairs = [(stacked.gate_up, ups, "weight"), (stacked.down, downs, "weight"), (stacked.gate_up_bias, ups, "bias"), (stacked.down_bias, downs, "bias")]
    for tensor, layers, name in pairs:
        if tensor is None:
            if any(getattr(m, name) is not None for m in layers):  # a bias where the stacks have none
                return False
            continue
        if rows is None and len(layers) != tensor.shape[0]:
            return False
        for e, m in zip(rows if rows is not None else range(len(layers)), layers):
            p = getattr(m, name)
            if p is None or p.data_ptr() != tensor[e].data_ptr() or p.shape != tensor.shape[1:] or p.dtype != tensor.dtype:
                return False
    return True
