"""Where radixlm keeps what it derives on disk (compiled kernels, converted tokenizers and weights).

It lives on the lowest floor because the kernels' build needs it; ``runtime.disk_cache`` builds
on it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where radixlm keeps derived files (``$RADIXLM_CACHE_DIR`` or ``~/.cache/radixlm``)."""
    root = os.environ.get("RADIXLM_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "radixlm"
