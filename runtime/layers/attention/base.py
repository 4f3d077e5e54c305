"""Attention backends: the contract of one, and how one is chosen by name.

A backend serves two kinds of rows in one batch (see ``ForwardBatch``):

- decode rows: one new query token attends to every token of its sequence in the pool;
- extend rows: ``e`` new tokens attend to the ``p`` cached tokens of their sequence and causally
  to each other (new token ``i`` sees positions ``0 .. p + i``).

Before attending, the backend writes the new tokens' K and V into the pool at ``out_slots``; a
row's keys are then read through its slot-table row ``req_to_token[row, :p + e]``.
Grouped-query attention maps query head ``h`` to KV head ``h // (H / Hkv)``. The kernels
themselves (``radixlm.kernels``) take tensors only and know nothing of batches.

Backends register by name (``@register_attention_backend("torch")`` on the class); one that cannot
run here (its package is not installed) is recorded as unavailable instead, so that asking for
it says what to install. Importing ``radixlm.runtime.layers.attention`` fills the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from radixlm.runtime.layers.attention_spec import AttentionSpec
from radixlm.runtime.layers.forward_batch import ForwardBatch

__all__ = ["AttentionBackend", "register_attention_backend", "register_unavailable_backend", "select_attention_backend"]


class AttentionBackend(ABC):
    """Computes attention for a ForwardBatch over the paged KV pool."""

    captures_decode = False  # True for a DecodeCapturingBackend (its decode steps can be CUDA graphs)
    latent_kv = False  # True where it serves a latent pool (MLA): values narrower than keys, a view of them

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare whatever index tensors every layer of this batch will reuse."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, spec: AttentionSpec | None = None
    ) -> torch.Tensor:
        """Store ``k``/``v`` ``[T, Hkv, D]`` in the pool and attend ``q`` ``[T, H, D]`` as ``spec``
        says (None: plain causal attention at ``D ** -0.5``); returns ``[T, H*D]``. A backend with
        ``latent_kv`` also takes ``v`` ``[T, Hkv, Dv]`` narrower than ``k`` (over a latent pool:
        ``k``'s first ``Dv`` columns) and returns ``[T, H*Dv]``."""


class DecodeCapturingBackend(AttentionBackend):
    """A backend whose decode steps can be CUDA graphs: it reads a graph's fixed input tensors."""

    captures_decode = True

    @abstractmethod
    def static_decode_metadata(self, req_rows: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, num_kv_heads: int) -> Any:
        """Metadata of a decode-only batch over fixed ``req_rows`` (int64) and ``seq_lens`` (int32) tensors."""


Factory = TypeVar("Factory", bound=Callable[[], AttentionBackend])

_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}  # name -> backend class (or function making one)
_UNAVAILABLE: dict[str, str] = {}  # name -> what it needs that is not installed


def register_attention_backend(name: str) -> Callable[[Factory], Factory]:
    """Decorator: make a backend class (or a function returning a backend) selectable as ``name``."""

    def register(factory: Factory) -> Factory:
        _BACKENDS[name] = factory
        return factory

    return register


def register_unavailable_backend(name: str, needs: str) -> None:
    """Record that backend ``name`` exists but cannot run here; ``needs`` says what to install."""
    _UNAVAILABLE[name] = needs


def select_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called ``name`` (``auto``: Triton on CUDA when installed, else PyTorch)."""
    names = sorted({*_BACKENDS, *_UNAVAILABLE})
    if name != "auto" and name not in names:
        raise ValueError(f"attention_backend must be auto, {', '.join(names[:-1])} or {names[-1]}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and "triton" in _BACKENDS else "torch"
    if name in _UNAVAILABLE:
        raise ValueError(f"attention_backend {name!r} needs {_UNAVAILABLE[name]}")
    return _BACKENDS[name]()
