"""GGUF's quantized block formats run as stored: the linear layer and the embedding over raw blocks.

A GGUF tensor of a quantized type is a sequence of blocks per row (Q8_0: 32 weights in 34 bytes;
Q4_K: 256 weights in 144 bytes ...). ``GGUFLinear`` holds each part's rows as those bytes
(``uint8 [rows, row_bytes]``) and multiplies them with the C++ kernel
(``kernels/csrc/gguf_blocks.h``: activations quantized to 8 bits per 32, integer dot products
against the blocks, as llama.cpp's CPU backend computes them), so a layer takes the file's bytes
in memory and no weight is rounded twice. ``GGUFEmbedding`` looks rows up by dequantizing just
those rows. ``GGUFWeight`` is the ``StoredWeight`` of a GGUF tensor: its ``join`` picks the layer
per type.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from radixlm.kernels.cpu_ext import cpu_kernels
from radixlm.runtime.layers.quantized_linear import Int4Linear
from radixlm.runtime.layers.stored_weight import StoredWeight, dense_linear

logger = logging.getLogger(__name__)

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4 = 12, 13, 14, 20, 23, 39
Q4_Z = 1024  # ours, for AWQ/GPTQ zero points: fp16 d, uint8 zero, a pad byte, 16 bytes of Q4_0-ordered codes
KERNEL_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4, Q4_Z)
Q4_Z_BLOCK = (32, 20)  # weights, bytes

def type_name(qtype: int) -> str:
    """The GGML name of a type id (``Q4_K``), or ``Q4_Z`` for ours."""
    if qtype == Q4_Z:
        return "Q4_Z"
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def block_shape(qtype: int) -> tuple[int, int]:
    """``(weights, bytes)`` of one block of ``qtype``."""
    if qtype == Q4_Z:
        return Q4_Z_BLOCK
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


def kernel_types() -> frozenset[int]:
    """The types this machine's C++ build runs natively (none where it did not build)."""
    ext = cpu_kernels()
    if ext is None or not hasattr(ext, "gguf_native_types"):
        return frozenset()
    return frozenset(ext.gguf_native_types())


def dequantize_blocks(blocks: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """Rows of ``qtype`` blocks (``uint8 [rows, row_bytes]``) as float32 ``[rows, in_features]``, exactly."""
    data = blocks.cpu().numpy()
    if qtype == Q4_Z:
        flat = data.reshape(-1, Q4_Z_BLOCK[1])
        d = flat[:, :2].copy().view(np.float16).astype(np.float32)
        zero = flat[:, 2:3].astype(np.float32)
        qs = flat[:, 4:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        values = (codes - zero) * d
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(data, GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(blocks.shape[0], in_features))


def q4_blocks_to_q4_1(blocks: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 or Q4_1 rows as ``Int4Linear.from_q4_1``'s codes, scale and minimum, with no rounding
    (Q4_0's ``d * (q - 8)`` is ``q * d + (-8 d)``, and -8 d is exact in fp16)."""
    rows = blocks.shape[0]
    size = 18 if qtype == Q4_0 else 20
    b = blocks.reshape(rows, -1, size)
    scale = b[..., 0:2].contiguous().view(torch.float16).reshape(rows, -1)
    if qtype == Q4_0:
        minimum = (scale.float() * -8).half()
        qs = b[..., 2:]
    else:
        minimum = b[..., 2:4].contiguous().view(torch.float16).reshape(rows, -1)
        qs = b[..., 4:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # byte j: element j low, j + 16 high
    return codes.contiguous(), scale.contiguous(), minimum.contiguous()


class GGUFWeight(StoredWeight):
    """A GGUF tensor of a quantized type: its rows of blocks as the file stores them."""

    def __init__(self, qtype: int, blocks: torch.Tensor, in_features: int) -> None:
        weights, nbytes = block_shape(qtype)
        if in_features % weights or blocks.dim() != 2 or blocks.shape[1] != in_features // weights * nbytes:
            raise ValueError(f"{type_name(qtype)} rows of {in_features} weights take {in_features // weights * nbytes} bytes, got blocks {tuple(blocks.shape)}")
        self.qtype, self.blocks = qtype, blocks
        self.out_features, self.in_features = blocks.shape[0], in_features

    @property
    def format(self) -> str:
        """``gguf:`` and the type's name."""
        return f"gguf:{type_name(self.qtype)}"

    def nbytes(self) -> int:
        """The blocks' bytes."""
        return self.blocks.nbytes

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix the blocks stand for."""
        return dequantize_blocks(self.blocks, self.qtype, self.in_features)

    def take_rows(self, order: torch.Tensor) -> GGUFWeight:
        """The rows of blocks in ``order`` (a row of blocks is a row of the matrix)."""
        return GGUFWeight(self.qtype, self.blocks[order], self.in_features)

    @classmethod
    def join(cls, parts: Sequence[StoredWeight], bias: torch.Tensor | None, device: torch.device) -> nn.Module:
        """Q4_0/Q4_1 throughout: the int4 layer (Q4_0 alone: its Q4_0 tiles); else ``GGUFLinear`` where the C++ kernels run every
        part's type; else dequantized (logged)."""
        parts = [p for p in parts if isinstance(p, GGUFWeight)]
        types = {p.qtype for p in parts}
        if types <= {Q4_0, Q4_1}:
            q4 = [q4_blocks_to_q4_1(p.blocks, p.qtype) for p in parts]
            codes, scale, minimum = (torch.cat([q[i] for q in q4]).to(device) for i in range(3))
            if types == {Q4_0}:  # the Q4_0 tiles: the file's bytes
                return Int4Linear.from_q4_0(codes, scale, bias)
            return Int4Linear.from_q4_1(codes, scale, minimum, bias)
        if device.type == "cpu" and types <= kernel_types():
            return GGUFLinear([(p.qtype, p.blocks) for p in parts], parts[0].in_features, bias)
        where = "without the C++ kernels" if device.type == "cpu" else f"on {device.type}"
        logger.info("dequantizing %s weights %s: the GGUF block kernels run them on CPUs", "/".join(sorted(type_name(t) for t in types)), where)
        return dense_linear(parts, bias, device, torch.float32)


@dataclass(frozen=True)
class GGUFStackWeight:
    """A weight kept as GGUF blocks, as a layer's ``decode_weight`` hands it to the stack.

    ``parts[i]`` (``uint8 [n_i, row_bytes_i]``, the rows of GGUF type id ``types[i]``) stacked
    along the rows make the ``[n, K]`` weight. The stack computes ``gguf_linear(x, parts, types,
    n)`` and then adds ``bias`` (float32 ``[n]``, or None), so a layer whose forward computes the
    same gets the same outputs to the bit.
    """

    parts: list[torch.Tensor]
    types: list[int]
    n: int
    bias: torch.Tensor | None = None


class GGUFLinear(nn.Module):
    """``y = x @ W.T (+ b)`` with W's row parts kept as GGUF blocks (each part its own type)."""

    def __init__(self, parts: Sequence[tuple[int, torch.Tensor]], in_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if not parts:
            raise ValueError("GGUFLinear needs at least one part")
        for qtype, blocks in parts:
            GGUFWeight(qtype, blocks, in_features)  # checks the shape
        self.types = [int(t) for t, _ in parts]
        self.parts = [b.contiguous() for _, b in parts]
        for i, b in enumerate(self.parts):
            self.register_buffer(f"part{i}", b)
        self.in_features = in_features
        self.out_features = sum(b.shape[0] for b in self.parts)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)

    def _apply(self, fn, recurse=True):  # keep self.parts pointing at the (moved) buffers
        out = super()._apply(fn, recurse)
        self.parts = [getattr(self, f"part{i}") for i in range(len(self.parts))]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The product over the blocks (the C++ kernel, in float32); returns ``x``'s dtype."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        y = cpu_kernels().gguf_linear(rows, self.parts, self.types, self.out_features)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def decode_weight(self, rows: int):
        """What the C++ decode stack computes this layer with (``radixlm.runtime.layers.decode_stack``)."""
        return GGUFStackWeight(self.parts, self.types, self.out_features, self.bias)

    def weight_bytes(self) -> int:
        """Bytes of the blocks a call reads."""
        return sum(b.nbytes for b in self.parts)

    def extra_repr(self) -> str:
        """Shape and the parts' types."""
        return f"in_features={self.in_features}, out_features={self.out_features}, types={[type_name(t) for t in self.types]}"


class GGUFEmbedding(nn.Module):
    """Token embeddings kept as GGUF blocks; a lookup dequantizes only the rows it needs."""

    def __init__(self, weight: GGUFWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.qtype, self.embedding_dim, self.dtype = weight.qtype, weight.in_features, dtype
        self.register_buffer("blocks", weight.blocks.contiguous())
        self.num_embeddings = weight.out_features
        self.native = self.qtype in kernel_types()  # the C++ row lookup, else the gguf package's

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``input_ids`` in the model's dtype."""
        ids = input_ids.reshape(-1)
        if self.native:
            rows = cpu_kernels().gguf_dequantize_rows(self.blocks, self.qtype, ids.cpu(), self.embedding_dim)
        else:
            rows = dequantize_blocks(self.blocks[ids.cpu()], self.qtype, self.embedding_dim)
        return rows.to(device=input_ids.device, dtype=self.dtype).reshape(*input_ids.shape, self.embedding_dim)

    def stored(self) -> GGUFWeight:
        """The table as a stored weight (for a head tied to it)."""
        return GGUFWeight(self.qtype, self.blocks, self.embedding_dim)

    def extra_repr(self) -> str:
        """Shape and type."""
        return f"{self.num_embeddings}, {self.embedding_dim}, type={type_name(self.qtype)}"
