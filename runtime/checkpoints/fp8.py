"""FP8 safetensors checkpoints, read into float8 (e4m3) weights with their scales (never dequantized).

Two configs store ``W = float(weight) * scale`` with ``weight`` ``float8_e4m3fn`` ``[N, K]``:

- ``quant_method: fp8`` (AutoFP8, transformers' fine-grained FP8, DeepSeek-V3 and Qwen3 FP8):
  with ``weight_block_size: [bn, bk]`` a fp32 ``weight_scale_inv`` ``[ceil(N/bn), ceil(K/bk)]`` per
  block (multiplied, despite its name); without it a per-tensor ``weight_scale``.
- ``quant_method: compressed-tensors`` (llm-compressor) in its ``float-quantized`` format: each
  config group's ``weights`` (8-bit ``float``) names a ``strategy``: ``tensor`` (one scale),
  ``channel`` (``[N, 1]``) or ``block`` (``block_structure``, ``[ceil(N/bn), ceil(K/bk)]``), all in
  ``weight_scale``; modules in ``ignore`` (lm_head ...) are stored dense.

Activation scales (``input_scale``; static or dynamic schemes) are read and left: we multiply
weights only, and activations stay in the model's dtype. In memory an ``FP8Weight`` takes one byte
per weight plus 4 bytes per scale; its layer is ``FP8Linear`` (``radixlm.runtime.layers.fp8_linear``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from radixlm.runtime.layers.stored_weight import StoredWeight, dense_linear

logger = logging.getLogger(__name__)

SCALE_NAMES = ("weight_scale_inv", "weight_scale")  # the first present is the weight's scale
ACTIVATION_NAMES = ("input_scale", "input_scale_inv", "input_zero_point", "output_scale", "k_scale", "v_scale")


@dataclass(eq=False)
class FP8Weight(StoredWeight):
    """A ``[out_features, in_features]`` matrix of float8 e4m3 values with a per-tensor,
    per-channel or per-block float32 scale: ``W = float(weight) * scale``."""

    out_features: int
    in_features: int
    weight: torch.Tensor  # uint8 [N, K]: float8_e4m3fn bits
    scale: torch.Tensor  # float32 [1], [N], or [ceil(N/bn), ceil(K/bk)]
    block: tuple[int, int] | None = None
    method: str = "fp8"

    @property
    def format(self) -> str:
        """``fp8`` or ``compressed-tensors``, with the scales' granularity (``fp8:block``)."""
        return f"{self.method}:{self.granularity}"

    @property
    def granularity(self) -> str:
        """``tensor``, ``channel`` or ``block``."""
        if self.block is not None:
            return "block"
        return "tensor" if self.scale.numel() == 1 else "channel"

    def nbytes(self) -> int:
        """The float8 bytes and the scales'."""
        return self.weight.nbytes + self.scale.nbytes

    def row_scale(self) -> torch.Tensor:
        """The scale as float32 ``[N]`` per output row (not for block scales)."""
        return self.scale.reshape(-1).expand(self.out_features).contiguous() if self.scale.numel() == 1 else self.scale.reshape(-1)

    def take_rows(self, order: torch.Tensor) -> FP8Weight | None:
        """The float8 rows in ``order`` with their scales (a per-channel scale moves with its row);
        under block scales only where every row stays in its block of rows (None otherwise)."""
        if self.block is not None:
            bn = self.block[0]
            if not torch.equal(order // bn, torch.arange(len(order)) // bn):
                return None
            scale = self.scale
        else:
            scale = self.scale if self.scale.numel() == 1 else self.scale.reshape(-1)[order]
        return FP8Weight(self.out_features, self.in_features, self.weight[order], scale, self.block, self.method)

    def dequantize(self) -> torch.Tensor:
        """``float(weight) * scale`` in float32."""
        w = self.weight.view(torch.float8_e4m3fn).float()
        if self.block is not None:
            bn, bk = self.block
            s = self.scale.repeat_interleave(bn, 0)[: self.out_features].repeat_interleave(bk, 1)[:, : self.in_features]
            return w * s
        return w * self.row_scale()[:, None]

    @classmethod
    def join(cls, parts: Sequence[StoredWeight], bias: torch.Tensor | None, device: torch.device) -> nn.Module:
        """One ``FP8Linear`` over the parts stacked: block scales stacked (every part but the last a
        whole number of row blocks), per-tensor and per-channel scales as one per row; parts that
        cannot share one scale layout are dequantized (logged)."""
        from radixlm.runtime.layers.fp8_linear import FP8Linear

        parts = list(parts)
        block = parts[0].block
        if all(p.block == block for p in parts) and (block is None or all(p.out_features % block[0] == 0 for p in parts[:-1])):
            return FP8Linear.concat([(p.weight.to(device), p.scale.to(device)) for p in parts], block, bias)
        logger.info("dequantizing FP8 parts whose scales do not stack (%s)", ", ".join(f"{p.out_features} rows, block {p.block}" for p in parts))
        return dense_linear(parts, bias, device, torch.float32)


def _weights_config(qconfig: dict) -> tuple[str, list[tuple[int, int]], bool]:
    """``(method, block shapes in use, whether activations were quantized)`` of an FP8 config;
    ValueError for one whose weights are not float8."""
    method = str(qconfig.get("quant_method", "")).lower()
    if method == "fp8":
        fmt = str(qconfig.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"fp8 checkpoints in format {fmt!r} are not supported: radixlm reads e4m3")
        block = qconfig.get("weight_block_size")
        return method, [tuple(block)] if block else [], qconfig.get("activation_scheme") is not None
    if method != "compressed-tensors":
        raise ValueError(f"fp8 reads quant_method fp8 or compressed-tensors, got {method!r}")
    fmt = str(qconfig.get("format", "float-quantized")).lower()
    if fmt not in ("float-quantized", "naive-quantized", "mixed-precision"):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported: radixlm reads float8 weights (float-quantized); int4 pack-quantized and int8 weights are not")
    blocks, activations = [], False
    for name, group in (qconfig.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if not weights:
            continue
        kind, bits, strategy = str(weights.get("type", "")).lower(), int(weights.get("num_bits", 0)), str(weights.get("strategy", "")).lower()
        if kind != "float" or bits != 8:
            raise ValueError(f"compressed-tensors group {name!r} quantizes weights to {bits}-bit {kind}: radixlm reads 8-bit float weights only")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors group {name!r}: weight strategy {strategy!r} is not supported (tensor, channel, block are)")
        if weights.get("symmetric") is False:
            raise ValueError(f"compressed-tensors group {name!r}: asymmetric float8 weights are not supported")
        if strategy == "block":
            structure = weights.get("block_structure")
            if not structure or len(structure) != 2:
                raise ValueError(f"compressed-tensors group {name!r}: block strategy without a [rows, cols] block_structure")
            blocks.append(tuple(int(b) for b in structure))
        activations = activations or bool(group.get("input_activations"))
    return method, blocks, activations


def read_stored(qconfig: dict, names: list[str], get: Callable[[str], torch.Tensor]) -> tuple[dict[str, StoredWeight], set[str]]:
    """The FP8 weights of a safetensors folder, by their Hugging Face names, and the tensor names
    they (and their activation scales) were read from."""
    method, blocks, activations = _weights_config(qconfig)
    names_set = set(names)
    stored: dict[str, StoredWeight] = {}
    consumed: set[str] = set()
    for name in names:
        if not name.endswith(".weight"):
            continue
        prefix = name.removesuffix(".weight")
        scale_name = next((f"{prefix}.{s}" for s in SCALE_NAMES if f"{prefix}.{s}" in names_set), None)
        if scale_name is None:
            continue
        stored[name] = _read_one(name, get(name), get(scale_name).float(), blocks, method)
        consumed |= {name, scale_name} | ({f"{prefix}.{a}" for a in ACTIVATION_NAMES} & names_set)
    if activations:
        logger.info("the checkpoint quantizes activations too; radixlm multiplies its FP8 weights with activations in the model's dtype")
    logger.info("read %d %s float8 weights", len(stored), method)
    return stored, consumed


def _read_one(name: str, weight: torch.Tensor, scale: torch.Tensor, blocks: list[tuple[int, int]], method: str) -> FP8Weight:
    """One weight and its scale, the scale's granularity told by its shape."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"{name} is {weight.dtype} {tuple(weight.shape)}: radixlm reads 2-D float8_e4m3fn FP8 weights")
    n, k = weight.shape
    bits = weight.view(torch.uint8)
    for bn, bk in blocks:
        if scale.dim() == 2 and tuple(scale.shape) == (-(-n // bn), -(-k // bk)):
            return FP8Weight(n, k, bits, scale.contiguous(), (bn, bk), method)
    if scale.numel() == 1:
        return FP8Weight(n, k, bits, scale.reshape(1), None, method)
    if scale.numel() == n and (scale.dim() == 1 or scale.shape[-1] == 1):
        return FP8Weight(n, k, bits, scale.reshape(n).contiguous(), None, method)
    raise ValueError(f"{name}'s scale {tuple(scale.shape)} is neither per tensor, per channel nor per block of {blocks or 'no block size in the config'} for a {n}x{k} weight")
