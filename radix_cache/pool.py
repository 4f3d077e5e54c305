"""The KV pool: per-layer key/value tensors indexed by token slot, and a page allocator.

A *slot* holds the key and value of one token in every layer. Slots are grouped into pages of
``page_size`` consecutive slots; the allocator hands out whole pages so that a request's tokens
``[k * page_size, (k + 1) * page_size)`` always live in one page.

The pool stores K and V in a ``KVFormat`` (``radixlm.kernels.kv_quant``): the model's dtype, a
16-bit one, or an 8-bit one whose per-(token, head) scales live in slot-indexed tensors beside
the values, so whatever owns a slot (a request, the radix tree) owns its scales too.

A *latent* pool (``latent_dim`` set: DeepSeek's multi-head latent attention) stores one row per
token and layer and no separate values: the row is the compressed latent ``c_kv`` followed by the
rotated RoPE key, read as the key of one shared KV head, and the values are the row's first
``latent_dim`` columns (a view of the keys, with the keys' scales)::

    k[layer][slot, 0] = [ c_kv (latent_dim) | k_pe (head_dim - latent_dim) ]
    v[layer][slot, 0] = [ c_kv (latent_dim) ]                 (the same bytes, not a copy)
"""

from __future__ import annotations

import torch

from radixlm.kernels.cpu_ext import cpu_kernels
from radixlm.kernels.kv_quant import KVFormat, PoolLayer, as_bytes, quantize, resolve_kv_format

PAD_SLOT = 0  # the slot padded (masked) positions read from


class KVPool:
    """Per-layer K and V tensors ``[num_slots, num_kv_heads, head_dim]`` (and ``[num_slots, num_kv_heads]`` scales);
    with ``latent_dim``, V is the first ``latent_dim`` columns of K (a latent pool, see the module docstring)."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_format: KVFormat | str = "auto",
        latent_dim: int | None = None,
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        if latent_dim is not None and not 0 < latent_dim <= head_dim:
            raise ValueError(f"latent_dim must be in 1..{head_dim} (head_dim), got {latent_dim}")
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.latent_dim = latent_dim
        self.format = resolve_kv_format(kv_format, dtype)
        self.dtype = self.format.dtype  # what K and V are stored as
        self.device = torch.device(device)
        shape = (num_slots, num_kv_heads, head_dim)
        # Uninitialized, so untouched slots cost no memory; only slot 0 is zeroed because
        # padded reads (masked out, but multiplied) are pointed at it and must stay finite.
        self.k = [torch.empty(shape, dtype=self.dtype, device=device) for _ in range(num_layers)]
        self.k_scale: list[torch.Tensor | None] = [None] * num_layers
        if self.format.scaled:
            self.k_scale = [torch.empty(shape[:2], dtype=torch.float16, device=device) for _ in range(num_layers)]
        if latent_dim is None:
            self.v = [torch.empty(shape, dtype=self.dtype, device=device) for _ in range(num_layers)]
            self.v_scale = [None if s is None else torch.empty_like(s) for s in self.k_scale]
        else:  # the values are the keys' first columns, quantized with the keys' row scale
            self.v = [k[..., :latent_dim] for k in self.k]
            self.v_scale = list(self.k_scale)
        for t in self.k + self.v:
            as_bytes(t)[PAD_SLOT].zero_()
        for t in self.k_scale + self.v_scale:
            if t is not None:
                t[PAD_SLOT].zero_()

    @property
    def latent(self) -> bool:
        """True for a latent pool, whose values are a view of its keys."""
        return self.latent_dim is not None

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Store the keys and values of new tokens at ``slots`` in one layer (quantized once, here);
        a latent pool stores ``k`` alone (its values are ``k``'s first ``latent_dim`` columns) and ignores ``v``."""
        ext = cpu_kernels() if self.format.scaled and self.device.type == "cpu" else None
        stores = ((self.k, self.k_scale, k),) if self.latent else ((self.k, self.k_scale, k), (self.v, self.v_scale, v))
        for values, scales, x in stores:
            if ext is not None:  # one fused pass instead of a dozen tensor ops per layer and step
                ext.quantize_into(x, slots, values[layer], scales[layer], self.format.qmax)
                continue
            q, s = quantize(x, self.format)
            as_bytes(values[layer]).index_copy_(0, slots, as_bytes(q))
            if s is not None:
                scales[layer].index_copy_(0, slots, s)

    def read(self, layer: int, slots: torch.Tensor | slice, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values at ``slots`` of one layer, dequantized to ``dtype``."""
        return self.layer(layer).read(slots, dtype)

    def layer(self, layer: int) -> PoolLayer:
        """One layer's K and V tensors and their scales, as the attention kernels take them."""
        return PoolLayer(self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer])

    def _stored(self) -> list[torch.Tensor]:
        """Every tensor the pool holds (values, then scales, layer by layer), a latent pool's value views left out."""
        kinds = (self.k, self.k_scale) if self.latent else (self.k, self.v, self.k_scale, self.v_scale)
        return [t for layer in range(self.num_layers) for t in (kind[layer] for kind in kinds) if t is not None]

    def _token_parts(self) -> list[torch.Tensor]:
        """Every slot-indexed tensor (values, then scales, layer by layer) as a uint8 view."""
        return [t.view(torch.uint8).reshape(self.num_slots, -1) for t in self._stored()]

    def token_bytes(self) -> int:
        """Bytes of one slot across all layers, scales included (a row of ``gather_tokens``)."""
        return sum(t.shape[1] for t in self._token_parts())

    def gather_tokens(self, slots: torch.Tensor) -> torch.Tensor:
        """The raw bytes of ``slots`` in every layer: uint8 ``[len(slots), token_bytes]`` (for KV transfer)."""
        parts = self._token_parts()
        if slots.numel() == 0:
            return torch.empty((0, sum(t.shape[1] for t in parts)), dtype=torch.uint8, device=self.device)
        return torch.cat([t.index_select(0, slots) for t in parts], dim=1)

    def scatter_tokens(self, slots: torch.Tensor, data: torch.Tensor) -> None:
        """Write rows of ``gather_tokens`` (from a pool of the same layout) into ``slots``."""
        parts = self._token_parts()
        width = sum(t.shape[1] for t in parts)
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape != (len(slots), width):
            raise ValueError(f"KV rows must be uint8 [{len(slots)}, {width}], got {data.dtype} {list(data.shape)}")
        col = 0
        for t in parts:
            t.index_copy_(0, slots, data[:, col : col + t.shape[1]])
            col += t.shape[1]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_format: KVFormat | str = "auto", latent_dim: int | None = None
    ) -> int:
        """Bytes that one token's KV takes across all layers, scales included (a latent pool: its one row a layer)."""
        rows = 1 if latent_dim is not None else 2
        return rows * num_layers * num_kv_heads * resolve_kv_format(kv_format, dtype).bytes_per_head(head_dim)

    def nbytes(self) -> int:
        """Total bytes held by the pool's tensors."""
        return sum(t.numel() * t.element_size() for t in self._stored())


class SlotAllocator:
    """Hands out and takes back whole pages of KV slots.

    Free pages are kept sorted lazily: freed pages go to a release list that is merged and sorted
    only when the free list runs short, so consecutive allocations tend to get contiguous slots.
    """

    def __init__(self, num_slots: int, page_size: int = 1, device: torch.device | str = "cpu") -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if num_slots % page_size:
            raise ValueError(f"num_slots ({num_slots}) must be a multiple of page_size ({page_size})")
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.device = torch.device(device)
        self._free = torch.arange(self.num_pages, dtype=torch.int64, device=self.device)
        self._released: list[torch.Tensor] = []
        self._num_released = 0

    def available_pages(self) -> int:
        """Pages that can be allocated right now."""
        return len(self._free) + self._num_released

    def available_slots(self) -> int:
        """Slots that can be allocated right now (always whole pages)."""
        return self.available_pages() * self.page_size

    def _merge_released(self) -> None:
        if self._released:
            self._free = torch.sort(torch.cat([self._free, *self._released])).values
            self._released = []
            self._num_released = 0

    def alloc_pages(self, num_pages: int) -> torch.Tensor | None:
        """Take ``num_pages`` free pages (their page ids), or None when too few are free."""
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if num_pages > len(self._free):
            if num_pages > self.available_pages():
                return None
            self._merge_released()
        pages, self._free = self._free[:num_pages], self._free[num_pages:]
        return pages

    def alloc_slots(self, num_slots: int) -> torch.Tensor | None:
        """Take enough whole pages for ``num_slots`` tokens and return all their slots."""
        num_pages = -(-num_slots // self.page_size)
        pages = self.alloc_pages(num_pages)
        if pages is None:
            return None
        return self.page_slots(pages)

    def page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """All slots of the given pages, page by page."""
        if self.page_size == 1:
            return pages
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=pages.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def free_slots(self, slots: torch.Tensor) -> None:
        """Return the pages that ``slots`` cover (each slot's whole page) to the free list."""
        if slots.numel() == 0:
            return
        if self.page_size == 1:
            pages = slots.to(torch.int64)
        else:
            pages = torch.unique(slots.to(torch.int64) // self.page_size)
        self._released.append(pages)
        self._num_released += len(pages)

    def free_page_ids(self) -> torch.Tensor:
        """Every free page id (sorted); for integrity checks."""
        self._merge_released()
        return self._free.clone()
