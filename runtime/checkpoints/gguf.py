"""GGUF files: the config from their metadata, tensor names mapped to Hugging Face's, and the
weights either as stored (quantized blocks, ``GGUFWeight``) or dequantized once into the disk cache.

A mixture of experts' merged expert tensors ([experts, rows, columns]) are split into one weight
per expert and projection, as a Hugging Face checkpoint holds them; a quantized one's rows stay
the blocks they are (a row of blocks is a row of the matrix). What the converter changed in the
hybrid families is undone in ``gguf_hybrid``, in DeepSeek-V2/V3 (its split ``kv_b_proj``) in
``gguf_deepseek``."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from tqdm.auto import tqdm

from radixlm.runtime.checkpoints.base import Checkpoint
from radixlm.runtime.checkpoints.folder import safetensors_tensors
from radixlm.runtime.checkpoints.gguf_deepseek import (
    deepseek_config,
    deepseek_experts,
    deepseek_weights,
)
from radixlm.runtime.checkpoints.gguf_hybrid import (
    HYBRID_ARCHITECTURES,
    hybrid_config,
    hybrid_weights,
)
from radixlm.runtime.checkpoints.gguf_names import (
    ARCHITECTURES,
    EXPERT_ARCHITECTURES,
    ROPE_PERMUTED,
    WITH_EXPERTS,
    gguf_expert_names,
    gguf_to_hf_name,
    is_router,
    is_shifted_norm,
)
from radixlm.runtime.disk_cache import entry_for, write_entry
from radixlm.runtime.layers.gguf_linear import GGUFWeight
from radixlm.runtime.models.config import ModelConfig

if TYPE_CHECKING:
    from gguf import GGUFReader

logger = logging.getLogger(__name__)

__all__ = ["gguf_config", "gguf_hf_config", "gguf_to_hf_name", "open_gguf", "unpermute_rope_rows"]

DENSE_TYPES = (0, 1, 30)  # F32, F16, BF16: loaded as plain tensors


def gguf_reader(path: str) -> GGUFReader:
    """A ``gguf.GGUFReader`` over the file (memory-mapped)."""
    from gguf import GGUFReader

    return GGUFReader(path)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that reads back as it (1e-06, not
    9.99999997e-07): the number the Hugging Face config held, where that was a float32's."""
    return float(str(np.float32(value)))


def gguf_hf_config(path: str, reader: GGUFReader | None = None) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dictionary (transformers 5 names) a GGUF file describes:
    its metadata, llama.cpp's fixed rules where the file says nothing (Gemma's layer patterns
    and attention scale, SmolLM3's RoPE-less layers, the hybrids' linear-attention layers,
    DeepSeek's family from its router), and Phi-3's longrope factor tensors."""
    r = reader or gguf_reader(path)
    arch = _field(r, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; radixlm runs {', '.join(ARCHITECTURES)}")

    def get(key: str, default=None):
        return _field(r, f"{arch}.{key}", default)

    tensors = {t.name: t for t in r.tensors}
    experts = int(get("expert_count") or 0)
    if experts and arch not in EXPERT_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} with experts; radixlm runs experts of {', '.join(sorted(EXPERT_ARCHITECTURES))}")
    if not experts and arch in ("qwen3moe", "qwen3next", "qwen35moe", "deepseek2"):
        raise ValueError(f"GGUF file of architecture {arch!r} without {arch}.expert_count")
    hidden, heads, layers = int(get("embedding_length")), int(get("attention.head_count")), int(get("block_count"))
    partial_rope = arch == "phi3" or arch in HYBRID_ARCHITECTURES  # rope.dimension_count: part of a head
    head_dim = get("attention.key_length") or (None if partial_rope else get("rope.dimension_count")) or hidden // heads
    embed = tensors.get("token_embd.weight")
    vocab = int(embed.shape[1]) if embed is not None else get("vocab_size") or len(_field(r, "tokenizer.ggml.tokens", []))
    hf_class, model_type = WITH_EXPERTS[arch] if experts and arch in WITH_EXPERTS else ARCHITECTURES[arch]
    dense_width = get("feed_forward_length")  # Qwen3.5-MoE's files have none: every layer is experts
    if dense_width is None and arch != "qwen35moe":
        raise ValueError(f"GGUF file of architecture {arch!r} without {arch}.feed_forward_length")
    cfg: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": None if dense_width is None else int(dense_width),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": any(f"blk.0.{t}.bias" in tensors for t in ("attn_q", "attn_qkv", "attn_kv_a_mqa")),
        "rope_parameters": _rope_parameters(get, _f32(get("rope.freq_base", 10000.0))),
        **_tokens(r),
    }
    if arch in ("gemma2", "gemma3"):
        cfg.update(_gemma(arch, get, cfg))
    elif arch == "phi3":
        cfg.update(_phi3(get, tensors, cfg))
    elif arch == "smollm3":  # llama.cpp: every 4th layer without RoPE (a fixed step, no key)
        cfg.update(no_rope_layer_interval=4, no_rope_layers=[int((i + 1) % 4 != 0) for i in range(layers)],
                   use_sliding_window=False, sliding_window=None)  # fmt: skip
    elif arch in ("qwen3", "qwen3moe"):
        cfg.update(use_sliding_window=False, sliding_window=None)
    elif arch == "gpt-oss":
        cfg.update(_gpt_oss(get, cfg))
    elif arch in HYBRID_ARCHITECTURES:
        cfg.update(hybrid_config(arch, get, cfg))
    elif arch == "deepseek2":
        cfg.update(deepseek_config(get, cfg))
    if experts:
        cfg.update(_experts(arch, get, cfg, experts))
    if "hidden_activation" not in cfg:  # Gemma names its GELU so; the rest run SiLU
        cfg["hidden_act"] = "silu"
    if cfg["intermediate_size"] is None:
        del cfg["intermediate_size"]
    if arch in ("phi3", "smollm3"):  # their HF configs derive head_dim (hidden / heads)
        del cfg["head_dim"]
    if arch == "phi3" or model_type == "mixtral":  # and Phi-3's and Mixtral's have no biases to name
        del cfg["attention_bias"]
    if model_type == "mixtral" and get("attention.key_length") is None and cfg["head_dim"] == hidden // heads:
        cfg["head_dim"] = None  # Mixtral's config leaves it unset (the converter then writes no key_length)
    return cfg


def _one_for_all_layers(value, key: str) -> int:
    """A count llama.cpp reads as one value or one per layer (``get_key_or_arr``), which radixlm
    takes only when every layer has the same."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF key {key} differs between layers ({value}); radixlm takes one value for every layer")
        value = value[0]
    return int(value)


def _experts(arch: str, get, cfg: dict[str, Any], experts: int) -> dict[str, Any]:
    """The experts as the HF config names them. llama.cpp routes Mixtral and the Qwen families by
    softmax, top k, renormalised (``build_moe_ffn(..., norm_w=true, ...)``), on every layer;
    Mixtral's experts are ``feed_forward_length`` wide, the others' ``expert_feed_forward_length``
    (else, as llama.cpp, the feed-forward length over the experts used; DeepSeek's files must
    say). DeepSeek's routers are ``gguf_deepseek``'s."""
    used = get("expert_used_count")
    if not used:
        raise ValueError(f"GGUF file of architecture {arch!r} with {experts} experts and no {arch}.expert_used_count")
    used = _one_for_all_layers(used, f"{arch}.expert_used_count")
    if arch == "llama":
        return {"num_local_experts": experts, "num_experts_per_tok": used, "sliding_window": None}
    if arch == "gpt-oss":  # its intermediate_size is an expert's width
        width = _one_for_all_layers(get("expert_feed_forward_length") or cfg["intermediate_size"], f"{arch}.expert_feed_forward_length")
        return {"num_local_experts": experts, "num_experts_per_tok": used, "intermediate_size": width}
    width = get("expert_feed_forward_length")
    if width is None and arch == "deepseek2":
        raise ValueError(f"GGUF file of architecture {arch!r} without {arch}.expert_feed_forward_length")
    width = cfg["intermediate_size"] // used if width is None else _one_for_all_layers(width, f"{arch}.expert_feed_forward_length")
    if arch == "deepseek2":
        return deepseek_experts(get, experts, used, width)
    out = {"num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": width}
    if arch != "qwen35moe":  # (Qwen3.5-MoE's config has no such keys: experts on every layer, always renormalised)
        out.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return out


def _gpt_oss(get, cfg: dict[str, Any]) -> dict[str, Any]:
    """GPT-OSS's keys llama.cpp does not store, as it runs them: a sliding window on every other
    layer (the first slides; ``set_swa_pattern(2)``), the SwiGLU clamp at 7 (``swiglu_limit``),
    and YaRN without rounding its correction range (``truncate``: false, as GPT-OSS's config says)."""
    window = int(get("attention.sliding_window") or 0) or None
    rope = cfg["rope_parameters"]
    if rope.get("rope_type") == "yarn":
        rope = {**rope, "truncate": False}
    return {"sliding_window": window, "layer_types": _layer_types(cfg["num_hidden_layers"], 2, window), "swiglu_limit": 7.0, "rope_parameters": rope}


def _tokens(reader) -> dict[str, Any]:
    """bos/pad ids, and the end-of-generation ids (eos, then end of turn and of message)."""
    ids = {k: _field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "eot", "eom", "padding")}
    ends = list(dict.fromkeys(int(ids[k]) for k in ("eos", "eot", "eom") if ids[k] is not None))
    out: dict[str, Any] = {"bos_token_id": ids["bos"], "eos_token_id": ends[0] if len(ends) == 1 else ends or None}
    if ids["padding"] is not None:
        out["pad_token_id"] = ids["padding"]
    return out


def _rope_parameters(get, theta: float) -> dict[str, Any]:
    """RoPE base and scaling (linear, yarn) as transformers' ``rope_parameters``."""
    kind, factor = get("rope.scaling.type"), get("rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": _f32(factor), "rope_theta": theta}
    if kind == "yarn" and factor:
        params = {"rope_type": "yarn", "factor": _f32(factor), "rope_theta": theta,
                  "original_max_position_embeddings": int(get("rope.scaling.original_context_length"))}  # fmt: skip
        for key, name in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if get(f"rope.scaling.{key}") is not None:
                params[name] = _f32(get(f"rope.scaling.{key}"))
        return params
    return {"rope_type": "default", "rope_theta": theta}


def _layer_types(layers: int, pattern: int | list, window: int | None) -> list[str]:
    """llama.cpp's sliding-window layers: a per-layer flag list, or ``n``: the last of every n
    layers global, the rest sliding (``set_swa_pattern``); all global without a window."""
    if not window:
        return ["full_attention"] * layers
    if isinstance(pattern, list):
        slides = [bool(x) for x in pattern]
    else:
        slides = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in slides]


def _gemma(arch: str, get, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2/3: layer pattern (2, 3: 6), window, soft-caps, query scale, per-layer-type RoPE."""
    layers, window = cfg["num_hidden_layers"], get("attention.sliding_window")
    if arch == "gemma2":
        window = 4096 if window is None else window  # llama.cpp's default for Gemma 2
    window = int(window) if window else None
    big = layers == (46 if arch == "gemma2" else 62)  # llama.cpp: the 27B models scale by hidden / heads
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": window,
        "layer_types": _layer_types(layers, get("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6), window),
        "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"],
        "final_logit_softcapping": _f32(get("final_logit_softcapping", 30.0 if arch == "gemma2" else 0.0)) or None,
        "attn_logit_softcapping": _f32(get("attn_logit_softcapping", 50.0)) if arch == "gemma2" else None,
        "tie_word_embeddings": cfg["tie_word_embeddings"] or arch == "gemma2",
    }
    if arch == "gemma3":  # local layers: their own base (llama.cpp's default 10000), never scaled
        local = {"rope_type": "default", "rope_theta": _f32(get("rope.freq_base_swa", 10000.0))}
        out["rope_parameters"] = {"sliding_attention": local, "full_attention": cfg["rope_parameters"]}
    return out


def _phi3(get, tensors: dict, cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3: original context, the share of each head RoPE turns, longrope factor tensors, window."""
    original = int(get("rope.scaling.original_context_length") or cfg["max_position_embeddings"])
    rotary = get("rope.dimension_count")
    rope = {**cfg["rope_parameters"], "partial_rotary_factor": rotary / cfg["head_dim"] if rotary else 1.0}
    if "rope_factors_long.weight" in tensors:
        factors = {k: [_f32(v) for v in np.asarray(tensors[f"rope_factors_{k}.weight"].data, np.float32)] for k in ("long", "short")}
        rope.update(rope_type="longrope", long_factor=factors["long"], short_factor=factors["short"], original_max_position_embeddings=original)
    window = get("attention.sliding_window")
    return {"original_max_position_embeddings": original, "rope_parameters": rope, "sliding_window": int(window) if window else None}


def gguf_config(path: str, reader: GGUFReader | None = None) -> ModelConfig:
    """The architecture a GGUF file's metadata describes."""
    return ModelConfig.from_hf_dict(gguf_hf_config(path, reader))


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row order on a q or k projection (rows = heads × dim);
    rows move whole, so a quantized tensor's rows of blocks move the same way."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _in_hf_form(name: str, arr: np.ndarray, arch: str, cfg: dict[str, Any]) -> np.ndarray:
    """A tensor (or its rows of blocks) as Hugging Face has it: q/k rows back in HF's RoPE order
    (Llama-style architectures), Gemma norms back from ``1 + w`` to ``w`` (in float32)."""
    if arch in ROPE_PERMUTED and name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
        return unpermute_rope_rows(arr, heads)
    if is_shifted_norm(name, arch):
        return arr.astype(np.float32) - np.float32(1)
    return arr


class _Weight(NamedTuple):
    """One Hugging Face tensor's data in a GGUF file: its values, or its rows of blocks."""

    gguf_name: str  # the file's tensor (a merged expert tensor for each of its experts)
    hf_name: str
    qtype: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # [rows, columns] (float types), [rows, row bytes] (quantized), or 1-D
    in_features: int


def _weights(path: str, reader) -> tuple[dict[str, Any], str, list[_Weight]]:
    """The file's HF config, its architecture, and each weight under its HF name, merged expert
    tensors split into one weight per expert and projection (views of the file, not copies; a
    hybrid's tensors and DeepSeek's ``kv_b_proj`` in Hugging Face's form, ``gguf_hybrid`` and
    ``gguf_deepseek``), layers past the model's (MTP) left out."""
    cfg = gguf_hf_config(path, reader)
    arch = _field(reader, "general.architecture")
    by_name = {t.name: t for t in reader.tensors}
    weights = []
    for t in reader.tensors:
        block = t.name.split(".")
        if block[0] == "blk" and int(block[1]) >= cfg["num_hidden_layers"]:
            continue
        parts = gguf_expert_names(t.name, arch)
        if parts is not None:
            weights.extend(_split_experts(t, parts, cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0))
            continue
        if arch in HYBRID_ARCHITECTURES:
            weights.extend(_Weight(t.name, hf, qtype, data, int(t.shape[0])) for hf, qtype, data in hybrid_weights(t.name, t.tensor_type, t.data, arch, cfg))
            continue
        if arch == "deepseek2":  # (a rebuilt kv_b_proj's columns are its values' last axis, not its sources')
            weights.extend(_Weight(t.name, hf, qtype, data, int(data.shape[-1]) if int(qtype) in DENSE_TYPES else int(t.shape[0]))
                           for hf, qtype, data in deepseek_weights(t.name, t.tensor_type, t.data, by_name))  # fmt: skip
            continue
        hf = gguf_to_hf_name(t.name, arch)
        if hf is not None:
            weights.append(_Weight(t.name, hf, t.tensor_type, t.data, int(t.shape[0])))
    return cfg, arch, weights


def _split_experts(t, parts: tuple[str, ...], experts: int) -> list[_Weight]:
    """A merged expert tensor (data [experts, rows, columns or row bytes]) as one weight per
    expert and part (``parts``: HF name formats; several share the rows equally, in order)."""
    data = t.data
    if data.ndim == 2 and data.shape[0] == experts and len(parts) == 1:  # GPT-OSS's expert biases [experts, rows]
        return [_Weight(t.name, parts[0].format(expert=e), t.tensor_type, data[e], int(t.shape[0])) for e in range(experts)]
    if data.ndim != 3 or data.shape[0] != experts or data.shape[1] % len(parts):
        raise ValueError(f"GGUF tensor {t.name} of shape {tuple(int(n) for n in t.shape)} does not hold {experts} experts' {len(parts)} projection(s)")
    rows = data.shape[1] // len(parts)
    return [_Weight(t.name, name.format(expert=e), t.tensor_type, data[e, i * rows : (i + 1) * rows], int(t.shape[0]))
            for e in range(experts) for i, name in enumerate(parts)]  # fmt: skip


def open_gguf(path: str, native: bool = True) -> Checkpoint:
    """The file as a checkpoint: quantized tensors as stored (``native``), or every tensor
    dequantized to float32 (kept in the disk cache, so tensor-parallel ranks read their slices)."""
    if not native:
        return _dequantized(path)
    from gguf.quants import dequantize

    hf_cfg, arch, weights = _weights(path, gguf_reader(path))
    plain: list[tuple[str, torch.Tensor]] = []
    stored: dict[str, GGUFWeight] = {}
    for w in tqdm(weights, desc="Reading weights", unit="tensor", leave=False):
        # a shift needs the values, not the blocks; a router is a plain parameter (never quantized)
        if int(w.qtype) in DENSE_TYPES or is_shifted_norm(w.gguf_name, arch) or is_router(w.gguf_name):
            arr = _in_hf_form(w.gguf_name, dequantize(w.data, w.qtype), arch, hf_cfg)
            plain.append((w.hf_name, torch.from_numpy(np.array(arr, copy=True))))
        else:
            blocks = np.array(_in_hf_form(w.gguf_name, w.data, arch, hf_cfg), dtype=np.uint8, copy=True)
            stored[w.hf_name] = GGUFWeight(int(w.qtype), torch.from_numpy(blocks), w.in_features)
    return Checkpoint(ModelConfig.from_hf_dict(hf_cfg), lambda: iter(plain), stored, os.path.getsize(path))


def _dequantized_tensors(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The file's HF config, and its weights dequantized to float32 under HF names."""
    from gguf.quants import dequantize

    hf_cfg, arch, weights = _weights(path, gguf_reader(path))
    tensors = {}
    for w in tqdm(weights, desc="Loading weights", unit="tensor", leave=False):
        arr = _in_hf_form(w.gguf_name, dequantize(w.data, w.qtype), arch, hf_cfg)
        tensors[w.hf_name] = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
    return hf_cfg, tensors


@functools.cache
def _loader_digest() -> str:
    """A digest of the code that turns GGUF tensors into HF ones: a cached dequantization made by
    other code (an older radixlm) is never served."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("gguf*.py")):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def _dequantized(path: str) -> Checkpoint:
    """Config and weights of a GGUF file, dequantized once and kept in the disk cache."""
    entry = entry_for(path, f"weights-{_loader_digest()}")
    size = os.path.getsize(path)
    if (entry / "config.json").is_file() and (entry / "model.safetensors").is_file():
        try:
            cfg = ModelConfig.from_hf_dict(json.loads((entry / "config.json").read_text()))
            return Checkpoint(cfg, lambda: safetensors_tensors(str(entry)), {}, size)
        except (OSError, TypeError, ValueError, KeyError) as exc:
            logger.warning("ignoring unreadable weight cache %s: %s", entry, exc)
    hf_cfg, tensors = _dequantized_tensors(path)

    def fill(tmp: Path) -> None:
        from safetensors.torch import save_file

        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(hf_cfg))

    if not write_entry(entry, fill):
        logger.warning("could not cache dequantized weights in %s", entry)
    items: list[tuple[str, Any]] = list(tensors.items())
    return Checkpoint(ModelConfig.from_hf_dict(hf_cfg), lambda: iter(items), {}, size)
