"""Attention and sampling kernels: Triton for GPUs, PyTorch reference for every device."""

from __future__ import annotations

import importlib.util

import torch

from radixlm.kernels.attention import AttentionBackend, TorchAttentionBackend

__all__ = ["AttentionBackend", "TorchAttentionBackend", "select_attention_backend", "triton_available"]


def triton_available() -> bool:
    """True when the ``triton`` package is installed (it is never imported at module load)."""
    return importlib.util.find_spec("triton") is not None


def select_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called ``name`` (``auto``: Triton on CUDA when installed, else PyTorch)."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"attention_backend must be auto, torch or triton, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if not triton_available():
        raise ValueError("attention_backend 'triton' needs the triton package (pip install 'radixlm[triton]')")
    from radixlm.kernels.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
