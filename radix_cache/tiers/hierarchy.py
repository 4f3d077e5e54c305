"""KVTiers: the host-memory and disk tiers under the radix tree, and how KV moves between them.

::

    pool (radix tree) ──evict──▶ host tier ──evict──▶ disk tier (files, kept across restarts)
         ▲                           │  ▲                  │
         └──── promote at admission ─┘  └─ prefetch at enqueue (a reader thread)

- **Demote.** When the tree evicts a leaf, every whole block of ``block_tokens`` that ends inside
  the leaf's edge is encoded (``KVCodec``) into the host tier, unless it is there already; the
  tree then frees the slots as before. With a disk tier the block is also queued for the disk
  at once (write-through, so a server killed later still finds it); a block the host tier
  evicts goes there too if it is not on disk yet. A server that shuts down cleanly first
  demotes what its tree still holds (``KVManager.close_tiers``).
- **Prefetch.** When a request is queued, the blocks that continue its cached prefix are looked
  up in order; those only on disk are read by a background thread into the host tier. The
  scheduler leaves the request waiting (and admits others) until that read has ended, so it
  never blocks on the disk.
- **Promote.** At admission the blocks that continue the tree's match and sit in the host tier
  are written into freshly allocated pool slots and inserted into the tree; the request then
  admits with the longer prefix, as if it had been cached all along.

Blocks are named by a hash chain over the tokens (``keys.py``) whose root names the model, the
KV format and the geometry, and the tree's token keys carry the cache salt, so a tier never
serves one salt's prefix to another.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixlm.radix_cache.tiers import keys
from radixlm.radix_cache.tiers.codec import KVCodec
from radixlm.radix_cache.tiers.disk import DiskTier
from radixlm.radix_cache.tiers.host import Block, HostTier

logger = logging.getLogger(__name__)

TIERS = ("device", "host", "disk")
LOWER_TIERS = TIERS[1:]  # the tiers below the pool
DEFAULT_BLOCK_TOKENS = 16


def _per_tier(zero: float = 0):
    """A dataclass field: ``zero`` for each lower tier."""
    return field(default_factory=lambda: dict.fromkeys(LOWER_TIERS, zero))


@dataclass
class TierStats:
    """Running totals of what moved between the tiers (the engine's stats and Prometheus read these)."""

    hit_tokens: dict[str, int] = _per_tier()  # prompt tokens loaded from each tier
    promoted_blocks: dict[str, int] = _per_tier()  # into the pool (host) or host (disk)
    demoted_blocks: dict[str, int] = _per_tier()  # into each tier
    bytes_read: dict[str, int] = _per_tier()
    bytes_written: dict[str, int] = _per_tier()
    load_seconds: dict[str, float] = _per_tier(0.0)
    loads: dict[str, int] = _per_tier()


@dataclass
class Promotion:
    """What a promotion found: the blocks continuing a prefix, from ``start`` to ``end``."""

    start: int
    end: int
    blocks: list[Block]

    def tokens_from(self) -> dict[str, int]:
        """Tokens past ``start`` by the tier they were read from."""
        out = dict.fromkeys(LOWER_TIERS, 0)
        pos = self.end - sum(len(b.tokens) for b in self.blocks)
        for b in self.blocks:
            out[b.source] += pos + len(b.tokens) - max(pos, self.start)
            pos += len(b.tokens)
        return out


class KVTiers:
    """The lower tiers of one KV pool (see the module docstring)."""

    def __init__(
        self,
        codec: KVCodec,
        page_size: int,
        host_bytes: int,
        model_digest: str,
        disk_dir: str | None = None,
        disk_bytes: int = 0,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
    ) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.block_tokens = -(-block_tokens // page_size) * page_size  # whole pages
        self.codec = codec
        self.page_size = page_size
        self.root = keys.namespace(model_digest, codec.label, page_size, self.block_tokens)
        self.stats = TierStats()
        self._lock = threading.Lock()
        self.disk = None
        if disk_dir is not None:
            identity = {"model": model_digest, "format": codec.label, "page_size": page_size,
                        "block_tokens": self.block_tokens, "width": codec.width}
            self.disk = DiskTier(disk_dir, disk_bytes, identity)
        self.host = HostTier(host_bytes, spill=self._spill if self.disk is not None else None)
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="radixlm-kv-read") if self.disk is not None else None
        self._failed_once = False
        self.closing = False  # set while shutting down: disk writes wait for room instead of dropping

    # -------------------------------------------------------------- demotion
    def demote(self, path_tokens: Sequence[int], path_slots: torch.Tensor, start: int, protect_until: float = 0.0) -> None:
        """Keep the whole blocks ending within ``path_tokens[start:]`` (an evicted edge) in the host tier."""
        try:
            self._demote(path_tokens, path_slots, start, protect_until)
        except Exception:  # a tier is a cache: losing a block costs a recompute, never the engine
            if not self._failed_once:
                logger.exception("KV tiers: demoting an evicted prefix failed (logged once)")
                self._failed_once = True

    def _demote(self, path_tokens: Sequence[int], path_slots: torch.Tensor, start: int, protect_until: float) -> None:
        b = self.block_tokens
        count = len(path_tokens) // b
        first = start // b  # the block that holds position ``start`` (its head may lie in the parent)
        if count <= first:
            return
        chain = keys.chain(self.root, path_tokens, b, count)
        todo = [i for i in range(first, count) if not self.host.touch(chain[i], protect_until)]
        if not todo:
            return
        rows = self.codec.encode(torch.cat([path_slots[i * b : (i + 1) * b] for i in todo]))  # one pass over the layers
        salt = keys.salt_key(path_tokens)
        for n, i in enumerate(todo):
            block = Block(chain[i], tuple(int(t) for t in path_tokens[i * b : (i + 1) * b]), rows[n * b : (n + 1) * b].clone(),
                          protect_until=protect_until, salt=salt)
            with self._lock:
                self.stats.demoted_blocks["host"] += 1
                self.stats.bytes_written["host"] += block.nbytes
            self.host.put(block)
            if self.disk is not None:
                self._spill(block)

    def _spill(self, block: Block) -> None:
        """A block for the disk (unless it is there already)."""
        if self.disk.contains(block.key):
            return
        with self._lock:
            self.stats.demoted_blocks["disk"] += 1
        self.disk.put(block, wait=self.closing)

    # -------------------------------------------------------------- lookups
    def _keys(self, tokens: Sequence[int], start: int, max_len: int) -> tuple[int, list[bytes]]:
        """The first block that reaches past ``start`` and the keys of every whole block below ``max_len``."""
        b = self.block_tokens
        count = min(max_len, len(tokens)) // b
        return start // b, keys.chain(self.root, tokens, b, count)

    def prefetch(self, tokens: Sequence[int], start: int, max_len: int) -> concurrent.futures.Future | None:
        """Start reading the disk blocks that continue ``tokens[:start]`` into the host tier; the
        future (None: nothing to read) always ends, with the blocks read by key (pass them to
        ``find``: a small host tier may have evicted them again by then)."""
        if self.disk is None or self.disk.stopped:
            return None
        first, chain = self._keys(tokens, start, max_len)
        wanted = []
        for i in range(first, len(chain)):
            if chain[i] in self.host:
                continue
            if not self.disk.contains(chain[i]):
                break
            b = self.block_tokens
            wanted.append((chain[i], tuple(int(t) for t in tokens[i * b : (i + 1) * b])))
        if not wanted:
            return None
        return self._reader.submit(self._read_blocks, wanted, keys.salt_key(tokens))

    def _read_blocks(self, wanted: list[tuple[bytes, tuple[int, ...]]], salt: int) -> dict[bytes, Block]:
        read = {}
        for key, block_tokens in wanted:
            t0 = time.perf_counter()
            try:
                block = self.disk.read(key, block_tokens, salt)
            except Exception:
                logger.exception("KV tiers: reading a disk block failed")
                block = None
            if block is None:
                break
            with self._lock:
                self.stats.promoted_blocks["disk"] += 1
                self.stats.bytes_read["disk"] += block.nbytes
                self.stats.load_seconds["disk"] += time.perf_counter() - t0
                self.stats.loads["disk"] += 1
            self.host.put(block)
            read[key] = block
        return read

    def find(self, tokens: Sequence[int], start: int, max_len: int, staged: dict[bytes, Block] | None = None) -> Promotion | None:
        """The blocks (in the host tier, or ``staged`` by a prefetch) that continue the cached prefix
        ``tokens[:start]``, in order (None: none)."""
        first, chain = self._keys(tokens, start, max_len)
        blocks = []
        for i in range(first, len(chain)):
            block = self.host.get(chain[i]) or (staged or {}).get(chain[i])
            if block is None:
                break
            blocks.append(block)
        if not blocks:
            return None
        return Promotion(start, (first + len(blocks)) * self.block_tokens, blocks)

    def load(self, found: Promotion, slots: torch.Tensor) -> None:
        """Write ``found``'s KV past its ``start`` into ``slots`` (one slot a token, in order)."""
        t0 = time.perf_counter()
        block_start = found.end - len(found.blocks) * self.block_tokens
        skip = found.start - block_start  # the head of the first block the tree already holds
        rows = torch.cat([b.rows for b in found.blocks])[skip:]
        self.codec.decode(slots, rows)
        with self._lock:
            for tier, n in found.tokens_from().items():
                self.stats.hit_tokens[tier] += n
            self.stats.promoted_blocks["host"] += len(found.blocks)
            self.stats.bytes_read["host"] += rows.numel()
            self.stats.load_seconds["host"] += time.perf_counter() - t0
            self.stats.loads["host"] += 1

    # ----------------------------------------------------------- the rest
    def clear_host(self) -> None:
        """Drop the host tier (a cache flush); the disk tier's files stay."""
        self.host.clear()

    def snapshot(self) -> dict:
        """Sizes, budgets and running totals of every tier, JSON-ready."""
        with self._lock:
            s = self.stats
            out = {
                "block_tokens": self.block_tokens,
                "format": self.codec.label,
                "host": {"blocks": len(self.host), "bytes": self.host.used, "capacity": self.host.capacity},
                "hit_tokens": dict(s.hit_tokens), "promoted_blocks": dict(s.promoted_blocks),
                "demoted_blocks": dict(s.demoted_blocks), "bytes_read": dict(s.bytes_read),
                "bytes_written": dict(s.bytes_written), "load_seconds": dict(s.load_seconds), "loads": dict(s.loads),
            }
        if self.disk is not None:
            d = self.disk
            out["disk"] = {"blocks": len(d), "bytes": d.used, "capacity": d.capacity, "stopped": d.stopped,
                           "rejected": d.rejected, "dropped": d.dropped}
            out["bytes_written"]["disk"] = d.bytes_written
        return out

    def check(self) -> None:
        """Raise AssertionError if a tier's own accounting is off."""
        self.host.check()
        if self.disk is not None:
            self.disk.check()

    def close(self) -> None:
        """Finish queued disk writes and stop the background threads."""
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=False)
        if self.disk is not None:
            self.disk.close()
