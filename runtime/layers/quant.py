"""Weight-only quantization of a model (``--quantization``): all modes on CPUs, int8 and int4 on GPUs too.

A decode step at small batch is bound by reading weights: int8 reads 4x and int4 8x fewer bytes
than fp32. ``quantize_model`` replaces the model's linear layers (and its output head) with the
mode's layers (``radixlm.runtime.layers.quantized_linear``):

- int8: ``Int8Linear`` (per-output-channel scales).
- int4: ``Int4Linear`` (Q4_1 groups of 32).
- int4_bf16: int4 for small batches, where reading the weights dominates, and a bf16 copy of the
  weights for large batches where bf16 math is faster than the int4 kernel's dequantization, as
  this machine measures (``cpu_paths``; on a CPU without fast bf16 the copy is never used nor kept).
- auto: per row count, the fastest of fp32, bf16, int8 and int4 on this machine (``cpu_paths``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from radixlm.kernels import triton_available
from radixlm.runtime.layers.cpu_paths import FORMS, AutoLinear, PathPlan, plan_for
from radixlm.runtime.layers.quantized_linear import Int4Linear, Int8Linear

MODES = ("int8", "int4", "int4_bf16", "auto")


def quantize_model(model: nn.Module, mode: str, plan_fn: Callable[..., PathPlan] = plan_for) -> None:
    """Replace the model's linear layers (and its output head) with ``mode`` weight-only layers
    (``plan_fn``: where ``auto`` and ``int4_bf16`` get their measured plan)."""
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {MODES}, got {mode!r}")
    device = next(model.parameters()).device
    if device.type != "cpu" and mode not in ("int8", "int4"):
        raise ValueError(f"quantization {mode!r} runs on CPU kernels; on {device.type} int8 and int4 are available (Triton kernels)")
    if device.type != "cpu" and not triton_available():
        raise ValueError(f"quantization {mode} on {device.type} needs the triton package (pip install 'radixlm[triton]')")
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
    stacks = getattr(model, "decode_stacks", None)
    if stacks is not None:  # they point at the replaced layers' weights
        stacks.clear()


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
