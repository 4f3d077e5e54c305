"""GPT-OSS's MXFP4 experts (``quant_method: mxfp4``), read as GGUF ``MXFP4`` blocks, exactly.

A published GPT-OSS checkpoint stores each layer's experts stacked: ``mlp.experts.gate_up_proj_blocks``
uint8 ``[experts, 2 * inter, hidden / 32, 16]`` with ``_scales`` uint8 ``[experts, 2 * inter,
hidden / 32]`` (gate and up rows interleaved), and ``down_proj_blocks``/``_scales`` likewise. A
block is 32 E2M1 codes, two a byte (the even value in the low nibble), under one E8M0 scale byte:
``w = 2 ** (s - 127) * e2m1``. GGUF's ``MXFP4`` block (17 bytes) holds the same scale byte and the
same codes in Q4_0's order (byte ``j``: value ``j`` low, value ``j + 16`` high), so moving the
nibbles gives the same weights to the bit; llama.cpp's converter does the same. Each expert's
gate, up and down rows then become ``GGUFWeight`` rows that the C++ kernels run as stored (0.53
bytes a weight, against 4 in fp32), under the per-expert names the model loads; the experts'
biases stay plain tensors (the family's ``checkpoint_tensors`` cuts them per expert).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import torch

from radixlm.runtime.layers.gguf_linear import MXFP4, GGUFWeight
from radixlm.runtime.layers.stored_weight import StoredWeight

logger = logging.getLogger(__name__)

_PACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)_blocks$")


def gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., groups * 17]`` GGUF MXFP4 rows of Hugging Face MXFP4 ``blocks``
    ``[..., groups, 16]`` and ``scales`` ``[..., groups]``."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} (blocks must be [..., groups, 16])")
    blocks = blocks.to(torch.uint8)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # the 32 values in order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.to(torch.uint8).unsqueeze(-1), packed], dim=-1).flatten(-2)


def read_stored(qconfig: dict, names: list[str], get: Callable[[str], torch.Tensor]) -> tuple[dict[str, StoredWeight], set[str]]:
    """The MXFP4 experts of a safetensors folder as GGUF MXFP4 weights, one per expert and
    projection (gate and up split out of the interleaved rows), and the tensor names read."""
    names_set = set(names)
    stored: dict[str, StoredWeight] = {}
    consumed: set[str] = set()
    for name in names:
        m = _PACKED.match(name)
        if m is None:
            continue
        prefix, proj = m.groups()
        scale_name = f"{prefix}.{proj}_scales"
        if scale_name not in names_set:
            raise ValueError(f"MXFP4 tensor {name} has no {scale_name}")
        blocks, scales = get(name), get(scale_name)
        rows = gguf_blocks(blocks, scales)  # [experts, out, row bytes]
        in_features = blocks.shape[-2] * 32
        for e in range(rows.shape[0]):
            if proj == "down_proj":
                stored[f"{prefix}.{e}.down_proj.weight"] = GGUFWeight(MXFP4, rows[e].contiguous(), in_features)
            else:  # gate and up rows interleaved: gate even, up odd
                stored[f"{prefix}.{e}.gate_proj.weight"] = GGUFWeight(MXFP4, rows[e, 0::2].contiguous(), in_features)
                stored[f"{prefix}.{e}.up_proj.weight"] = GGUFWeight(MXFP4, rows[e, 1::2].contiguous(), in_features)
        consumed |= {name, scale_name}
    logger.info("read %d MXFP4 expert weights as GGUF MXFP4 blocks", len(stored))
    return stored, consumed
