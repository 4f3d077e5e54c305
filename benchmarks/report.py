"""Printing a benchmark's markdown result and appending it, with its command, to a results file."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path


def emit(text: str, out: str | None) -> None:
    """Print ``text``; when ``out`` is given, append the command line and ``text`` to that file."""
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(f"Command: `{' '.join(sys.argv)}`\n\n{text}\n")


def write(text: str, out: str | None) -> None:
    """Print ``text``; when ``out`` is given, write it there (replacing the file)."""
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)


def machine() -> str:
    """The machine a figure came from: the CPU's model name, its logical CPUs, torch's CPU capability."""
    import torch

    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    caps = [f"{var}={os.environ[var]}" for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "RADIXLM_CPU_MARCH") if os.environ.get(var)]
    capped = f" (instruction sets capped: {', '.join(caps)})" if caps else ""
    return f"{os.cpu_count()} CPUs ({name}), torch CPU capability {torch.backends.cpu.get_cpu_capability()}{capped}"
