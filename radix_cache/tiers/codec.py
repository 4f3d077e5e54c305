"""How the lower tiers store a block of KV: the pool's own bytes, or an 8-bit copy of a wider pool.

A block is ``n`` tokens of one pool as one ``uint8 [n, width]`` tensor (one row a token, every
layer's keys and values side by side, scales included), so a tier holds, moves and writes it
as plain bytes:

- ``exact``: the pool's rows as they are (``KVPool.gather_tokens``). Loading it back gives the
  same bytes, so a request that resumes from it computes exactly what a cold one does. An
  8-bit pool (``--kv-cache-dtype int8`` or fp8) is stored this way: already compact.
- ``int8``: each token's key and value of each KV head quantized to int8 with one fp16 scale
  (``kernels/kv_quant.py``), from an fp32, bf16 or fp16 pool: about a quarter of an fp32
  pool's bytes and half a 16-bit one's. Lossy, as ``--kv-cache-dtype int8`` is: a request
  resumed from it reads keys and values within 8-bit rounding of what it would have computed.
"""

from __future__ import annotations

import torch

from radixlm.kernels.kv_quant import SCALE_DTYPE, dequantize, quantize, resolve_kv_format
from radixlm.radix_cache.pool import KVPool

CODECS = ("auto", "exact", "int8")
_INT8 = resolve_kv_format("int8", torch.float32)


class KVCodec:
    """Turns a pool's slots into a tier's byte rows and back (``exact`` or ``int8``, see the module)."""

    def __init__(self, pool: KVPool, name: str = "auto") -> None:
        if name not in CODECS:
            raise ValueError(f"kv tier format must be one of {', '.join(CODECS)}, got {name!r}")
        if name == "auto":  # compact on the CPU, where the tier and the pool share one memory
            name = "exact" if pool.format.scaled or pool.device.type != "cpu" else "int8"
        if name == "int8" and pool.format.scaled:
            name = "exact"  # an 8-bit pool is already compact: never quantize twice
        self.pool = pool
        self.name = name
        kinds = 1 if pool.latent else 2
        head = pool.num_kv_heads
        self._head_bytes = pool.head_dim + SCALE_DTYPE.itemsize  # one head of one token in int8, its scale after
        self.width = pool.token_bytes() if name == "exact" else pool.num_layers * kinds * head * self._head_bytes

    @property
    def label(self) -> str:
        """What a block's bytes mean: the codec and the pool format it came from (written in disk headers)."""
        return f"{self.name}:{self.pool.format.name}"

    def encode(self, slots: torch.Tensor) -> torch.Tensor:
        """The KV of ``slots`` as ``uint8 [len(slots), width]`` on the CPU."""
        pool = self.pool
        if self.name == "exact":
            return pool.gather_tokens(slots).cpu()
        parts = []
        for layer in range(pool.num_layers):
            tensors = (pool.k[layer],) if pool.latent else (pool.k[layer], pool.v[layer])
            for t in tensors:
                q, s = quantize(t.index_select(0, slots), _INT8)
                parts.append(q.view(torch.uint8).reshape(len(slots), -1))
                parts.append(s.view(torch.uint8).reshape(len(slots), -1))
        return torch.cat(parts, dim=1).cpu()

    def decode(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write rows from ``encode`` (of a pool with this layout) into the pool at ``slots``."""
        if rows.dtype != torch.uint8 or rows.shape != (len(slots), self.width):
            raise ValueError(f"KV block rows must be uint8 [{len(slots)}, {self.width}], got {rows.dtype} {list(rows.shape)}")
        pool = self.pool
        rows = rows.to(pool.device)
        if self.name == "exact":
            pool.scatter_tokens(slots, rows)
            return
        n, heads, dim = len(slots), pool.num_kv_heads, pool.head_dim
        col = 0
        for layer in range(pool.num_layers):
            tensors = (pool.k[layer],) if pool.latent else (pool.k[layer], pool.v[layer])
            for t in tensors:
                q = rows[:, col : col + heads * dim].contiguous().view(torch.int8).reshape(n, heads, dim)
                col += heads * dim
                s = rows[:, col : col + heads * SCALE_DTYPE.itemsize].contiguous().view(SCALE_DTYPE).reshape(n, heads)
                col += heads * SCALE_DTYPE.itemsize
                t.index_copy_(0, slots, dequantize(q, s, t.dtype))
