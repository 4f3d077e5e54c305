"""Putting a checkpoint's stored weights into a model built on the meta device, and sizing the result.

A family's model builds its linear layers as ``nn.Linear`` on the meta device (no memory). For
every stored weight, ``install_stored`` asks the model where the Hugging Face name goes
(``weight_target``: a parameter and a row offset in it, as fused q/k/v and gate/up projections
take several checkpoint tensors) and replaces each such layer with the one layer its parts join
into (``radixlm.runtime.layers.stored_weight.join_stored``). A family that reorders a tensor's rows
at load (DeepSeek's RoPE rows) gives the stored weight in that order (the model's
``stored_weight``, where it has one). ``materialize`` then allocates what is still on the meta
device, so the dense copy of a stored weight is never made.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn

from radixlm.runtime.layers.gguf_linear import GGUFEmbedding, GGUFWeight
from radixlm.runtime.layers.stored_weight import StoredWeight, join_stored

logger = logging.getLogger(__name__)

EMBEDDING = "model.embed_tokens.weight"


def install_stored(model: nn.Module, stored: dict[str, StoredWeight], device: torch.device, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Replace the layers of ``model`` that ``stored`` holds weights for with layers over those
    weights; returns, dequantized under their checkpoint names, the stored weights whose target is
    a parameter of something other than a linear layer (DeepSeek's ``kv_b_proj``, which latent
    attention splits per head), for the caller to load with the plain tensors."""
    groups: dict[str, list[tuple[int, StoredWeight]]] = defaultdict(list)
    in_model_order = getattr(model, "stored_weight", None)
    dense: list[tuple[str, torch.Tensor]] = []
    for name, weight in stored.items():
        if name == EMBEDDING and isinstance(weight, GGUFWeight):
            continue
        target, offset = model.weight_target(name)
        if target is None:
            continue
        if not target.endswith(".weight"):
            raise ValueError(f"stored weight {name!r} maps to {target!r}, not a layer's weight")
        if not isinstance(model.get_submodule(target.removesuffix(".weight")), nn.Linear):
            logger.info("dequantizing %s (%s): its layer is not a linear layer", name, weight.format)
            dense.append((name, weight.dequantize()))
            continue
        if in_model_order is not None:
            weight = in_model_order(name, weight)
        groups[target.removesuffix(".weight")].append((offset or 0, weight))
    for path, parts in groups.items():
        old = model.get_submodule(path)
        parts.sort(key=lambda p: p[0])
        expected = 0
        for offset, weight in parts:
            if offset != expected or weight.in_features != old.in_features:
                raise ValueError(f"stored weights for {path} do not tile it: a part of {weight.out_features}x{weight.in_features} at row {offset}, expected row {expected} of {old.out_features}x{old.in_features}")
            expected += weight.out_features
        if expected != old.out_features:
            raise ValueError(f"stored weights for {path} cover {expected} of its {old.out_features} rows")
        model.set_submodule(path, join_stored([w for _, w in parts], old.bias, device, dtype))
    embedding = stored.get(EMBEDDING)
    if isinstance(embedding, GGUFWeight):
        _install_embedding(model, embedding, device, dtype)
    return dense


def _install_embedding(model: nn.Module, weight: GGUFWeight, device: torch.device, dtype: torch.dtype) -> None:
    """The token table as GGUF blocks; a head tied to it computes over the same blocks."""
    if getattr(model, "shard", None) is not None:
        raise ValueError("a sharded model cannot keep its embedding as GGUF blocks")
    model.embed_tokens = GGUFEmbedding(weight, dtype)
    if getattr(model, "lm_head", "absent") is None:  # tied
        model.lm_head = join_stored([weight], None, device, dtype)


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Allocate (uninitialised) every parameter and buffer still on the meta device: floating ones in ``dtype``."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                empty = torch.empty(t.shape, device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                table[name] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters and persistent buffers occupy (not tables derived at start-up,
    such as RoPE's), each storage counted once (shared blocks, tied heads)."""
    seen: dict[tuple[str, int], int] = {}
    tensors = [t for m in model.modules() for name, t in m._buffers.items() if name not in m._non_persistent_buffers_set]
    for t in [*model.parameters(), *tensors]:
        if t is None or t.is_meta:
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        seen[key] = max(seen.get(key, 0), storage.nbytes())
    return sum(seen.values())
