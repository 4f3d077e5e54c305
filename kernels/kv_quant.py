"""KV-cache storage formats: full-precision dtypes, and 8-bit ones with a scale per (token, KV head).

An 8-bit format stores each token's key (and value) of one KV head as ``D`` 8-bit numbers and
one fp16 scale, symmetric around zero: ``x ≈ value * scale`` with ``scale = max|x| / QMAX``.
The scale is chosen per (token, head) so that an outlier in one head or token never costs the
others their precision, and it is computed once, when the token's KV is written: cached
entries are never re-quantized. Scales are fp16 rather than fp32 because they are part of every
token's bytes (``D + 2`` per head instead of ``D + 4``) and fp16 keeps them to 0.05 % relative
error, far under the 8-bit values' own.

- ``int8``: values rounded to integers in [-127, 127].
- ``fp8_e4m3`` / ``fp8_e5m2``: torch's float8 dtypes (3 or 2 mantissa bits), the value range
  mapped onto [-448, 448] or [-57344, 57344].

The pools keep these dtypes, but PyTorch's CPU indexing ops do not take float8 tensors, so
gathers and writes go through a ``uint8`` view of the same bytes (``as_bytes``). ``PoolLayer``
is one layer of a pool as the attention paths take it, and reads rows of it in any format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")
SCALE_DTYPE = torch.float16
_SCALE_MIN = 2.0**-24  # the smallest fp16 step: an all-zero head gets a finite, nonzero scale
_SCALE_MAX = 65504.0


@dataclass(frozen=True)
class KVFormat:
    """How a KV pool stores keys and values: the storage dtype, and whether it carries scales."""

    name: str  # the resolved --kv-cache-dtype: float32, bfloat16, float16, int8, fp8_e4m3, fp8_e5m2
    dtype: torch.dtype  # what the pool's K and V tensors hold
    qmax: float = 0.0  # largest stored magnitude of a scaled format (0: not scaled)

    @property
    def scaled(self) -> bool:
        """True for the 8-bit formats, whose values need their per-(token, head) scale."""
        return self.qmax > 0

    def bytes_per_head(self, head_dim: int) -> int:
        """Bytes of one token's key (or value) in one KV head, its scale included."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return head_dim * itemsize + (SCALE_DTYPE.itemsize if self.scaled else 0)


_FORMATS = {
    "float32": KVFormat("float32", torch.float32),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16),
    "float16": KVFormat("float16", torch.float16),
    "int8": KVFormat("int8", torch.int8, 127.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0),
}


def resolve_kv_format(kv_cache_dtype: str | KVFormat, model_dtype: torch.dtype) -> KVFormat:
    """The format named by ``--kv-cache-dtype`` (``auto``: the model's own dtype, unscaled)."""
    if isinstance(kv_cache_dtype, KVFormat):
        return kv_cache_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return format_of(model_dtype)
    return _FORMATS[kv_cache_dtype]


def format_of(dtype: torch.dtype) -> KVFormat:
    """The format whose storage dtype is ``dtype``."""
    for fmt in _FORMATS.values():
        if fmt.dtype == dtype:
            return fmt
    raise ValueError(f"no KV format stores {dtype}")


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` ``[..., D]`` in ``fmt``: ``(values [..., D], scales [...] fp16)``; scales None when unscaled."""
    if not fmt.scaled:
        return x.to(fmt.dtype), None
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = (amax / fmt.qmax).clamp(_SCALE_MIN, _SCALE_MAX).to(SCALE_DTYPE)
    # fp16 may round the scale down (in its subnormal range, by up to half): step it up where it
    # did, so the largest magnitude still fits and nothing is clipped.
    scale = torch.where(scale.float() * fmt.qmax < amax, torch.nextafter(scale, torch.full_like(scale, _SCALE_MAX)), scale)
    y = xf / scale.float().unsqueeze(-1)  # divide by the stored (rounded) scale: dequantizing undoes exactly this
    if fmt.dtype == torch.int8:
        return y.round_().clamp_(-fmt.qmax, fmt.qmax).to(torch.int8), scale
    return y.clamp_(-fmt.qmax, fmt.qmax).to(fmt.dtype), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``values`` ``[..., D]`` (and their scales ``[...]``) back to ``dtype``."""
    if scales is None:
        return values.to(dtype)
    return (values.float() * scales.float().unsqueeze(-1)).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A ``uint8`` view of a float8 tensor (for indexing ops CPUs lack for float8); others as they are."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t.index_select(0, index)`` for any pool dtype, float8 included."""
    return as_bytes(t).index_select(0, index).view(t.dtype)


def dequantize_rows(
    values: torch.Tensor, scales: torch.Tensor | None, index: torch.Tensor | slice, dtype: torch.dtype
) -> torch.Tensor:
    """Rows ``index`` (a slot tensor or a slice) of a pool tensor and its scales, in ``dtype``."""
    if isinstance(index, slice):
        return dequantize(values[index], None if scales is None else scales[index], dtype)
    return dequantize(gather(values, index), None if scales is None else scales.index_select(0, index), dtype)


def values_in_keys(k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when ``v`` is the first columns of ``k``'s rows (a latent pool's values): reading keys reads values."""
    return v.data_ptr() == k.data_ptr() and v.stride() == k.stride() and v.shape[:-1] == k.shape[:-1]


@dataclass
class PoolLayer:
    """One layer's K and V pool tensors and, for an 8-bit pool, their per-(slot, head) scales.

    In a latent pool ``v`` is a view of ``k``'s first columns (and shares its scales): a read
    gathers each row once and returns the values as a view of the keys it read."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def read(self, index: torch.Tensor | slice, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``index`` (slots or a slice of them) in ``dtype``: a view when nothing converts."""
        if isinstance(index, slice) and self.k.dtype == dtype:
            return self.k[index], self.v[index]
        keys = dequantize_rows(self.k, self.k_scale, index, dtype)
        if values_in_keys(self.k, self.v):
            return keys, keys[..., : self.v.shape[-1]]
        return keys, dequantize_rows(self.v, self.v_scale, index, dtype)
