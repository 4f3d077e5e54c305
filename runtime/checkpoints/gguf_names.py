"""What llama.cpp's architectures are in Hugging Face's terms: the model class each names, the
tensor names, and which tensors llama.cpp's converter (``convert_hf_to_gguf.py``) changed.

The converter writes q/k rows of the Llama-style architectures in an interleaved RoPE order,
adds 1 to every Gemma norm weight (Gemma's RMSNorm scales by ``1 + w``), keeps Phi-3's fused
``qkv_proj`` and ``gate_up_proj`` whole (``attn_qkv``, ``ffn_up``), and stores Phi-3's longrope
factors and Llama 3's RoPE frequency factors as tensors (config, not weights, here). What it
changed in the hybrid families (Qwen3-Next, Qwen3.5) is undone in ``gguf_hybrid``.

Mixtures of experts (``qwen3moe``; ``gpt-oss``; Mixtral, which the converter writes as ``llama`` with an
``expert_count``) keep the router as ``ffn_gate_inp`` and every expert of a layer in one 3-D tensor
per projection, ``ffn_gate_exps``/``ffn_up_exps``/``ffn_down_exps`` ([experts, rows, columns];
a converter run with ``--fuse-gate-up-exps`` writes ``ffn_gate_up_exps``, gate rows then up rows);
llama.cpp files from before 2024 hold one tensor per expert (``blk.N.ffn_gate.E.weight``). Hugging
Face checkpoints hold one tensor per expert: ``gguf_expert_names`` says how a merged one splits.
GPT-OSS's converter splits the checkpoint's interleaved ``gate_up_proj`` into ``ffn_gate_exps`` and
``ffn_up_exps`` (biases too, ``.bias`` [experts, rows]), transposes each expert to [rows, columns],
repacks MXFP4 experts as GGUF's ``MXFP4`` blocks, and names the sinks ``attn_sinks.weight``.

DeepSeek-V2 and V3 (``deepseek2``) keep Hugging Face's layout but for the latent attention's
``kv_b_proj``, which newer files hold split per head (``attn_k_b`` transposed, ``attn_v_b``):
``gguf_deepseek`` rebuilds it. Their RoPE rows stay in the checkpoint's interleaved order.
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
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),
    "deepseek2": ("DeepseekV2ForCausalLM", "deepseek_v2"),  # V3 where the router is a sigmoid (gguf_deepseek)
}
WITH_EXPERTS: dict[str, tuple[str, str]] = {"llama": ("MixtralForCausalLM", "mixtral")}  # files with an expert_count
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
_ROUTER = {"ffn_gate_inp": "mlp.gate"}  # [experts, hidden]
_LLAMA = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **_ATTENTION, **_MLP, **_ROUTER}
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
_HYBRID = {  # Qwen3-Next, Qwen3.5, Qwen3.5-MoE (gguf_hybrid.py undoes what the converter changed in them)
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    **_ATTENTION,
    "attn_qkv": "linear_attn.in_proj_qkv",  # a full-attention layer's (``--fuse-qkv``): gguf_hybrid.py
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba",  # Qwen3-Next's, per key head [b a]
    "ssm_in": "linear_attn.in_proj_qkvz",  # Qwen3-Next's in older files, per key head [q k v z]
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    **_MLP,
    **_ROUTER,
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_DEEPSEEK2 = {  # DeepSeek-V2/V3 (``attn_k_b``/``attn_v_b``, kv_b_proj split, are gguf_deepseek's)
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",  # V2-Lite: no query compression
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # whole, in files from before the converter split it
    "attn_output": "self_attn.o_proj",
    **_MLP,  # the leading dense layers
    **_ROUTER,
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_GPT_OSS = {  # the router keeps its bias (``ffn_gate_inp.bias``); experts' biases are merged as their weights
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    **_ATTENTION,
    "ffn_gate_inp": "mlp.router",
}
# per-layer tensors not named ``<module>.weight``: the name after ``blk.N.`` -> HF's after ``model.layers.N.``
_HYBRID_PARAMETERS = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
PARAMETER_NAMES: dict[str, dict[str, str]] = {
    "qwen3next": _HYBRID_PARAMETERS, "qwen35": _HYBRID_PARAMETERS, "qwen35moe": _HYBRID_PARAMETERS,
    "gpt-oss": {"attn_sinks.weight": "self_attn.sinks"},
    "deepseek2": {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},  # V3's router correction bias
}  # fmt: skip
LAYER_NAMES: dict[str, dict[str, str]] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA, "smollm3": _LLAMA,
    "gemma2": _GEMMA, "gemma3": _GEMMA, "phi3": _PHI3, "qwen3moe": _LLAMA, "qwen3next": _HYBRID, "qwen35": _HYBRID,
    "qwen35moe": _HYBRID, "gpt-oss": _GPT_OSS, "deepseek2": _DEEPSEEK2,
}  # fmt: skip
EXPERT_ARCHITECTURES = frozenset({"llama", "qwen3moe", "qwen3next", "qwen35moe", "gpt-oss", "deepseek2"})  # where a file may hold experts
# merged expert tensor -> the projections its rows hold, in order (each part an equal share of the rows)
MERGED_EXPERTS = {
    "ffn_gate_exps": ("gate_proj",),
    "ffn_up_exps": ("up_proj",),
    "ffn_down_exps": ("down_proj",),
    "ffn_gate_up_exps": ("gate_proj", "up_proj"),
}


def gguf_to_hf_name(name: str, arch: str | None = None) -> str | None:
    """The Hugging Face name of GGUF tensor ``name`` in architecture ``arch`` (None: the first
    architecture that names it), or None for tensors the model does not load as weights."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 5 and parts[0] == "blk" and parts[2] in _MLP and parts[3].isdigit():  # an older file's expert
        if arch is not None and arch not in EXPERT_ARCHITECTURES:
            return None
        proj = _MLP[parts[2]].removeprefix("mlp.")
        return f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{proj}.{parts[4]}"
    if parts[0] == "blk" and len(parts) > 2:
        for table in [PARAMETER_NAMES.get(arch, {})] if arch is not None else PARAMETER_NAMES.values():
            param = table.get(".".join(parts[2:]))
            if param is not None:
                return f"model.layers.{parts[1]}.{param}"
    if len(parts) != 4 or parts[0] != "blk":
        return None
    for table in [LAYER_NAMES[arch]] if arch is not None else LAYER_NAMES.values():
        if parts[2] in table:
            return f"model.layers.{parts[1]}.{table[parts[2]]}.{parts[3]}"
    return None


def gguf_expert_names(name: str, arch: str | None = None) -> tuple[str, ...] | None:
    """For a merged expert tensor (``blk.N.ffn_gate_exps.weight``: [experts, rows, columns]; its
    bias, GPT-OSS's, [experts, rows]) the Hugging Face name of each part of expert ``{expert}``'s
    rows, as a format string (gate_up: the gate's half, then the up's); None for any other tensor."""
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in MERGED_EXPERTS:
        return None
    if arch is not None and arch not in EXPERT_ARCHITECTURES:
        return None
    return tuple(f"model.layers.{parts[1]}.mlp.experts.{{expert}}.{proj}.{parts[3]}" for proj in MERGED_EXPERTS[parts[2]])


def is_router(name: str) -> bool:
    """True for a router's weight (``ffn_gate_inp``; a shared expert's gate, ``ffn_gate_inp_shexp``):
    loaded as values, never kept as blocks."""
    return name.endswith((".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight"))


def is_shifted_norm(name: str, arch: str) -> bool:
    """True where the converter stored ``1 + w`` for HF's norm weight ``w`` (every Gemma norm)."""
    return arch in NORM_PLUS_ONE and name.endswith("norm.weight")
