"""Mixtral: Mistral's attention with every MLP replaced by 8 routed experts (2 a token).

The router takes a softmax over the experts and renormalises the top two; the experts are
SwiGLU MLPs. The checkpoints name them ``block_sparse_moe.experts.N.w1`` (gate), ``w3`` (up) and
``w2`` (down), and the router ``block_sparse_moe.gate``: renamed here to the decoder's names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from radixlm.runtime.models.dense import DenseForCausalLM
from radixlm.runtime.models.registry import register_family

_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.")
_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


@register_family(MixtralForCausalLM="mixtral")
class MixtralForCausalLM(DenseForCausalLM):
    """Grouped-query attention (optionally sliding) and a sparse mixture of SwiGLU experts."""

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under the decoder's names (experts' ``w1/w2/w3``, the router)."""
        for name, source in super().checkpoint_tensors(weights):
            name = _EXPERT.sub(lambda m: f".mlp.experts.{m.group(1)}.{_PROJ[m.group(2)]}.", name)
            yield name.replace(".block_sparse_moe.gate.", ".mlp.gate."), source
