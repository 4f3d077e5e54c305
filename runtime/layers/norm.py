"""RMSNorm: root-mean-square layer norm, with the residual add fused in where a C++ kernel can."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels.cpu_ext import cpu_kernels


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32 as Hugging Face does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension of ``x`` and scale it."""
        ext = cpu_kernels() if x.device.type == "cpu" and x.dim() == 2 else None
        if ext is not None:
            return ext.add_rms_norm(x, None, self.weight, self.eps)[1]
        return self.weight * F.rms_norm(x.to(torch.float32), self.weight.shape, eps=self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x + residual`` and its normalized form (one pass on CPUs)."""
        ext = cpu_kernels() if x.device.type == "cpu" and x.dim() == 2 else None
        if ext is not None:
            total, normed = ext.add_rms_norm(x, residual, self.weight, self.eps)
        else:
            total = x + residual
            normed = self(total)
        return total, normed
