"""The on-disk cache for what is slow to derive from a model file (tokenizers, GGUF weights)."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from radixlm.kernels.paths import cache_dir

__all__ = ["cache_dir", "entry_for", "file_digest", "model_digest", "write_entry"]


def file_digest(path: str) -> str:
    """A short content hash of a file (sha256, first 16 hex digits)."""
    st = os.stat(path)
    return _digest(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


_SAMPLE = 1 << 22  # bytes read at the start, middle and end of each weight file


def model_digest(path: str, extra: str = "") -> str:
    """A short name of the model at ``path`` (a folder or one file) and ``extra`` (how it runs): its
    config in full, and each weight file's name, size and bytes at its start, middle and end."""
    h = hashlib.sha256(extra.encode())
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file() and f.suffix in (".json", ".safetensors", ".bin", ".gguf", ".pt"))
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            if f.suffix == ".json" or size <= 3 * _SAMPLE:
                h.update(fh.read())
                continue
            for at in (0, size // 2, size - _SAMPLE):
                fh.seek(at)
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()[:16]


def entry_for(path: str, kind: str) -> Path:
    """The cache folder of one kind of derived data for the file at ``path``."""
    return cache_dir() / file_digest(path) / kind


def write_entry(entry: Path, fill: Callable[[Path], None]) -> bool:
    """Create ``entry`` atomically by letting ``fill`` write into a temporary folder."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}-"))
    except OSError:
        return False
    try:
        fill(tmp)
        shutil.rmtree(entry, ignore_errors=True)
        os.replace(tmp, entry)
        return True
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return False
