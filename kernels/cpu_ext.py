"""The C++ CPU kernels (kernels/csrc), compiled once per machine with torch's extension builder.

They are optional: every caller has a PyTorch path for when they are missing, and the C++ ones
are used only for CPU tensors.

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

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("bindings.cpp", "paged_decode.cpp", "fused_ops.cpp")]


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(f"{torch.__version__}|{platform.machine()}|{flags}".encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def cpu_kernels():
    """The compiled extension module (paged_decode, add_rms_norm, silu_mul, rope), or None when it cannot be built here."""
    from torch.utils import cpp_extension

    from radixlm.runtime.disk_cache import cache_dir

    scripts = sysconfig.get_path("scripts")  # the pip-installed ninja, when no system one is on PATH
    if shutil.which("ninja") is None and Path(scripts, "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    build = cache_dir() / "torch_extensions" / f"cpu_kernels_{_cpu_key()}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name="radixlm_cpu_kernels",
            sources=[str(p) for p in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers...: the PyTorch path serves instead
        logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch path", exc)
        return None
