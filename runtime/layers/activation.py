"""Activations of gated MLPs over a fused gate/up projection: SiLU-and-multiply (Llama) and
tanh-GELU-and-multiply (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.kernels.cpu_ext import cpu_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused ``[..., 2 * inter]`` gate/up output (gate first); ``[..., inter]``."""
    ext = cpu_kernels() if gate_up.device.type == "cpu" and gate_up.dim() == 2 else None
    if ext is not None:
        return ext.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` of a fused ``[..., 2 * inter]`` gate/up output (gate first); ``[..., inter]``."""
    ext = cpu_kernels() if gate_up.device.type == "cpu" and gate_up.dim() == 2 else None
    if ext is not None:
        return ext.gelu_tanh_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
