"""GPTQ and AWQ int4 safetensors checkpoints, read into int4 groups with zero points (never dequantized).

Both store ``W[n, k] = (code - zero) * scale``, codes 0..15, one fp16 scale and one 4-bit zero
per group of ``group_size`` inputs of a row (``-1``: the whole row), packed 8 to an int32:

- GPTQ (AutoGPTQ, GPTQModel, optimum): ``qweight`` int32 ``[K/8, N]`` packs 8 consecutive inputs
  of a column, the first in the low bits; ``qzeros`` int32 ``[groups, N/8]`` packs 8 consecutive
  outputs the same way; ``scales`` fp16 ``[groups, N]``; ``g_idx`` int32 ``[K]`` is each input's
  group. ``checkpoint_format`` ``gptq`` (v1, the default) stores ``zero - 1`` in ``qzeros``,
  ``gptq_v2`` the zero itself. With ``desc_act`` (act-order) the groups are scattered over the
  inputs; we sort the inputs by group and keep the permutation.
- AWQ (AutoAWQ's GEMM layout): ``qweight`` int32 ``[K, N/8]`` packs 8 consecutive outputs of an
  input in the interleaved order 0, 2, 4, 6, 1, 3, 5, 7 (the nibble at bits ``4i`` is output
  ``ORDER[i]`` of the 8); ``qzeros`` int32 ``[groups, N/8]`` the same; ``scales`` fp16 ``[groups, N]``.

In memory an ``Int4GroupWeight`` takes half a byte per weight plus 3 bytes per group. Its layer
(``Int4GroupWeight.join``): on CPUs ``Int4Linear`` (Q4_1 tiles) when every zero is 8 (symmetric:
``min = -8 * scale`` is exact in fp16), else ``GGUFLinear`` over our ``Q4_Z`` blocks (fp16 scale,
uint8 zero per 32 inputs; groups of 64 or 128 repeat theirs), both 0.625 bytes per weight; on
GPUs ``Int4GroupLinear`` (``radixlm.runtime.layers.int4_group_linear``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from radixlm.runtime.layers.stored_weight import StoredWeight, dense_linear

logger = logging.getLogger(__name__)

PACK = 8  # 4-bit codes per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds output AWQ_ORDER[i] of its 8
Q4_BLOCK = 32  # the CPU kernels' block of inputs
GPU_GROUPS = (128, 64, 32)  # the groups the Triton kernel takes (int4_zp_linear's ZP_GROUPS), largest first


@dataclass(eq=False)
class Int4GroupWeight(StoredWeight):
    """An int4 ``[out_features, in_features]`` matrix in groups with a scale and a zero point each.

    ``packed`` uint8 ``[N, K/2]`` holds the codes of stored columns ``2j`` (low nibble) and ``2j + 1``
    (high); stored column ``c`` is the model's input ``perm[c]`` (``perm`` None: the identity), and
    group ``g`` is stored columns ``g * group`` to ``(g + 1) * group``."""

    out_features: int
    in_features: int
    packed: torch.Tensor
    scale: torch.Tensor  # fp16 [N, groups]
    zero: torch.Tensor  # uint8 [N, groups]: 0..15, or 1..16 from a GPTQ v1 file
    group: int
    perm: torch.Tensor | None = None  # int64 [K]
    method: str = "gptq"

    @property
    def format(self) -> str:
        """``gptq`` or ``awq``."""
        return self.method

    def nbytes(self) -> int:
        """Codes, scales, zeros and the permutation."""
        extra = 0 if self.perm is None else self.perm.nbytes
        return self.packed.nbytes + self.scale.nbytes + self.zero.nbytes + extra

    def codes(self) -> torch.Tensor:
        """The codes, uint8 ``[N, K]`` in stored column order."""
        return torch.stack([self.packed & 0x0F, self.packed >> 4], dim=-1).reshape(self.out_features, self.in_features)

    def per_column(self, t: torch.Tensor) -> torch.Tensor:
        """A per-group ``[N, groups]`` tensor repeated over its group's stored columns: ``[N, K]``."""
        return t.repeat_interleave(self.group, dim=1)[:, : self.in_features]

    def dequantize(self) -> torch.Tensor:
        """``(code - zero) * scale`` in float32, in the model's input order."""
        w = (self.codes().float() - self.per_column(self.zero).float()) * self.per_column(self.scale).float()
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    @classmethod
    def join(cls, parts: Sequence[StoredWeight], bias: torch.Tensor | None, device: torch.device) -> nn.Module:
        """The int4 layer over the parts (see the module's docstring); dequantized where no kernel
        takes them (a group that is not a multiple of 32 on CPUs, parts with different
        permutations or groups), with a log line."""
        parts = list(parts)
        first = parts[0]
        why = _why_dense(parts, device)
        if why:
            logger.info("dequantizing %s int4 weights [%d x %d] on %s: %s", first.format, sum(p.out_features for p in parts), first.in_features, device.type, why)
            return dense_linear(parts, bias, device, torch.float32)
        if device.type != "cpu":
            return gpu_layer(parts, bias, device)
        codes = torch.cat([p.codes() for p in parts])
        scale = torch.cat([p.scale for p in parts])
        zero = torch.cat([p.zero for p in parts])
        group, perm = first.group, first.perm
        n, k = codes.shape
        scale32 = scale.repeat_interleave(group // Q4_BLOCK, dim=1)
        zero32 = zero.repeat_interleave(group // Q4_BLOCK, dim=1)
        minimum = scale32 * -8  # exact in fp16 (a power of two) unless it overflows
        inner_bias = bias if perm is None else None
        if bool((zero32 == 8).all()) and bool(torch.isfinite(minimum).all()):
            from radixlm.runtime.layers.quantized_linear import Int4Linear

            inner = Int4Linear.from_q4_1(codes.reshape(n, k // Q4_BLOCK, Q4_BLOCK), scale32, minimum, inner_bias)
        else:
            from radixlm.runtime.layers.gguf_linear import Q4_Z, GGUFLinear

            inner = GGUFLinear([(Q4_Z, q4_z_blocks(codes, scale32, zero32))], k, inner_bias)
        if perm is None:
            return inner
        from radixlm.runtime.layers.int4_group_linear import PermutedInput

        return PermutedInput(inner, perm, bias)


def gpu_layer(parts: Sequence[Int4GroupWeight], bias: torch.Tensor | None, device: torch.device) -> nn.Module:
    """The Triton layer over the parts (which share their group and permutation) on ``device``;
    a group the kernel does not take repeats its scale and zero over the largest one that divides it (exact)."""
    from radixlm.runtime.layers.int4_group_linear import Int4GroupLinear

    group = parts[0].group
    step = next(g for g in GPU_GROUPS if group % g == 0)
    codes = torch.cat([p.codes() for p in parts]).to(device)
    scale, zero = (torch.cat(ts).to(device).repeat_interleave(group // step, dim=1) for ts in ([p.scale for p in parts], [p.zero for p in parts]))
    return Int4GroupLinear(codes, scale, zero, step, parts[0].perm, bias)


def _why_dense(parts: Sequence[StoredWeight], device: torch.device) -> str | None:
    """Why no int4 kernel takes these parts (None: one does)."""
    first = parts[0]
    if any(p.group != first.group for p in parts):
        return "the parts have different group sizes"
    perms = [p.perm for p in parts]
    if any((p is None) != (first.perm is None) or (p is not None and not torch.equal(p, first.perm)) for p in perms):
        return "the parts permute their inputs differently (act-order)"
    k, group = first.in_features, first.group
    if k % group:
        return f"in_features {k} is not a multiple of the group size {group}"
    if device.type != "cpu" and not any(group % g == 0 for g in GPU_GROUPS):
        return f"the GPU int4 kernel takes groups of a multiple of 32 inputs, not {group}"
    if device.type == "cpu":
        if group % Q4_BLOCK:
            return f"the CPU int4 kernels take groups of a multiple of {Q4_BLOCK} inputs, not {group}"
        from radixlm.runtime.layers.gguf_linear import Q4_Z, kernel_types

        if any(bool((p.zero > 15).any()) for p in parts):
            return "a zero point of 16 (GPTQ v1's stored 15, plus 1) does not fit the Q4_Z blocks"
        if not all(bool((p.zero == 8).all()) for p in parts) and Q4_Z not in kernel_types():
            return "the C++ kernels for Q4_Z blocks are not built here"
    return None


def q4_z_blocks(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``codes`` uint8 ``[N, K]`` with a fp16 scale and uint8 zero per 32 inputs ``[N, K/32]`` as
    rows of ``Q4_Z`` blocks ``[N, K/32 * 20]``: d, zero, a zero byte, then 16 bytes whose byte j
    holds element j (low nibble) and j + 16 (high)."""
    n, k = codes.shape
    blocks = codes.reshape(n, k // Q4_BLOCK, Q4_BLOCK)
    nibbles = blocks[..., :16] | (blocks[..., 16:] << 4)
    d = scale.to(torch.float16).contiguous().view(torch.uint8).reshape(n, k // Q4_BLOCK, 2)
    z = zero.to(torch.uint8).reshape(n, k // Q4_BLOCK, 1)
    return torch.cat([d, z, torch.zeros_like(z), nibbles], dim=-1).reshape(n, -1).contiguous()


def pack_pairs(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, K]`` two to a byte: column ``2j`` low, ``2j + 1`` high."""
    codes = codes.to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_int32(packed: torch.Tensor, dim: int, order: Sequence[int] = tuple(range(PACK))) -> torch.Tensor:
    """The 4-bit fields of int32 ``packed``, 8 per element, spread along ``dim`` (uint8);
    the field of bits ``4i`` lands at position ``order[i]`` of its 8."""
    shifts = torch.tensor([4 * order.index(j) for j in range(PACK)], dtype=torch.int32)
    p = packed.to(torch.int32).movedim(dim, -1)
    fields = (p.unsqueeze(-1) >> shifts) & 0x0F  # [..., m, 8]
    return fields.reshape(*p.shape[:-1], -1).to(torch.uint8).movedim(-1, dim)


def _setting(qconfig: dict, *keys: str, default=None):
    for key in keys:
        if key in qconfig and qconfig[key] is not None:
            return qconfig[key]
    return default


def read_stored(qconfig: dict, names: list[str], get: Callable[[str], torch.Tensor]) -> tuple[dict[str, StoredWeight], set[str]]:
    """The GPTQ or AWQ weights of a safetensors folder, by the Hugging Face names of the dense
    weights they stand for, and the tensor names they were read from."""
    method = str(qconfig.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise ValueError(f"gptq_awq reads quant_method gptq or awq, got {method!r}")
    bits = int(_setting(qconfig, "bits", "w_bit", "wbits", default=4))
    if bits != 4:
        raise ValueError(f"{method} checkpoints with {bits}-bit weights are not supported: radixlm runs 4-bit ones")
    group = int(_setting(qconfig, "group_size", "q_group_size", default=128))
    if method == "gptq":
        fmt = str(_setting(qconfig, "checkpoint_format", "format", default="gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported: radixlm reads gptq (v1) and gptq_v2")
        read = lambda prefix: _read_gptq(prefix, names_set, get, group, v1=fmt == "gptq", sym=bool(qconfig.get("sym", True)))  # noqa: E731
    else:
        version = str(qconfig.get("version", "gemm")).lower()
        if version not in ("gemm", "exllama"):
            raise ValueError(f"AWQ version {version!r} is not supported: radixlm reads AutoAWQ's GEMM layout")
        read = lambda prefix: _read_awq(prefix, names_set, get, group)  # noqa: E731
    names_set = set(names)
    stored: dict[str, StoredWeight] = {}
    consumed: set[str] = set()
    for name in names:
        if not name.endswith(".qweight"):
            continue
        prefix = name.removesuffix(".qweight")
        stored[prefix + ".weight"] = read(prefix)
        consumed |= {f"{prefix}.{t}" for t in ("qweight", "qzeros", "scales", "g_idx")} & names_set
    logger.info("read %d %s int4 weights (group %d)", len(stored), method, group)
    return stored, consumed


def _read_gptq(prefix: str, names: set[str], get: Callable[[str], torch.Tensor], group: int, v1: bool, sym: bool) -> Int4GroupWeight:
    """One GPTQ weight."""
    qweight = get(prefix + ".qweight")
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    group = k if group <= 0 else group
    codes = unpack_int32(qweight, 0).t()  # [N, K]
    scales = get(prefix + ".scales")
    groups = scales.shape[0]
    if scales.shape[1] != n:
        raise ValueError(f"{prefix}.scales is {tuple(scales.shape)}, expected [groups, {n}]")
    if prefix + ".qzeros" in names:
        zero = unpack_int32(get(prefix + ".qzeros"), 1)[:, :n]  # [groups, N]
        zero = zero + 1 if v1 else zero
    elif sym:
        zero = torch.full((groups, n), 8, dtype=torch.uint8)
    else:
        raise ValueError(f"{prefix} has no qzeros and the config is not symmetric")
    contiguous = torch.arange(k) // group
    g_idx = get(prefix + ".g_idx").long() if prefix + ".g_idx" in names else contiguous
    perm = None
    if not torch.equal(g_idx, contiguous):
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], contiguous):
            raise ValueError(f"{prefix}.g_idx does not split the inputs into groups of {group}")
        codes = codes[:, perm]
    if groups != -(-k // group):
        raise ValueError(f"{prefix}.scales has {groups} groups, expected {-(-k // group)} for {k} inputs in groups of {group}")
    return Int4GroupWeight(n, k, pack_pairs(codes), _fp16(scales, prefix).t().contiguous(), zero.t().contiguous(), group, perm, "gptq")


def _read_awq(prefix: str, names: set[str], get: Callable[[str], torch.Tensor], group: int) -> Int4GroupWeight:
    """One AWQ (GEMM) weight."""
    qweight = get(prefix + ".qweight")
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    group = k if group <= 0 else group
    if prefix + ".qzeros" not in names:
        raise ValueError(f"{prefix} has no qzeros: radixlm reads AutoAWQ's GEMM layout, which stores them")
    codes = unpack_int32(qweight, 1, AWQ_ORDER).t()  # [N, K]
    zero = unpack_int32(get(prefix + ".qzeros"), 1, AWQ_ORDER)[:, :n]
    scales = get(prefix + ".scales")
    if scales.shape != (-(-k // group), n) or zero.shape != scales.shape:
        raise ValueError(f"{prefix}: scales {tuple(scales.shape)} and zeros {tuple(zero.shape)} do not fit {k} inputs in groups of {group} and {n} outputs")
    return Int4GroupWeight(n, k, pack_pairs(codes), _fp16(scales, prefix).t().contiguous(), zero.t().contiguous(), group, None, "awq")


def _fp16(scales: torch.Tensor, prefix: str) -> torch.Tensor:
    """The scales as fp16 (what GPTQ and AWQ store); another dtype is converted, logged."""
    if scales.dtype != torch.float16:
        logger.info("%s.scales are %s; converting them to float16", prefix, scales.dtype)
    return scales.to(torch.float16)
