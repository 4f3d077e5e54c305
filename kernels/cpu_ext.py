"""The C++ CPU kernels (kernels/csrc), compiled with torch's extension builder.

They are optional: every caller has a PyTorch path for when they are missing, and the C++ ones
are used only for CPU tensors. The engine builds them at start-up (before it reports ready), so
no request waits for the compiler.

The build lands in the radixlm cache, in a folder named by a hash of what decides the binary:
the sources' content, the compiler and its flags, the torch version and installation, the Python
version and the CPU's features (it is compiled with -march=native, or the target named by
``RADIXLM_CPU_MARCH``, e.g. ``haswell`` for AVX2 only). The sources are copied into that folder and built
from there, so checkouts with the same sources share one build, and changed sources never load
a stale one. When the build fails (no compiler, no headers...), one warning is logged and the
callers use the PyTorch path.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import re
import shutil
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from radixlm.kernels.paths import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)

_UNSET = object()
_module: ModuleType | None | object = _UNSET
_lock = threading.Lock()


def source_files(csrc: Path = CSRC) -> list[Path]:
    """Every file the build reads (sources and headers), in a fixed order."""
    return sorted(p for p in csrc.iterdir() if p.is_file() and p.suffix in (".cpp", ".h", ".hpp"))


def compile_flags() -> tuple[str, ...]:
    """The compiler flags: ``CFLAGS`` with ``-march=$RADIXLM_CPU_MARCH`` when that is set (a build
    for another or a smaller instruction set than this CPU's, e.g. ``haswell``: AVX2, no AVX-512)."""
    march = os.environ.get("RADIXLM_CPU_MARCH", "").strip()
    if not march:
        return CFLAGS
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", march):
        raise ValueError(f"RADIXLM_CPU_MARCH must name a -march target such as haswell or native, got {march!r}")
    return tuple(f"-march={march}" if f.startswith("-march=") else f for f in CFLAGS)


def _cpu_features() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def build_key(files: list[Path], cflags: tuple[str, ...] | None = None, ldflags: tuple[str, ...] = LDFLAGS, torch_dir: str | None = None) -> str:
    """A hash of everything that decides the compiled binary (``cflags`` default: ``compile_flags()``);
    source paths do not count, contents do.

    The torch installation's folder counts: torch's builder writes its header paths into the
    build file, so two virtualenvs sharing one folder would rebuild it for each other in turn.
    """
    torch_dir = torch_dir if torch_dir is not None else os.path.dirname(os.path.realpath(torch.__file__))
    cflags = compile_flags() if cflags is None else cflags
    h = hashlib.sha256()
    for part in (torch.__version__, torch_dir, sys.version.split()[0], platform.machine(), _cpu_features(), os.environ.get("CXX", "c++"), *cflags, "|", *ldflags):
        h.update(part.encode() + b"\0")
    for f in files:
        data = f.read_bytes()
        h.update(f"{f.name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


def build_folder(files: list[Path] | None = None, root: Path | None = None) -> Path:
    """The folder that holds (or will hold) the build of ``files`` (default: kernels/csrc)."""
    files = source_files() if files is None else files
    return (root or cache_dir()) / "torch_extensions" / f"cpu_kernels_{build_key(files)}"


def cpu_kernels() -> ModuleType | None:
    """The compiled extension module (paged_decode, quantize_into, add_rms_norm, silu_mul, gelu_tanh_mul, rope, q4_linear, gated_delta_decode, DecodeStack...), or None when it cannot be built here.

    The first call builds (or finds) it; later calls return the same answer at once.
    """
    global _module
    if _module is _UNSET:
        with _lock:
            if _module is _UNSET:
                _module = _load()
    return _module  # type: ignore[return-value]


def _load() -> ModuleType | None:
    try:
        files = source_files()
        folder = build_folder(files)
        _copy_sources(files, folder)
        return _compile(folder, [f.name for f in files if f.suffix == ".cpp"])
    except Exception as exc:  # no compiler, no headers, unwritable cache...: the PyTorch path serves instead
        logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch path", exc)
        return None


def _copy_sources(files: list[Path], folder: Path) -> None:
    """Put the sources into the build folder (each file atomically, once), so every checkout builds the same paths."""
    src = folder / "src"
    src.mkdir(parents=True, exist_ok=True)
    for f in files:
        dest = src / f.name
        if dest.is_file():
            continue  # same key, same content
        fd, tmp = tempfile.mkstemp(dir=src, prefix=f".{f.name}-")
        with os.fdopen(fd, "wb") as out:
            out.write(f.read_bytes())
        os.replace(tmp, dest)


def _compile(folder: Path, sources: list[str]) -> ModuleType:
    from torch.utils import cpp_extension

    scripts = sysconfig.get_path("scripts")  # the pip-installed ninja, when no system one is on PATH
    if shutil.which("ninja") is None and Path(scripts, "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    with _build_guard(folder):
        return cpp_extension.load(
            name="radixlm_cpu_kernels",
            sources=[str(folder / "src" / name) for name in sources],
            extra_cflags=list(compile_flags()),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(folder),
            verbose=False,
        )


@contextlib.contextmanager
def _build_guard(folder: Path) -> Iterator[None]:
    """Hold the folder's build lock; a ``lock`` file torch's builder left behind is then stale.

    torch waits, without a time limit, for its own lock file to disappear, and a process killed
    mid-build leaves it there forever. Our lock is an OS lock (flock) that dies with its
    process, so whoever holds it knows no live build owns torch's file and may remove it.
    """
    try:
        import fcntl
    except ImportError:  # not a POSIX system: torch's own lock is all there is
        yield
        return
    with open(folder / ".build-guard", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = folder / "lock"
        if stale.exists():
            logger.warning("removing a stale build lock left by a killed build: %s", stale)
            stale.unlink(missing_ok=True)
        yield
