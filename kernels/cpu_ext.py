"""The C++ CPU kernels (kernels/csrc), compiled once per machine with torch's extension builder.

The build lands in the radixlm cache, keyed by torch version and CPU features (it is compiled
with -march=native). Without a C++ compiler the build fails and callers fall back to the
PyTorch path; ``make setup`` builds it ahead of time so the first engine start does not wait.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sysconfig
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(f"{torch.__version__}|{platform.machine()}|{flags}".encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def paged_decode_ext():
    """The compiled extension module, or None when it cannot be built here."""
    from torch.utils import cpp_extension

    from radixlm.runtime.disk_cache import cache_dir

    scripts = sysconfig.get_path("scripts")  # the pip-installed ninja, when no system one is on PATH
    if shutil.which("ninja") is None and Path(scripts, "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    build = cache_dir() / "torch_extensions" / f"paged_decode_{_cpu_key()}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name="radixlm_paged_decode",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers...: the PyTorch path serves instead
        logger.warning("C++ CPU attention kernel unavailable (%s); using the PyTorch path", exc)
        return None
