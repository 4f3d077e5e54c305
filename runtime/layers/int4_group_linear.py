"""Int4 weights with a scale and a zero point per group of inputs (GPTQ, AWQ) on GPUs, and the
input permutation GPTQ's act-order needs in front of any layer.

``W[n, k] = (code - zero) * scale`` with codes 0..15, one fp16 scale and one uint8 zero per
``group`` consecutive inputs of a row: GPTQ's and AutoAWQ's arithmetic, kept exactly as the
checkpoint stores it. On a GPU our Triton kernel (``radixlm.kernels.triton_int4_linear.
int4_zp_linear``) dequantizes the codes in registers; a decode step reads ``0.5 + 3 / group``
bytes per weight. A GPTQ checkpoint quantized in activation order (``desc_act``) stores groups
that are scattered over the inputs; ``perm`` gathers the inputs so that they are contiguous, once
per call, for the layer's parts (fused q/k/v share it: they see the same inputs).
"""

from __future__ import annotations

import torch
from torch import nn


def _as_bias(bias: torch.Tensor | None) -> nn.Parameter | None:
    """``bias`` as a parameter (a given ``nn.Parameter`` kept as it is: the loader may fill it later)."""
    return bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)


class Int4GroupLinear(nn.Module):
    """``y = x[..., perm] @ W.T (+ b)`` with W in int4 groups with zero points (GPUs: our Triton kernel)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                 perm: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:  # fmt: skip
        super().__init__()
        n, k = codes.shape
        if k % group or k % 2 or scale.shape != (n, k // group) or zero.shape != scale.shape:
            raise ValueError(f"codes [N, K] with K a multiple of the group ({group}) need scale and zero [N, K/group], got {tuple(codes.shape)}, {tuple(scale.shape)}, {tuple(zero.shape)}")
        half = k // 2  # the Triton kernel's layout: byte j holds input j (low nibble) and j + K/2 (high)
        codes = codes.to(torch.uint8)
        self.register_buffer("halves", (codes[:, :half] | (codes[:, half:] << 4)).contiguous())
        self.register_buffer("scale", scale.to(torch.float16).contiguous())
        self.register_buffer("zero", zero.to(torch.uint8).contiguous())
        self.register_buffer("perm", None if perm is None else perm.to(device=codes.device, dtype=torch.long))
        self.group, self.in_features, self.out_features = group, k, n
        self.bias = _as_bias(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The product in ``x``'s dtype."""
        from radixlm.kernels.triton_int4_linear import int4_zp_linear

        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        y = int4_zp_linear(rows, self.halves, self.scale, self.zero, self.group, self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """Bytes of the codes, scales and zeros a call reads."""
        return self.halves.nbytes + self.scale.nbytes + self.zero.nbytes

    def extra_repr(self) -> str:
        """Shape, group and whether the inputs are permuted."""
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, act_order={self.perm is not None}"


class PermutedInput(nn.Module):
    """``inner(x[..., perm]) (+ b)``: a layer whose stored weight columns are the inputs in ``perm``'s order."""

    def __init__(self, inner: nn.Module, perm: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("perm", perm.to(torch.long))
        self.bias = _as_bias(bias)
        self.in_features, self.out_features = perm.numel(), inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The inner layer on the permuted inputs; returns ``x``'s dtype."""
        y = self.inner(x.index_select(-1, self.perm))
        return y if self.bias is None else y + self.bias

    def weight_bytes(self) -> int:
        """The inner layer's weight bytes and the permutation's."""
        inner = self.inner.weight_bytes() if hasattr(self.inner, "weight_bytes") else 0
        return inner + self.perm.nbytes
