"""Torch intra-op thread settings for the CPU path."""

from __future__ import annotations

import os

import torch


def default_num_threads() -> int:
    """One intra-op thread per CPU this process may run on."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not on Linux
        return max(os.cpu_count() or 1, 1)


def configure_threads(num_threads: int | None, share: int = 1) -> int:
    """Set torch's intra-op threads (``RADIXLM_NUM_THREADS`` overrides the default); returns it.

    ``share``: processes splitting the CPUs (tensor-parallel ranks); the default is divided
    among them, an explicit number is per process."""
    if num_threads is None:
        env = os.environ.get("RADIXLM_NUM_THREADS")
        num_threads = int(env) if env else max(default_num_threads() // share, 1)
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
    return num_threads
