"""Weight-only int8 / int4 linear layers on PyTorch's CPU kernels (``--quantization``).

A decode step at small batch is bound by reading weights: int8 reads 4x and int4 8x fewer bytes
than fp32. The kernels (``aten._weight_int8pack_mm`` and ``aten._weight_int4pack_mm_for_cpu``)
take bf16 activations; outputs are cast back to the model's dtype, and everything around the
matmuls (norms, RoPE, attention, residuals) stays in that dtype.

- int8: per-output-channel symmetric scales.
- int4: groups of 32 input weights with a scale and a minimum (``w = q * scale + min``,
  ``q`` in 0..15) — the same layout as GGUF's Q4_1 blocks, so a Q4_1 model re-quantized here gets
  its original values back (up to bf16 rounding of the scales).
- int4_bf16: int4 for small batches, where reading the weights dominates, and a bf16 copy of the
  weights for large batches where bf16 math is faster than the int4 kernel's dequantization, as
  this machine measures (``cpu_paths``; on a CPU without fast bf16 the copy is never used nor kept).
- auto: per row count, the fastest of fp32, bf16, int8 and int4 on this machine (``cpu_paths``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from radixlm.runtime.models.cpu_paths import FORMS, AutoLinear, PathPlan, plan_for

INT4_GROUP = 32
MODES = ("int8", "int4", "int4_bf16", "auto")


class Int8Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with W stored as int8 rows and one bf16 scale per row."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
        self.register_buffer("qweight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.out_features = w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Quantized matmul on bf16 activations; returns ``x``'s dtype."""
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.qweight, self.scales)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with W in packed 4-bit groups of 32 (scale and minimum per group)."""

    def __init__(self, linear: nn.Linear, dense_from: int | None = None) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        self.dense_from = dense_from  # from this many rows on, a bf16 copy of the weights is used
        self.register_buffer("dense", w.to(torch.bfloat16) if dense_from is not None else None)
        if k % INT4_GROUP:
            raise ValueError(f"int4 quantization needs in_features divisible by {INT4_GROUP}, got {k}")
        groups = w.reshape(n, k // INT4_GROUP, INT4_GROUP)
        lo, hi = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = torch.round((groups - lo) / scale).clamp(0, 15).to(torch.int32).reshape(n, k)
        # the kernel computes (q - 8) * scale + zero per group, so zero = min + 8 * scale; it
        # needs a multiple of 16 output rows: pad with zero rows and slice them off
        pad = -n % 16
        zero = lo + 8 * scale
        if pad:
            q = torch.cat([q, torch.full((pad, k), 8, dtype=torch.int32)])
            scale = torch.cat([scale, torch.ones(pad, k // INT4_GROUP, 1)])
            zero = torch.cat([zero, torch.zeros(pad, k // INT4_GROUP, 1)])
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        sz = torch.stack([scale.squeeze(-1).t(), zero.squeeze(-1).t()], dim=-1).contiguous()
        self.register_buffer("scales_zeros", sz.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.out_features = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Quantized matmul on bf16 activations (bf16 weights for many rows); returns ``x``'s dtype."""
        shape = x.shape
        if self.dense is not None and x.numel() >= self.dense_from * shape[-1]:
            y = torch.nn.functional.linear(x.to(torch.bfloat16), self.dense).to(x.dtype)
            return y if self.bias is None else y + self.bias
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.qweight, INT4_GROUP, self.scales_zeros)
        y = y[:, : self.out_features].to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def quantize_model(model: nn.Module, mode: str, plan_fn: Callable[..., PathPlan] = plan_for) -> None:
    """Replace the model's linear layers (and its output head) with ``mode`` weight-only layers
    (``plan_fn``: where ``auto`` and ``int4_bf16`` get their measured plan)."""
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {MODES}, got {mode!r}")
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("weight-only quantization uses PyTorch's CPU kernels; it needs --device cpu")
    if mode == "auto" and next(model.parameters()).dtype != torch.float32:
        raise ValueError("quantization auto chooses among fp32, bf16, int8 and int4 forms of fp32 weights; it needs --dtype float32")
    make: Callable[[nn.Linear], nn.Module]
    if mode == "int8":
        make = Int8Linear
    elif mode == "int4":
        make = Int4Linear
    elif mode == "int4_bf16":
        plan = plan_fn(model, ("int4", "bf16"))
        dense_from = next((b for b, f in zip(plan.buckets, plan.forms) if f == "bf16"), None)
        make = lambda linear: Int4Linear(linear, dense_from)  # noqa: E731
    else:
        plan = plan_fn(model, FORMS)
        if plan.used == {"fp32"}:
            return  # fp32 is fastest at every size here: nothing to replace
        make = _maker(plan)

    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, make(child))
    if getattr(model, "lm_head", None) is None:  # tied: the head is a quantized copy of the embedding
        head = nn.Linear(model.config.hidden_size, model.embed_tokens.weight.shape[0], bias=False)
        head.weight = model.embed_tokens.weight
        model.lm_head = make(head)


def _maker(plan: PathPlan) -> Callable[[nn.Linear], nn.Module]:
    """The layer for an ``auto`` plan: the plain quantized layer where the plan is one of theirs
    (int8 or int4 throughout, int4 then bf16 from some size on), else an AutoLinear."""
    if plan.used == {"int8"}:
        return Int8Linear
    if plan.used <= {"int4", "bf16"} and plan.forms[0] == "int4":
        first = next((i for i, f in enumerate(plan.forms) if f == "bf16"), None)
        if first is None:
            return Int4Linear
        if all(f == "bf16" for f in plan.forms[first:]):
            return lambda linear: Int4Linear(linear, plan.buckets[first])
    return lambda linear: AutoLinear(linear, plan)
