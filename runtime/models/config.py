"""ModelConfig: the architecture facts the engine needs, read from a HF config or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.models.registry import supported_architectures


@dataclass
class ModelConfig:
    """Shapes and hyper-parameters of a Llama-family decoder."""

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
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None

    @property
    def context_length(self) -> int:
        """Longest sequence the model attends over (a sliding window caps it)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

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
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(
            architecture=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=_dtype_name(cfg.get("torch_dtype") or cfg.get("dtype")),
        )


def _rope_theta(cfg: dict[str, Any]) -> float:
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
    if scaling is None:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return None if kind == "default" else {**scaling, "rope_type": kind}


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    return str(value).replace("torch.", "")
