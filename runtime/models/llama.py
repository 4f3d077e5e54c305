"""The Llama family (Llama 2/3.x, SmolLM2, SmolLM3, Mistral, Qwen2): the dense decoder as it is.

Differences inside the family are configuration: Qwen2 has q/k/v biases, SmolLM2 ties the
output head to the embedding, Llama 3 scales RoPE frequencies, Mistral's layers attend within a
sliding window, SmolLM3 skips RoPE on every fourth layer (``no_rope_layers``).
"""

from __future__ import annotations

from radixlm.runtime.models.dense import DenseForCausalLM
from radixlm.runtime.models.registry import register_family


@register_family(
    LlamaForCausalLM="llama", MistralForCausalLM="mistral", Qwen2ForCausalLM="qwen2", SmolLM3ForCausalLM="smollm3"
)
class LlamaForCausalLM(DenseForCausalLM):
    """Pre-norm decoder layers of grouped-query attention (RoPE) and a SwiGLU MLP."""
