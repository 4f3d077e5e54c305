"""Phi-3 (and Phi-4-mini): the Llama layout, stored with fused ``qkv_proj`` and ``gate_up_proj``.

Phi-3's checkpoints keep q/k/v as one matrix and gate/up as another, which is what this model
computes with anyway: a quantized checkpoint's fused weights go in whole, and plain ones are
cut into their parts first (so tensor parallelism shards them like Llama's). RoPE is
``longrope`` with short and long factors on the long-context models, and Phi-4-mini rotates
only part of each head (``partial_rotary_factor``); both come from the config.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from radixlm.runtime.models.dense import DenseForCausalLM
from radixlm.runtime.models.registry import register_family


@register_family(Phi3ForCausalLM="phi3")
class Phi3ForCausalLM(DenseForCausalLM):
    """Grouped-query attention and a SwiGLU MLP, from fused checkpoint tensors."""

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with fused q/k/v and gate/up cut into Llama's named parts."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for name, source in super().checkpoint_tensors(weights):
            prefix, fused, kind = _split_name(name)
            if fused == "self_attn.qkv_proj":
                tensor = source[:]
                for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv])):
                    yield f"{prefix}self_attn.{part}.{kind}", rows
            elif fused == "mlp.gate_up_proj":
                tensor = source[:]
                gate, up = tensor.chunk(2)
                yield f"{prefix}mlp.gate_proj.{kind}", gate
                yield f"{prefix}mlp.up_proj.{kind}", up
            else:
                yield name, source


def _split_name(name: str) -> tuple[str, str, str]:
    """``model.layers.3.self_attn.qkv_proj.weight`` → (``model.layers.3.``, ``self_attn.qkv_proj``, ``weight``)."""
    for fused in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
        marker = f".{fused}."
        if marker in name:
            prefix, kind = name.split(marker)
            return prefix + ".", fused, kind
    return "", "", ""
