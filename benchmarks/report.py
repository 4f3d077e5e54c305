"""Printing a benchmark's markdown result and appending it, with its command, to a results file."""

from __future__ import annotations

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
