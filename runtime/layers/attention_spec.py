"""AttentionSpec: how one layer's attention differs from plain causal softmax(q·kᵀ/√d).

The families set it per layer and every attention path (the PyTorch reference, the C++ CPU
kernels and fused decode stack, the Triton kernels) honours all of it:

- ``scale`` multiplies q·kᵀ (``head_dim ** -0.5`` unless the family says otherwise, as Gemma's
  ``query_pre_attn_scalar`` does);
- ``window``: a sliding window of W positions, the query's own included: the token at position
  ``i`` sees positions ``j`` with ``i - W < j <= i`` (transformers' rule); None attends to all;
- ``softcap``: scores become ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2);
- ``sinks``: a learned logit per query head ``[H]`` that joins the softmax denominator and
  takes no value (GPT-OSS): ``out = Σ exp(s_j) v_j / (exp(sink) + Σ exp(s_j))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's scale, sliding window, logit soft-cap and attention sinks."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [H] fp32, this rank's heads

    @property
    def plain(self) -> bool:
        """True when only the scale is set: plain causal softmax attention."""
        return self.window is None and self.softcap is None and self.sinks is None

    @classmethod
    def default(cls, head_dim: int) -> AttentionSpec:
        """Plain attention at ``head_dim ** -0.5``."""
        return cls(head_dim**-0.5)
