"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention with routed experts.

Each sparse layer routes a token to 8 of 128 SwiGLU experts by softmax, renormalised where the
config says ``norm_topk_prob``; layers listed in ``mlp_only_layers`` (or off the
``decoder_sparse_step``) keep a dense MLP. No shared experts.
"""

from __future__ import annotations

from radixlm.runtime.models.dense import DenseArch, DenseForCausalLM
from radixlm.runtime.models.registry import register_family


@register_family(Qwen3MoeForCausalLM="qwen3_moe")
class Qwen3MoeForCausalLM(DenseForCausalLM):
    """Grouped-query attention with per-head q/k norms, and routed SwiGLU experts."""

    arch = DenseArch(qk_norm=True)
