"""Rotary position embeddings (rotate-half layout), with linear and Llama-3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

from radixlm.kernels.cpu_ext import cpu_kernels


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, after the configured scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to query and key heads at given positions from a precomputed table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self._args = (head_dim, max_positions, theta, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.rebuild()

    def rebuild(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the cos/sin tables in fp32, e.g. after ``to_empty`` discarded them."""
        head_dim, max_positions, theta, scaling = self._args
        device = device if device is not None else self.cos.device
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        self.cos = freqs.cos().to(device)
        self.sin = freqs.sin().to(device)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, D/2]`` for the tokens' positions (once per forward, for all layers)."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` ``[T, H, D]`` and ``k`` ``[T, Hkv, D]`` with a ``RotaryEmbedding.table``."""
    cos, sin = rope
    ext = cpu_kernels() if q.device.type == "cpu" else None
    if ext is not None:
        cos2, sin2 = cos.reshape(cos.shape[0], cos.shape[-1]), sin.reshape(sin.shape[0], sin.shape[-1])
        return ext.rope(q, cos2, sin2), ext.rope(k, cos2, sin2)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
