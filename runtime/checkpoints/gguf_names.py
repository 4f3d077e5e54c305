"""What llama.cpp's architectures are in Hugging Face's terms: the model class each names, the
tensor names, and which tensors llama.cpp's converter (``convert_hf_to_gguf.py``) changed.

The converter writes q/k rows of the Llama-style architectures in an interleaved RoPE order,
adds 1 to every Gemma norm weight (Gemma's RMSNorm scales by ``1 + w``), keeps Phi-3's fused
``qkv_proj`` and ``gate_up_proj`` whole (``attn_qkv``, ``ffn_up``), and stores Phi-3's longrope
factors and Llama 3's RoPE frequency factors as tensors (config, not weights, here).
"""

from __future__ import annotations

ARCHITECTURES: dict[str, tuple[str, str]] = {  # GGUF architecture -> (HF class, HF model_type)
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3"),
}
ROPE_PERMUTED = frozenset({"llama", "mistral", "smollm3"})  # q/k rows in llama.cpp's interleaved order
NORM_PLUS_ONE = frozenset({"gemma2", "gemma3"})  # norm weights stored as 1 + w

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LLAMA = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **_ATTENTION, **_MLP}
_GEMMA = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    **_ATTENTION,
    **_MLP,
}
_PHI3 = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",  # gate rows then up rows, as HF's Phi3MLP splits them
    "ffn_down": "mlp.down_proj",
}
LAYER_NAMES: dict[str, dict[str, str]] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA, "smollm3": _LLAMA,
    "gemma2": _GEMMA, "gemma3": _GEMMA, "phi3": _PHI3,
}  # fmt: skip


def gguf_to_hf_name(name: str, arch: str | None = None) -> str | None:
    """The Hugging Face name of GGUF tensor ``name`` in architecture ``arch`` (None: the first
    architecture that names it), or None for tensors the model does not load as weights."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    for table in [LAYER_NAMES[arch]] if arch is not None else LAYER_NAMES.values():
        if parts[2] in table:
            return f"model.layers.{parts[1]}.{table[parts[2]]}.{parts[3]}"
    return None


def is_shifted_norm(name: str, arch: str) -> bool:
    """True where the converter stored ``1 + w`` for HF's norm weight ``w`` (every Gemma norm)."""
    return arch in NORM_PLUS_ONE and name.endswith("norm.weight")
