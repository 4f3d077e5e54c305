"""Attention and fused kernels, tensor in and tensor out: Triton for GPUs, C++ and PyTorch for CPUs.

Nothing here knows batches or requests (the attention backends that adapt a ``ForwardBatch``
live in ``radixlm.runtime.layers.attention``), and nothing here imports ``radixlm.runtime``.
"""

from __future__ import annotations

import importlib.util

__all__ = ["triton_available"]


def triton_available() -> bool:
    """True when the ``triton`` package is installed (it is never imported at module load)."""
    return importlib.util.find_spec("triton") is not None
