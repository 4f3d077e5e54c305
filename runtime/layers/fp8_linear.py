"""The FP8 linear layer: ``y = x @ (W * scale).T (+ b)`` with W kept as an FP8 checkpoint stores it.

W is the raw bits (uint8 ``[N, K]``) of ``float8_e4m3fn`` values, one byte per weight, with fp32
scales per tensor (one), per output row (``[N]``) or per ``[bn, bk]`` block (``[ceil(N/bn),
ceil(K/bk)]``, DeepSeek's and Qwen's ``weight_scale_inv``). Nothing is rounded on the way in.

- CPU: our C++ kernel (``kernels/csrc/fp8_matmul.h``) decodes the bytes in registers and
  multiplies them with fp32 activations, reading a quarter of fp32's bytes. From ``dense_from``
  rows on (prefill), or where the C++ kernels did not build, the weight is dequantized to the
  activations' dtype a chunk of rows at a time and multiplied by ``F.linear``.
- GPU: our Triton kernel (``radixlm.kernels.triton_fp8_linear``) does the same on any GPU, fp8
  hardware or not, in the activations' dtype.

A fused projection (q/k/v, gate/up) is several FP8 parts stacked along the output rows:
``FP8Linear.concat`` joins them exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from radixlm.kernels.cpu_ext import cpu_kernels
from radixlm.kernels.fp8_scales import check_scale

DENSE_FROM = 32  # rows from which the CPU dequantizes chunks and runs F.linear
CHUNK_WEIGHTS = 1 << 22  # weights dequantized at once by the PyTorch path (16 MiB in fp32)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, rows: slice | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight rows ``rows`` (default all) as ``dtype``: their e4m3 values times their scales (in fp32)."""
    rows = rows if rows is not None else slice(0, weight.shape[0])
    start, stop = rows.start, min(rows.stop, weight.shape[0])
    w = weight[start:stop].view(torch.float8_e4m3fn).float()
    if block is not None:
        bn, bk = block
        s = scale[start // bn : -(-stop // bn)].float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        w = w * s[start % bn : start % bn + (stop - start), : w.shape[1]]
    elif scale.numel() == 1:
        w = w * scale.float().reshape(())
    else:
        w = w * scale.float().reshape(-1)[start:stop, None]
    return w.to(dtype)


class FP8Linear(nn.Module):
    """``y = x @ (W * scale).T (+ b)`` with W the e4m3 bytes of an FP8 checkpoint.

    ``kernel``: ``cpp``, our C++ kernel (CPU); ``torch``, dequantized chunks times ``F.linear``;
    ``triton``, our Triton kernel (GPUs, or its interpreter on CPU tensors); ``auto``, Triton off
    the CPU, else the C++ one where it built."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
                 bias: torch.Tensor | None = None, kernel: str = "auto", dense_from: int | None = DENSE_FROM) -> None:  # fmt: skip
        super().__init__()
        if weight.dtype == torch.float8_e4m3fn:
            weight = weight.view(torch.uint8)
        if weight.dim() != 2 or weight.dtype != torch.uint8:
            raise ValueError(f"weight must be the uint8 bits (or a float8_e4m3fn tensor) [N, K], got {weight.dtype} {tuple(weight.shape)}")
        if kernel not in ("auto", "cpp", "torch", "triton"):
            raise ValueError(f"kernel must be auto, cpp, torch or triton, got {kernel!r}")
        n, k = weight.shape
        block = None if block is None else (int(block[0]), int(block[1]))
        check_scale(scale, n, k, block)
        if kernel == "auto":
            kernel = "triton" if weight.device.type != "cpu" else ("cpp" if cpu_kernels() is not None else "torch")
        elif kernel == "cpp" and cpu_kernels() is None:
            raise RuntimeError("the C++ CPU kernels are not available here (see the warning logged when they failed to build)")
        self._kernel = kernel
        self.register_buffer("weight", weight.contiguous())
        scale = scale.float()
        self.register_buffer("scale", (scale.reshape(scale.shape[0], -1) if block is not None else scale.reshape(-1)).contiguous())
        self.block = block
        if bias is None or isinstance(bias, nn.Parameter):
            self.bias = bias
        else:
            self.bias = nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = n, k
        self.dense_from = dense_from

    @classmethod
    def concat(cls, parts: Sequence[tuple[torch.Tensor, torch.Tensor]], block: tuple[int, int] | None = None,
               bias: torch.Tensor | None = None, **kwargs) -> FP8Linear:  # fmt: skip
        """One layer for ``(weight, scale)`` parts stacked along the output rows (a fused q/k/v),
        exactly: per-tensor and per-row scales become per-row ones; block scales stack their rows,
        which needs every part but the last to have a multiple of ``block[0]`` rows."""
        if not parts:
            raise ValueError("concat needs at least one part")
        weights = [w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w for w, _ in parts]
        ks = {w.shape[1] for w in weights}
        if len(ks) != 1:
            raise ValueError(f"FP8 parts must share in_features, got {[tuple(w.shape) for w in weights]}")
        for w, (_, s) in zip(weights, parts, strict=True):
            check_scale(s, w.shape[0], w.shape[1], block)
        if block is not None:
            ragged = [tuple(w.shape) for w in weights[:-1] if w.shape[0] % block[0]]
            if ragged:
                shapes = ", ".join(str(tuple(w.shape)) for w in weights)
                raise ValueError(f"block-scaled parts {shapes} cannot be stacked: rows of {ragged} are not a multiple of block {block[0]}")
            scale = torch.cat([s.float().reshape(s.shape[0], -1) for _, s in parts])
        elif len(parts) == 1:
            scale = parts[0][1].float()
        else:
            scale = torch.cat([s.float().reshape(-1).expand(w.shape[0]) for w, (_, s) in zip(weights, parts, strict=True)])
        return cls(torch.cat(weights), scale, block, bias, **kwargs)

    @property
    def kernel(self) -> str:
        """The kernel its calls of few rows run on: ``cpp``, ``torch`` or ``triton``."""
        return self._kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The product with the FP8 weight; returns ``x``'s dtype."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if self._kernel == "triton":
            from radixlm.kernels.triton_fp8_linear import fp8_linear

            return fp8_linear(rows, self.weight, self.scale, self.block, self.bias).reshape(*shape[:-1], self.out_features)
        if self._kernel == "cpp" and (self.dense_from is None or rows.shape[0] < self.dense_from):
            bn, bk = self.block if self.block is not None else (0, 0)
            y = cpu_kernels().fp8_linear(rows.float(), self.weight, self.scale, bn, bk).to(x.dtype)
        else:
            y = self._dense_product(rows)
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _dense_product(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ W.T`` with W dequantized to ``rows``' dtype a chunk of output rows at a time."""
        step = max(1, CHUNK_WEIGHTS // max(1, self.in_features))
        if self.block is not None:
            step = max(self.block[0], step // self.block[0] * self.block[0])
        y = torch.empty(rows.shape[0], self.out_features, dtype=rows.dtype, device=rows.device)
        for start in range(0, self.out_features, step):
            w = dequantize(self.weight, self.scale, self.block, slice(start, start + step), rows.dtype)
            y[:, start : start + w.shape[0]] = torch.nn.functional.linear(rows, w)
        return y

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[out_features, in_features]`` weight it computes with."""
        return dequantize(self.weight, self.scale, self.block)

    def weight_bytes(self) -> int:
        """Bytes of the weight and its scales a call reads."""
        return self.weight.nbytes + self.scale.nbytes

    def extra_repr(self) -> str:
        """Shape, scales and kernel, for ``print(model)``."""
        scales = f"block={self.block}" if self.block is not None else ("per-tensor" if self.scale.numel() == 1 else "per-channel")
        return f"in_features={self.in_features}, out_features={self.out_features}, {scales}, kernel={self._kernel}, bias={self.bias is not None}"
