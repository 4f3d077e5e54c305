"""ModelConfig: the architecture facts the engine needs, read from a HF config or GGUF metadata.

Per-layer facts (which layers slide, which skip RoPE, which RoPE base a layer uses) are read
into lists and small dicts here, so a family asks ``cfg.window(layer)`` instead of knowing how
each config spells it (``layer_types``, ``use_sliding_window``, ``no_rope_layers``, Gemma 3's
``rope_parameters`` keyed by layer type).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.layers.gated_delta import GatedDeltaSpec
from radixlm.runtime.layers.mla import MLASpec
from radixlm.runtime.layers.moe_router import RouterSpec
from radixlm.runtime.models.registry import supported_architectures


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts model's experts: routing, sizes, and which layers have them."""

    router: RouterSpec
    intermediate_size: int  # each routed expert's
    sparse_layers: tuple[bool, ...]  # per layer (then per MTP layer): experts (True) or a dense MLP
    shared_intermediate_size: int = 0  # DeepSeek's shared experts, as one MLP (0: none)
    shared_gate: bool = False  # Qwen3-Next: the shared expert's output scaled by a learned sigmoid gate per token
    expert_bias: bool = False  # GPT-OSS: the experts' projections have biases
    swiglu_limit: float | None = None  # GPT-OSS: the experts' clamped SwiGLU (clamp limit, sigmoid gain)
    swiglu_alpha: float = 1.702

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], family: str) -> MoEConfig | None:
        """The MoE facts of a Hugging Face config (Mixtral, Qwen3-MoE, DeepSeek and GPT-OSS spellings), or None for a dense model."""
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
        if not experts:
            return None
        layers = cfg["num_hidden_layers"]
        top_k = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token")
        if not top_k:
            raise ValueError(f"a mixture-of-experts config ({experts} experts) needs num_experts_per_tok")
        if family.startswith("deepseek"):  # dense first_k_dense_replace layers, then experts every moe_layer_freq layers
            first, freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
            layers += cfg.get("num_nextn_predict_layers") or 0  # the MTP layers after the model's follow the same rule
            sparse = tuple(i >= first and i % freq == 0 for i in range(layers))
        else:  # Qwen3-MoE: every decoder_sparse_step-th layer not in mlp_only_layers; Mixtral, GPT-OSS: every layer
            step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or [])
            sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
        v3 = family == "deepseek_v3"  # transformers 5 leaves out V3's scoring_func and topk_method: they are fixed
        sigmoid = (cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")) == "sigmoid"
        method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        grouped = method in ("group_limited_greedy", "noaux_tc")
        router = RouterSpec(
            num_experts=experts,
            top_k=top_k,
            scoring="sigmoid" if sigmoid else "topk_softmax" if family == "gpt_oss" else "softmax",
            renormalize=family in ("mixtral", "qwen3_5_moe") or (bool(cfg.get("norm_topk_prob")) and family != "deepseek_v2"),
            n_group=(cfg.get("n_group") or 1) if grouped else 1,
            topk_group=(cfg.get("topk_group") or 1) if grouped else 1,
            group_score="top2_sum" if method == "noaux_tc" else "max",
            scaling=float(cfg.get("routed_scaling_factor") or 1.0),
            bias=family == "gpt_oss",
            correction_bias=method == "noaux_tc",
        )
        inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        shared = cfg.get("shared_expert_intermediate_size") or (cfg.get("n_shared_experts") or 0) * inter
        if family != "gpt_oss":
            return cls(router, inter, sparse, shared, shared_gate=bool(cfg.get("shared_expert_intermediate_size")))
        limit, alpha = float(cfg.get("swiglu_limit") or 7.0), float(cfg.get("swiglu_alpha") or 1.702)
        return cls(router, inter, sparse, shared, expert_bias=True, swiglu_limit=limit, swiglu_alpha=alpha)


@dataclass
class ModelConfig:
    """Shapes and hyper-parameters of a decoder (every family the registry holds)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases
    o_proj_bias: bool = False  # a bias on the attention output projection too (GPT-OSS)
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer: "sliding_attention" or "full_attention"; None: all full
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 power, not head_dim's
    attn_logit_softcapping: float | None = None  # Gemma 2
    final_logit_softcapping: float | None = None  # Gemma 2
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own RoPE base ...
    local_rope_scaling: dict[str, Any] | None = None  # ... and scaling (None: none)
    no_rope_layers: list[int] | None = None  # SmolLM3: 1 where a layer applies RoPE, 0 where it does not
    partial_rotary_factor: float = 1.0  # the share of each head's dims RoPE rotates
    moe: MoEConfig | None = None  # a mixture of experts: its routing and expert layers
    mla: MLASpec | None = None  # DeepSeek's multi-head latent attention (its KV pool is latent)
    mtp_layers: int = 0  # DeepSeek-V3: multi-token-prediction layers after the model's (``num_nextn_predict_layers``)
    linear: GatedDeltaSpec | None = None  # hybrid models: the Gated DeltaNet layers' shapes (layer_types "linear_attention")

    def kv_layout(self, num_kv_heads: int | None = None) -> tuple[int, int, int | None]:
        """The KV pool's shape per token and layer: ``(kv heads, key width, latent width)``.

        Per-head K and V (``num_kv_heads``: this rank's, default all) have no latent width; an MLA
        model stores one row ``[c_kv | k_pe]`` of one shared head, whose first ``kv_lora_rank``
        columns are its values (on every tensor-parallel rank alike)."""
        if self.mla is not None:
            return 1, self.mla.row_dim, self.mla.kv_lora_rank
        return (self.num_kv_heads if num_kv_heads is None else num_kv_heads), self.head_dim, None

    @property
    def attn_output_gate(self) -> bool:
        """True where ``q_proj`` gives each head a gate beside its query (Qwen3-Next, Qwen3.5: the hybrid families)."""
        return self.linear is not None

    def is_linear(self, layer: int) -> bool:
        """True where ``layer`` mixes tokens by linear attention (a recurrent state, no KV)."""
        return self.linear is not None and self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    @property
    def kv_layers(self) -> int:
        """Layers that keep KV in the pool (every layer but the linear-attention ones)."""
        return sum(not self.is_linear(i) for i in range(self.num_layers))

    @property
    def linear_layers(self) -> int:
        """Layers that keep a recurrent state instead of KV."""
        return self.num_layers - self.kv_layers

    def pool_layer(self, layer: int) -> int:
        """``layer``'s index among the layers of its kind: in the KV pool, or in the state pool for a linear-attention layer."""
        return sum(self.is_linear(i) == self.is_linear(layer) for i in range(layer))

    def sparse(self, layer: int) -> bool:
        """True where ``layer``'s feed-forward block is routed experts (not a dense MLP)."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    @property
    def context_length(self) -> int:
        """Longest sequence the model attends over (sliding windows slide; they do not cap it)."""
        return self.max_position_embeddings

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None where it attends to every position."""
        if not self.sliding_window:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def uses_rope(self, layer: int) -> bool:
        """False for the layers that attend without positions (SmolLM3's NoPE layers)."""
        return self.no_rope_layers is None or bool(self.no_rope_layers[layer])

    @property
    def all_layers_slide(self) -> bool:
        """True when every layer attends within one sliding window (so a request keeps only the window's KV)."""
        return all(self.window(i) is not None for i in range(self.num_layers))

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dictionary."""
        archs = cfg.get("architectures") or []
        supported = supported_architectures()
        family = next((supported[a] for a in archs if a in supported), None)
        if family is None and not archs and cfg.get("model_type") in supported.values():
            family = cfg["model_type"]
        if family is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                f"radixlm runs {sorted(supported)}"
            )
        if isinstance(cfg.get("text_config"), dict) and "num_attention_heads" not in cfg:  # a vision-language checkpoint: its text model
            tied = cfg.get("tie_word_embeddings", cfg["text_config"].get("tie_word_embeddings", False))  # the outer config's governs
            cfg = {**cfg["text_config"], "architectures": archs, "tie_word_embeddings": tied}
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        mla = _mla_spec(cfg, family)
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        global_rope, local_rope = _rope_by_layer_type(cfg)
        local_theta, local_scaling = (None, None) if local_rope is None else (_rope_theta(local_rope), _rope_scaling(local_rope, cfg))
        return cls(
            architecture=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],  # (Qwen3.5-MoE: experts only)
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            # MLA: the heads split across ranks as query heads; RoPE turns each head's qk_rope_head_dim dims
            num_kv_heads=num_heads if mla is not None else cfg.get("num_key_value_heads") or num_heads,
            head_dim=mla.qk_rope_head_dim if mla is not None else cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(global_rope),
            rope_scaling=_rope_scaling(global_rope, cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_proj_bias=family == "gpt_oss" and bool(cfg.get("attention_bias", True)),
            sliding_window=_sliding_window(cfg),
            layer_types=_layer_types(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=_dtype_name(cfg.get("torch_dtype") or cfg.get("dtype")),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
            no_rope_layers=list(cfg["no_rope_layers"]) if cfg.get("no_rope_layers") else None,
            partial_rotary_factor=float(_rope_field(global_rope, "partial_rotary_factor", 1.0)),
            moe=MoEConfig.from_hf_dict(cfg, family),
            mla=mla,
            mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0) if family == "deepseek_v3" else 0,
            linear=_linear_spec(cfg),
        )


def _linear_spec(cfg: dict[str, Any]) -> GatedDeltaSpec | None:
    """The Gated DeltaNet shapes of a hybrid config (None where no layer is ``linear_attention``)."""
    if "linear_attention" not in (cfg.get("layer_types") or []):
        return None
    return GatedDeltaSpec(
        num_k_heads=cfg["linear_num_key_heads"],
        num_v_heads=cfg["linear_num_value_heads"],
        head_k_dim=cfg["linear_key_head_dim"],
        head_v_dim=cfg["linear_value_head_dim"],
        conv_kernel=cfg.get("linear_conv_kernel_dim") or 4,
    )


def _mla_spec(cfg: dict[str, Any], family: str) -> MLASpec | None:
    """The multi-head latent attention of a DeepSeek config (None for every other attention).

    DeepSeek-V2 always rotates its RoPE dims in interleaved pairs; V3 does where ``rope_interleave``
    says so (the default, and every published checkpoint)."""
    if not family.startswith("deepseek") or not cfg.get("kv_lora_rank"):
        return None
    return MLASpec(
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        q_lora_rank=cfg.get("q_lora_rank") or None,
        rope_interleave=family == "deepseek_v2" or bool(cfg.get("rope_interleave", True)),
    )


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """The window of the sliding layers; None when no layer slides."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return None
    types = cfg.get("layer_types")
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


def _layer_types(cfg: dict[str, Any]) -> list[str] | None:
    """Each layer's attention kind, where the config lists them (older configs: every layer the same)."""
    types = cfg.get("layer_types")
    return list(types) if types else None


def _rope_by_layer_type(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The RoPE settings of the full-attention layers, and the sliding layers' own (or None).

    transformers 5 writes ``rope_parameters`` keyed by layer type where they differ (Gemma 3);
    older Gemma 3 configs say ``rope_local_base_freq`` for the sliding layers, whose RoPE is
    unscaled; everything else has one setting for all layers.
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        return {**cfg, "rope_parameters": params["full_attention"]}, {**cfg, "rope_parameters": params.get("sliding_attention") or {}}
    if cfg.get("rope_local_base_freq") is not None:
        return cfg, {"rope_theta": cfg["rope_local_base_freq"]}
    return cfg, None


def _rope_field(cfg: dict[str, Any], name: str, default: Any) -> Any:
    """A RoPE setting from the config's top level, else from its ``rope_parameters``."""
    if cfg.get(name) is not None:
        return cfg[name]
    params = cfg.get("rope_parameters") or {}
    return params.get(name, default)


def _rope_theta(cfg: dict[str, Any]) -> float:
    return float(_rope_field(cfg, "rope_theta", 10000.0))


def _rope_scaling(rope: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE scaling dict (with ``rope_type``), or None for plain RoPE; a longrope's original
    context length is taken from the config's top level where the scaling dict lacks it."""
    scaling = rope.get("rope_scaling") or rope.get("rope_parameters") or None
    if scaling is None:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    scaling = {**scaling, "rope_type": kind}
    if "original_max_position_embeddings" not in scaling and cfg.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return scaling


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    return str(value).replace("torch.", "")
