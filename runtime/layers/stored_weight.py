"""A checkpoint's weight matrix in the format it was stored in, and the layer that computes it as stored.

A pre-quantized checkpoint (a GGUF file, AWQ or GPTQ int4 safetensors, FP8 safetensors) gives
each linear layer's weight as a ``StoredWeight``: its logical shape ``[out_features,
in_features]``, the bytes it occupies, and an exact dequantization (the reference that tests and
the fallback use). A model fuses some projections (q/k/v, gate/up), so one layer can be made of
several stored weights stacked along the output rows, and in a mixed-type file (GGUF ``Q4_K_M``
mixes Q4_K and Q6_K) they need not share a type: ``join_stored`` asks the parts' class for the one
layer that computes them all (``StoredWeight.join``).

Where the formats live: GGUF (``radixlm.runtime.layers.gguf_linear``), AWQ/GPTQ and FP8
(``radixlm.runtime.checkpoints``). How a model's layers are replaced:
``radixlm.runtime.checkpoints.install``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)


class StoredWeight(ABC):
    """One ``[out_features, in_features]`` weight matrix as its checkpoint stores it."""

    out_features: int
    in_features: int

    @property
    @abstractmethod
    def format(self) -> str:
        """The stored format's name, e.g. ``gguf:Q4_K``, ``gptq``, ``awq``, ``fp8``."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the stored form occupies (codes, scales, zero points)."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The exact float32 ``[out_features, in_features]`` matrix the stored form represents."""

    def take_rows(self, order: torch.Tensor) -> StoredWeight | None:
        """The weight whose row ``i`` is this one's row ``order[i]``, in the same stored form, where
        the form can move rows exactly; None where it cannot (the caller dequantizes or refuses)."""
        return None

    @classmethod
    @abstractmethod
    def join(cls, parts: Sequence[StoredWeight], bias: torch.Tensor | None, device: torch.device) -> nn.Module:
        """The layer computing ``x @ W.T (+ bias)`` for W the parts stacked along the output rows
        (each part of this class), holding them in their stored form on ``device``; returns
        ``x``'s dtype. ``bias`` may be a meta tensor that the loader fills later."""


class DequantizedLinear(nn.Module):
    """``y = x @ W.T (+ b)`` with W stored weights dequantized once (where they have no native
    kernel on this device). W is a buffer: the loader does not fill it from the checkpoint."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The dense product in the weight's dtype; returns ``x``'s dtype."""
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias if self.bias is None else self.bias.to(self.weight.dtype)).to(x.dtype)

    def decode_weight(self, rows: int) -> tuple[torch.Tensor, int, torch.Tensor | None] | None:
        """The fp32 matrix for the C++ decode stack (None in other dtypes)."""
        return (self.weight, self.out_features, self.bias) if self.weight.dtype == torch.float32 else None


def join_stored(parts: Sequence[StoredWeight], bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The one layer computing ``parts`` stacked along the output rows: their class's native layer,
    or a dense ``dtype`` layer where the parts are of different classes (logged)."""
    if not parts:
        raise ValueError("join_stored needs at least one part")
    in_features = {p.in_features for p in parts}
    if len(in_features) != 1:
        raise ValueError(f"stored parts of one layer must share in_features, got {sorted(in_features)}")
    kinds = {type(p) for p in parts}
    if len(kinds) == 1:
        return type(parts[0]).join(parts, bias, device)
    logger.info("dequantizing a layer whose parts have different formats (%s)", ", ".join(sorted({p.format for p in parts})))
    return dense_linear(parts, bias, device, dtype)


def dense_linear(parts: Sequence[StoredWeight], bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The parts dequantized into one dense ``dtype`` linear layer (the fallback, full size in memory)."""
    weight = torch.cat([p.dequantize() for p in parts]).to(device=device, dtype=dtype)
    return DequantizedLinear(weight, bias)
