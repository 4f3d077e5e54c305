"""Gemma 2 and Gemma 3 (text): four norms a layer, ``(1 + w)`` norms, scaled embeddings, GeGLU.

Both: an RMSNorm before and after attention and before and after the MLP, each scaling by
``1 + weight`` (the 1 is added to the weights as they load, so the norms are plain RMSNorms);
embeddings multiplied by √hidden; scores scaled by ``query_pre_attn_scalar ** -0.5``; a
tanh-approximated GELU gate; sliding-window layers alternating with global ones
(``layer_types``). Gemma 2 soft-caps the attention scores and the final logits. Gemma 3 adds
per-head q/k norms, five sliding layers to one global, and a RoPE base of its own for the
sliding layers (the global ones may scale theirs).
"""

from __future__ import annotations

from radixlm.runtime.models.dense import DenseArch, DenseForCausalLM
from radixlm.runtime.models.registry import register_family


@register_family(Gemma2ForCausalLM="gemma2")
class Gemma2ForCausalLM(DenseForCausalLM):
    """Gemma 2: sandwich norms, soft-capped attention and logits, local and global layers."""

    arch = DenseArch(sandwich_norms=True, norm_offset=1.0, embed_scale=True)


@register_family(Gemma3ForCausalLM="gemma3_text")
class Gemma3ForCausalLM(DenseForCausalLM):
    """Gemma 3 (text): Gemma 2's layers with q/k norms and a local RoPE base for sliding layers."""

    arch = DenseArch(qk_norm=True, sandwich_norms=True, norm_offset=1.0, embed_scale=True)
