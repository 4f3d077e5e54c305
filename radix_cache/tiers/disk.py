"""The disk tier: one file per KV block, written in the background, found again after a restart.

A file is ``MAGIC``, a 4-byte header length, a JSON header, then the block's rows::

    {"model": ..., "format": "int8:float32", "page_size": 1, "block_tokens": 32, "width": 1152,
     "salt": 0, "key": "<hex>", "tokens": [...], "bytes": 36864, "sha256": "<hex>"}

Files are written to a temporary name and renamed, so a reader (this server, another replica
sharing the folder, a server restarted after SIGKILL) sees a whole file or none. An entry is
loaded only when its header names this model, KV format and geometry, its tokens and cache salt
are the ones asked for, and its rows' checksum holds; any other file it comes across (another
model or dtype, truncated, corrupt) is removed. The tier keeps its files within a byte budget,
least recently used removed first (blocks under a retention hint last). When the disk fails
(full, read-only, gone), the tier stops with one log line and serving goes on without it.

KV reveals the prompts it was computed from, and a planted file would feed any prompt made-up
KV: the folder is created mode 700 and the files mode 600, and a folder another user owns or
may write to is refused (the tier stops).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import torch

from radixlm.radix_cache.tiers.host import Block

logger = logging.getLogger(__name__)

MAGIC = b"RADIXLM-KV-1\n"
SUFFIX = ".kvb"
STALE_TMP_S = 600.0  # a temporary file older than this was left by a writer that died
_QUEUE_BLOCKS = 256  # blocks waiting to be written; more are dropped (the disk is behind)


class DiskTier:
    """KV blocks as files in one folder (see the module docstring)."""

    def __init__(self, directory: str | Path, capacity_bytes: int, identity: dict) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be > 0 bytes, got {capacity_bytes}")
        self.dir = Path(directory)
        self.capacity = capacity_bytes
        self.identity = dict(identity)  # model, format, page_size, block_tokens, width
        self.stopped: str | None = None  # why the tier stopped, once it has
        self.rejected = self.dropped = 0  # files removed for failing a check; blocks dropped with the writer behind
        self.bytes_written = 0
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, oldest first
        self._used = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=_QUEUE_BLOCKS)
        self._pending: set[bytes] = set()  # keys queued, not yet written
        self._hints: dict[bytes, float] = {}  # retention hints (time.monotonic()) of blocks written here, kept last
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = self.dir.stat()
            if st.st_uid != os.getuid() or st.st_mode & 0o022:
                self._stop(f"{self.dir} is not this user's alone (owner uid {st.st_uid}, mode {st.st_mode & 0o777:o}): "
                           "whoever may write there could plant KV for any prompt; make it this user's, mode 700")
            else:
                self._scan()
        except OSError as exc:
            self._stop(f"cannot use {self.dir}: {exc}")
        self._writer = threading.Thread(target=self._write_loop, name="radixlm-kv-disk", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------ the index
    def path(self, key: bytes) -> Path:
        """The file of block ``key``."""
        return self.dir / (key.hex() + SUFFIX)

    @property
    def used(self) -> int:
        """Bytes of this tier's files (as this server knows them)."""
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def _scan(self) -> None:
        """Index the folder's entries of this identity (oldest first); remove foreign or broken ones."""
        found = []
        now = time.time()
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.startswith(".tmp-"):
                if now - entry.stat().st_mtime > STALE_TMP_S:
                    _unlink(entry.path)
                continue
            if not name.endswith(SUFFIX):
                continue
            header, size = _read_header(entry.path)
            problem = self._mismatch(header, size, name)
            if problem:
                logger.info("KV disk tier: removing %s (%s)", name, problem)
                self.rejected += 1
                _unlink(entry.path)
                continue
            found.append((entry.stat().st_mtime, bytes.fromhex(name[: -len(SUFFIX)]), size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._used += size
        self._trim()

    def _mismatch(self, header: dict | None, size: int, name: str) -> str | None:
        """Why a file's header does not describe a block this server may load (None: it does)."""
        if header is None:
            return "not a KV block file, or a truncated one"
        for field, want in self.identity.items():
            if header.get(field) != want:
                return f"{field} is {header.get(field)!r}, this server's is {want!r}"
        if header.get("key", "") + SUFFIX != name:
            return "its header names another block"
        if size != header["_offset"] + header.get("bytes", -1):
            return f"truncated: {size} bytes where the header promises {header['_offset'] + header.get('bytes', 0)}"
        return None

    def contains(self, key: bytes) -> bool:
        """True when block ``key`` may be on disk (in the index, or written by another replica)."""
        if self.stopped:
            return False
        return key in self._index or self.path(key).exists()

    # ---------------------------------------------------------------- read
    def read(self, key: bytes, tokens: tuple[int, ...], salt: int) -> Block | None:
        """Block ``key`` if its file is whole, of this identity and holds ``tokens`` of ``salt``; None
        otherwise (a file that fails a check is removed)."""
        if self.stopped:
            return None
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as exc:
            logger.warning("KV disk tier: reading %s failed: %s", path.name, exc)
            return None
        header, size = _parse_header(data), len(data)
        problem = self._mismatch(header, size, path.name)
        if problem is None and (tuple(header["tokens"]) != tuple(tokens) or header.get("salt") != salt):
            problem = "it holds other tokens, or another salt's"
        payload = data[header["_offset"] :] if problem is None else b""
        if problem is None and hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            problem = "its checksum fails"
        if problem is not None:
            logger.info("KV disk tier: removing %s (%s)", path.name, problem)
            with self._lock:
                self.rejected += 1
            _unlink(path)
            self._forget(key)
            return None
        rows = torch.frombuffer(bytearray(payload), dtype=torch.uint8).reshape(len(tokens), -1)
        with self._lock:
            if key not in self._index:  # written by another replica: ours to count from now on
                self._index[key] = size
                self._used += size
            self._index.move_to_end(key)
        return Block(key, tuple(tokens), rows, source="disk", salt=salt)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._hints.pop(key, None)
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size

    # --------------------------------------------------------------- write
    def put(self, block: Block, wait: bool = False) -> None:
        """Queue ``block`` to be written; dropped when the tier stopped, or (unless ``wait``) when the
        writer is behind."""
        with self._lock:
            if self.stopped or block.key in self._index or block.key in self._pending:
                return
            self._pending.add(block.key)
        try:
            self._queue.put(block, block=wait, timeout=30.0 if wait else None)
        except queue.Full:
            with self._lock:
                self._pending.discard(block.key)
                self.dropped += 1

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued block is written (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        self.flush(timeout=30.0)
        self._queue.put(None)
        self._writer.join(timeout=5.0)

    def _write_loop(self) -> None:
        while True:
            block = self._queue.get()
            try:
                if block is None:
                    return
                if not self.stopped:
                    self._write(block)
            except OSError as exc:
                self._stop(f"writing {self.path(block.key).name} failed: {exc}")
            except Exception:
                logger.exception("KV disk tier: writing a block failed")
            finally:
                if block is not None:
                    with self._lock:
                        self._pending.discard(block.key)
                self._queue.task_done()

    def _write(self, block: Block) -> None:
        payload = block.rows.contiguous().numpy().tobytes()
        header = dict(self.identity, salt=block.salt, key=block.key.hex(), tokens=list(block.tokens),
                      bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest())
        head = json.dumps(header, separators=(",", ":")).encode()
        final = self.path(block.key)
        tmp = self.dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # KV reveals prompts: this user's only
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + len(head).to_bytes(4, "little") + head + payload)
            os.replace(tmp, final)
        except BaseException:
            _unlink(tmp)
            raise
        size = len(MAGIC) + 4 + len(head) + len(payload)
        with self._lock:
            old = self._index.pop(block.key, None)
            self._used += size - (old or 0)
            self._index[block.key] = size
            if block.protect_until > time.monotonic():
                self._hints[block.key] = block.protect_until
            self.bytes_written += size
        self._trim()

    def _trim(self) -> None:
        """Remove the least recently used files while over the budget (those under a retention hint last)."""
        while True:
            with self._lock:
                if self._used <= self.capacity or not self._index:
                    return
                now = time.monotonic()
                key = next((k for k in self._index if self._hints.get(k, 0.0) <= now), None)
                key = next(iter(self._index)) if key is None else key
                self._used -= self._index.pop(key)
                self._hints.pop(key, None)
            _unlink(self.path(key))

    def _stop(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = reason
            logger.warning("KV disk tier stopped, serving goes on without it: %s", reason)

    def check(self) -> None:
        """Raise AssertionError if the byte count is off (call when no write is queued)."""
        with self._lock:
            assert sum(self._index.values()) == self._used, f"disk tier counts {self._used} bytes, indexes {sum(self._index.values())}"
            if not self._queue.unfinished_tasks:
                assert self._used <= self.capacity, f"disk tier holds {self._used} bytes over its {self.capacity}"


def _parse_header(data: bytes) -> dict | None:
    """The JSON header of a block file's bytes (with ``_offset``: where its rows start), or None."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        return None
    n = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 4], "little")
    start = len(MAGIC) + 4
    if len(data) < start + n:
        return None
    try:
        header = json.loads(data[start : start + n])
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    header["_offset"] = start + n
    return header


def _read_header(path: str) -> tuple[dict | None, int]:
    """A file's header (read from its head only) and its size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + 4)
            if len(head) < len(MAGIC) + 4 or not head.startswith(MAGIC):
                return None, size
            n = int.from_bytes(head[len(MAGIC) :], "little")
            return _parse_header(head + f.read(n)), size
    except OSError:
        return None, 0


def _unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
