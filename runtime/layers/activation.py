"""Activations of gated MLPs over a fused gate/up projection: SiLU-and-multiply (Llama),
tanh-GELU-and-multiply (Gemma) and GPT-OSS's clamped SwiGLU."""

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


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's experts: ``(up + 1) * gate * sigmoid(alpha * gate)`` with gate clamped above at
    ``limit`` and up to ``[-limit, limit]``, of a fused ``[..., 2 * inter]`` output (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
