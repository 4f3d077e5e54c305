"""Qwen3 (dense): the Llama layout with an RMSNorm over each head of q and k before RoPE.

Qwen3 also sets ``head_dim`` apart from ``hidden_size / num_heads`` (0.6B: 16 heads of 128 in a
hidden size of 1024), which the config reads, and drops Qwen2's q/k/v biases.
"""

from __future__ import annotations

from radixlm.runtime.models.dense import DenseArch, DenseForCausalLM
from radixlm.runtime.models.registry import register_family


@register_family(Qwen3ForCausalLM="qwen3")
class Qwen3ForCausalLM(DenseForCausalLM):
    """Grouped-query attention with per-head q/k norms, and a SwiGLU MLP."""

    arch = DenseArch(qk_norm=True)
