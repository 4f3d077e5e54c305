"""Weight-only int8 and int4 linear layers: the quantized forms of ``nn.Linear`` (``--quantization``).

A decode step at small batch is bound by reading weights: int8 reads 4x and int4 8x fewer bytes
than fp32. PyTorch's kernels (``aten._weight_int8pack_mm`` and ``aten._weight_int4pack_mm_for_cpu``)
take bf16 activations; outputs are cast back to the model's dtype, and everything around the
matmuls (norms, RoPE, attention, residuals) stays in that dtype.

- int8: per-output-channel symmetric scales. On a GPU the same layout is multiplied by our Triton
  kernel (``radixlm.kernels.triton_int8_linear``), in the activations' dtype.
- int4: groups of 32 input weights with a scale and a minimum (``w = q * scale + min``,
  ``q`` in 0..15, fp16 scale and minimum) — GGUF's Q4_1 blocks, so a Q4_1 model re-quantized here
  gets its original values back. Our C++ kernel multiplies them with activations quantized to 8
  bits per 32 (as llama.cpp does), or, where it did not build, PyTorch's int4 kernel with bf16
  activations. On a GPU our Triton kernel (``radixlm.kernels.triton_int4_linear``) dequantizes
  them in registers and multiplies in the activations' dtype.

An int4 layer can also keep a bf16 copy of its weights for large batches (``dense_from``), where
bf16 math is faster than the int4 kernel's dequantization. Which modes exist and how a model's
layers are replaced: ``radixlm.runtime.layers.quant``.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm.kernels.cpu_ext import cpu_kernels

INT4_GROUP = 32
Q4_TILE = 4  # weight rows per tile of the C++ kernel's layout


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
        """Quantized matmul (CPU: PyTorch's kernel on bf16 activations; GPU: our Triton kernel on
        ``x``'s dtype); returns ``x``'s dtype."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if x.device.type != "cpu":
            from radixlm.kernels.triton_int8_linear import int8_linear

            return int8_linear(rows, self.qweight, self.scales, self.bias).reshape(*shape[:-1], self.out_features)
        y = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), self.qweight, self.scales)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def q4_1_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` [N, K] as Q4_1 groups of 32: codes [N, K/32, 32] in 0..15, scale and minimum [N, K/32]
    (fp16, as GGUF stores them), with ``w ~ code * scale + minimum``."""
    n, k = w.shape
    if k % INT4_GROUP:
        raise ValueError(f"int4 quantization needs in_features divisible by {INT4_GROUP}, got {k}")
    groups = w.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-7).half()
    minimum = lo.half()
    # the codes of the rounded scale and minimum (what is stored), so they round to the nearest point
    codes = torch.round((groups - minimum.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.uint8)
    return codes, scale, minimum


def q4_1_tiles(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The C++ kernel's layout of ``q4_1_quantize``'s output: tiles of 4 rows, uint8
    [ceil(N / 4), K/32 * 80]; block g of a tile is the 4 rows' fp16 scales, their 4 fp16 minimums,
    then each row's 16 bytes of codes (byte j: element j in the low nibble, j + 16 in the high
    one, as in GGUF's Q4_1)."""
    n, g, _ = codes.shape
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    pad = -n % Q4_TILE
    if pad:  # zero rows (scale and minimum 0): their outputs are never written
        nibbles = torch.cat([nibbles, torch.zeros(pad, g, 16, dtype=torch.uint8)])
        scale = torch.cat([scale, torch.zeros(pad, g, dtype=scale.dtype)])
        minimum = torch.cat([minimum, torch.zeros(pad, g, dtype=minimum.dtype)])
    tiles = (n + pad) // Q4_TILE

    def by_block(t: torch.Tensor) -> torch.Tensor:  # bytes [N, G, b] -> [tiles, G, 4 * b]
        return t.reshape(tiles, Q4_TILE, g, -1).transpose(1, 2).reshape(tiles, g, -1)

    halves = [t.contiguous().view(torch.uint8).reshape(n + pad, g, 2) for t in (scale, minimum)]
    parts = [by_block(halves[0]), by_block(halves[1]), by_block(nibbles)]
    return torch.cat(parts, dim=-1).reshape(tiles, g * Q4_TILE * 20).contiguous()


def q4_0_tiles(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_0 weights (``w = scale * (code - 8)``) in the C++ kernel's Q4_0 tiles: uint8
    [ceil(N / 4), K/32 * 72], ``q4_1_tiles``' layout without the minimums (the kernel computes -8
    scale): the file's 18 bytes per block, not Q4_1's 20."""
    tiles = q4_1_tiles(codes, scale, torch.zeros_like(scale))
    by_block = tiles.reshape(tiles.shape[0], codes.shape[1], Q4_TILE * 20)
    return torch.cat([by_block[..., :8], by_block[..., 16:]], dim=-1).reshape(tiles.shape[0], -1).contiguous()


class Int4Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with W in 4-bit groups of 32 (scale and minimum per group).

    ``kernel``: ``cpp``, our C++ kernel (``kernels/csrc/q4_matmul.h``: Q4_1 blocks times
    8-bit-quantized activations, integer dot products), which runs every row count the same way;
    ``torch``, PyTorch's int4 kernel on bf16 activations; ``triton``, our Triton kernel (GPUs);
    ``auto``, Triton off the CPU, else the C++ one where it built."""

    def __init__(self, linear: nn.Linear, dense_from: int | None = None, kernel: str = "auto") -> None:
        super().__init__()
        w = linear.weight.detach().float()
        codes, scale, minimum = q4_1_quantize(w)
        dense = w.to(torch.bfloat16) if dense_from is not None else None
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self._pack(codes, scale, minimum, bias, dense_from, dense, kernel, w.device)

    @classmethod
    def from_q4_1(cls, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: torch.Tensor | None = None, kernel: str = "auto") -> Int4Linear:
        """The layer for weights already in Q4_1 form (``q4_1_quantize``'s output: codes ``[N, K/32,
        32]`` in 0..15, fp16 scale and minimum ``[N, K/32]``), on their device, with no rounding."""
        if codes.dim() != 3 or codes.shape[2] != INT4_GROUP or scale.shape != codes.shape[:2] or minimum.shape != scale.shape:
            raise ValueError(f"codes must be [N, K/32, 32] with scale and minimum [N, K/32], got {tuple(codes.shape)}, {tuple(scale.shape)}, {tuple(minimum.shape)}")
        if scale.dtype != torch.float16 or minimum.dtype != torch.float16:
            raise ValueError("scale and minimum must be float16 (as GGUF's Q4_1 stores them)")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._pack(codes.to(torch.uint8), scale, minimum, bias, None, None, kernel, codes.device)
        return layer

    @classmethod
    def from_q4_0(cls, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, kernel: str = "auto") -> Int4Linear:
        """The layer for GGUF Q4_0 weights (``w = scale * (code - 8)``: codes ``[N, K/32, 32]``,
        fp16 scale ``[N, K/32]``): the C++ kernel's Q4_0 tiles (the file's bytes), else its Q4_1
        form (minimum -8 scale, exact in fp16) for the other kernels."""
        if codes.dim() != 3 or codes.shape[2] != INT4_GROUP or scale.shape != codes.shape[:2] or scale.dtype != torch.float16:
            raise ValueError(f"codes must be [N, K/32, 32] with a float16 scale [N, K/32], got {tuple(codes.shape)}, {scale.dtype} {tuple(scale.shape)}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        minimum = (scale.float() * -8).half()
        layer._pack(codes.to(torch.uint8), scale, minimum, bias, None, None, kernel, codes.device, q4_0=True)
        return layer

    def _pack(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: torch.Tensor | None,
              dense_from: int | None, dense: torch.Tensor | None, kernel: str, device: torch.device, q4_0: bool = False) -> None:  # fmt: skip
        """Hold the codes in the layout of the kernel that will run them (``q4_0``: the minimum is
        -8 scale, and the C++ kernel takes Q4_0 tiles)."""
        if kernel not in ("auto", "cpp", "torch", "triton"):
            raise ValueError(f"kernel must be auto, cpp, torch or triton, got {kernel!r}")
        n = codes.shape[0]
        if kernel == "auto" and device.type != "cpu":
            kernel = "triton"
        if kernel == "triton" and dense_from is not None:
            raise ValueError("the Triton int4 kernel has no bf16 copy for large batches (dense_from must be None)")
        self.dense_from = dense_from  # from this many rows on, a bf16 copy of the weights is used
        self.register_buffer("dense", dense)
        ext = cpu_kernels() if kernel in ("auto", "cpp") and device.type == "cpu" else None
        if kernel == "cpp" and ext is None:
            raise RuntimeError("the C++ CPU kernels are not available here (see the warning logged when they failed to build)")
        tiles = None if ext is None else q4_0_tiles(codes, scale) if q4_0 else q4_1_tiles(codes, scale, minimum)
        self.register_buffer("tiles", tiles)
        self.register_buffer("qweight", None)
        self.register_buffer("scales_zeros", None)
        for name in ("halves", "group_scale", "group_min"):  # the Triton kernel's layout
            self.register_buffer(name, None)
        if kernel == "triton":
            from radixlm.kernels.triton_int4_linear import pack_halves

            self.halves, self.group_scale, self.group_min = pack_halves(codes), scale, minimum
        elif ext is None:
            self._pack_for_torch(codes, scale.float(), minimum.float())
        if bias is None or isinstance(bias, nn.Parameter):
            self.bias = bias
        else:
            self.bias = nn.Parameter(bias, requires_grad=False)
        self.out_features = n

    @property
    def kernel(self) -> str:
        """The kernel its calls run on: ``cpp``, ``torch`` or ``triton``."""
        if self.halves is not None:
            return "triton"
        return "cpp" if self.tiles is not None else "torch"

    def _pack_for_torch(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> None:
        """PyTorch's int4 layout of the same codes."""
        n, g, _ = codes.shape
        q = codes.to(torch.int32).reshape(n, g * INT4_GROUP)
        # the kernel computes (q - 8) * scale + zero per group, so zero = min + 8 * scale; it
        # needs a multiple of 16 output rows: pad with zero rows and slice them off
        zero = minimum + 8 * scale
        pad = -n % 16
        if pad:
            q = torch.cat([q, torch.full((pad, g * INT4_GROUP), 8, dtype=torch.int32)])
            scale = torch.cat([scale, torch.ones(pad, g)])
            zero = torch.cat([zero, torch.zeros(pad, g)])
        self.qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The quantized product (bf16 weights for many rows); returns ``x``'s dtype."""
        shape = x.shape
        if self.dense is not None and x.numel() >= self.dense_from * shape[-1]:
            y = torch.nn.functional.linear(x.to(torch.bfloat16), self.dense).to(x.dtype)
            return y if self.bias is None else y + self.bias
        rows = x.reshape(-1, shape[-1])
        if self.halves is not None:
            from radixlm.kernels.triton_int4_linear import int4_linear

            return int4_linear(rows, self.halves, self.group_scale, self.group_min, self.bias).reshape(*shape[:-1], self.out_features)
        if self.tiles is not None:
            y = cpu_kernels().q4_linear(rows.float(), self.tiles, self.out_features)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.to(torch.bfloat16), self.qweight, INT4_GROUP, self.scales_zeros)[:, : self.out_features]
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def decode_weight(self, rows: int) -> tuple[torch.Tensor, int, torch.Tensor | None] | None:
        """``(tiles, out_features, bias)`` when calls of ``rows`` rows run the C++ kernel, else None
        (what ``radixlm.runtime.layers.decode_stack`` computes this layer with)."""
        if self.tiles is None or (self.dense is not None and rows >= self.dense_from):
            return None
        return self.tiles, self.out_features, self.bias

    def weight_bytes(self) -> int:
        """Bytes of the packed weights (and scales) a call of few rows reads."""
        if self.tiles is not None:
            return self.tiles.nbytes
        if self.halves is not None:
            return self.halves.nbytes + self.group_scale.nbytes + self.group_min.nbytes
        return self.qweight.nbytes + self.scales_zeros.nbytes
