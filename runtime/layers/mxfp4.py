"""MXFP4 (OCP microscaling FP4), as GPT-OSS checkpoints store their experts' weights: their values.

Each row is cut into blocks of 32 values; a block is 16 bytes of FP4 (E2M1) codes, two a byte
(the low nibble first), and one shared power-of-two scale byte (E8M0: ``2 ** (s - 127)``).
On CPUs the experts run as stored (``radixlm.runtime.checkpoints.mxfp4`` moves the blocks into
GGUF's MXFP4 layout for the C++ kernels); this dequantization serves ``--quantization none``,
GPUs, and the stacked tensors a family's ``checkpoint_tensors`` meets outside a quantized folder.
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., groups * 32]`` values of uint8 ``blocks`` ``[..., groups, 16]`` and their
    uint8 ``scales`` ``[..., groups]``."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} (blocks must be [..., groups, 16])")
    blocks = blocks.to(torch.uint8)
    lut = torch.tensor(E2M1, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2)
