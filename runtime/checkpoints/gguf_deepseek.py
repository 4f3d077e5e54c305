"""GGUF files of DeepSeek-V2 and V3 (llama.cpp's ``deepseek2``), as llama.cpp's converter writes
them (``DeepseekV2Model``): the Hugging Face config their metadata describes, and the latent
attention's ``kv_b_proj`` back in the form the Hugging Face checkpoint holds it. Every other
tensor is the checkpoint's as it was (names in ``gguf_names``; experts merged, split by ``gguf.py``).

What the converter changed, undone here:

- ``kv_b_proj`` (``[heads × (nope + v), kv_lora_rank]``) is written split per head, for
  llama.cpp's absorbed attention: ``attn_k_b`` holds each head's nope rows transposed
  (``[heads, kv_lora_rank, nope]``), ``attn_v_b`` its value rows (``[heads, v, kv_lora_rank]``).
  Both are dequantized and joined back (a transpose moves single weights across blocks, so no
  block survives it; the model keeps ``kv_b_proj`` as a plain weight in any case). Files written
  before the split (llama.cpp's "legacy" form, without ``attention.key_length_mla``) hold it
  whole as ``attn_kv_b``: dequantized too, for the same reason;
- ``head_count_kv`` is written as 1 and ``key_length``/``value_length`` as the latent row's widths
  (MLA run as MQA); the heads' widths are in ``key_length_mla``/``value_length_mla`` (in a legacy
  file, in ``key_length``/``value_length``). DeepSeek's configs name as many KV heads as heads;
- YaRN's ``mscale_all_dim`` is stored as ``rope.scaling.yarn_log_multiplier``, 0.1 times it.

The RoPE rows of ``q_proj``/``q_b_proj`` and ``kv_a_proj_with_mqa`` are not reordered by the
converter (llama.cpp rotates adjacent pairs, as the checkpoint's interleaved layout does): they are
the checkpoint's, and the model reorders them at load as it does a Hugging Face checkpoint's.

What the file does not record, taken as llama.cpp takes it (every published DeepSeek-V2/V3 config
agrees): YaRN's ``mscale`` equals ``mscale_all_dim``; the RoPE is interleaved
(``rope_interleave``); experts sit on every layer after the ``leading_dense_block_count`` dense
ones (``moe_layer_freq`` 1). The router's rule decides the family: sigmoid scores
(``expert_gating_func`` 2) are V3's (``noaux_tc``: the correction bias ``exp_probs_b``, groups
ranked by their best two); softmax (1, or no key: llama.cpp's default for older files) is V2's,
``group_limited_greedy`` where the experts form several groups and ``greedy`` where one (V2-Lite).
llama.cpp ranks V2's groups by their best two as well; transformers ranks them by their best
expert, and so does radixlm (the file came from that checkpoint). The multi-token-prediction
layers (``nextn_predict_layers`` blocks after the model's) are left out. Other models llama.cpp
writes as ``deepseek2`` read as DeepSeek-V2/V3 too; a query temperature (Mistral's
``attention.temperature_scale``), which DeepSeek has not, is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import numpy as np

from radixlm.runtime.checkpoints.gguf_names import gguf_to_hf_name

ARCH = "deepseek2"
SOFTMAX, SIGMOID = 1, 2  # llama.cpp's expert_gating_func values


def _required(get: Callable[..., Any], key: str) -> Any:
    """The value of ``key``, which llama.cpp requires of a ``deepseek2`` file."""
    value = get(key)
    if value is None:
        raise ValueError(f"GGUF file of architecture {ARCH!r} without {ARCH}.{key}")
    return value


def _mscale(log_multiplier: float) -> float:
    """YaRN's ``mscale_all_dim`` from ``yarn_log_multiplier`` (0.1 times it, stored as float32):
    the shortest decimal that reads back as the stored value, times ten."""
    return float(Decimal(str(np.float32(log_multiplier))).scaleb(1))


def deepseek_config(get: Callable[..., Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """The config fields of a ``deepseek2`` file's latent attention and RoPE (``cfg``: the
    architecture-independent ones); the experts' are ``deepseek_experts``'."""
    if get("attention.temperature_scale"):
        raise ValueError(f"GGUF key {ARCH}.attention.temperature_scale (a query temperature, Mistral's) is set; radixlm reads {ARCH} files as DeepSeek-V2/V3, which have none")
    rope_dim = int(_required(get, "rope.dimension_count"))
    if get("attention.key_length_mla") is not None:  # the heads' widths; key_length is the latent row's
        key, value = int(get("attention.key_length_mla")), int(_required(get, "attention.value_length_mla"))
    else:  # a legacy file: the heads' widths in the plain keys
        key, value = int(_required(get, "attention.key_length")), int(_required(get, "attention.value_length"))
    q_rank = get("attention.q_lora_rank")
    rope = dict(cfg["rope_parameters"])
    if rope["rope_type"] == "yarn" and get("rope.scaling.yarn_log_multiplier") is not None:
        mscale = _mscale(get("rope.scaling.yarn_log_multiplier"))
        rope.update(mscale=mscale, mscale_all_dim=mscale)
    return {
        "num_hidden_layers": cfg["num_hidden_layers"] - int(get("nextn_predict_layers") or 0),
        "num_key_value_heads": cfg["num_attention_heads"],
        "head_dim": rope_dim,  # transformers' DeepSeek configs: the RoPE part of a head
        "kv_lora_rank": int(_required(get, "attention.kv_lora_rank")),
        "q_lora_rank": None if q_rank is None else int(q_rank),
        "qk_nope_head_dim": key - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": value,
        "rope_parameters": rope,
    }


def deepseek_experts(get: Callable[..., Any], experts: int, used: int, width: int) -> dict[str, Any]:
    """The config fields of a ``deepseek2`` file's experts and router, and the family the router's
    rule makes it (V3 for sigmoid scores, else V2)."""
    gating = int(get("expert_gating_func") or SOFTMAX)
    if gating not in (SOFTMAX, SIGMOID):
        raise ValueError(f"GGUF key {ARCH}.expert_gating_func is {gating}; radixlm runs DeepSeek's softmax (1) and sigmoid (2) routers")
    groups, groups_used = int(get("expert_group_count") or 1), int(get("expert_group_used_count") or 1)
    out: dict[str, Any] = {
        "n_routed_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": width,
        "n_shared_experts": int(_required(get, "expert_shared_count")),
        "first_k_dense_replace": int(get("leading_dense_block_count") or 0),
        "routed_scaling_factor": float(str(np.float32(get("expert_weights_scale") or 1.0))),
        "norm_topk_prob": bool(get("expert_weights_norm") or False),
        "n_group": groups,
        "topk_group": groups_used,
    }
    if gating == SIGMOID:
        out.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", scoring_func="sigmoid", topk_method="noaux_tc")
    else:
        out.update(scoring_func="softmax", topk_method="group_limited_greedy" if groups > 1 else "greedy")
    return out


def deepseek_weights(name: str, qtype: Any, data: np.ndarray, tensors: dict[str, Any]) -> list[tuple[str, Any, np.ndarray]]:
    """The Hugging Face tensors ``(name, GGML type, data)`` the file's tensor ``name`` holds
    (``data``: values, or rows of blocks; ``tensors``: the file's, by name): ``kv_b_proj`` rebuilt
    from ``attn_k_b`` and its layer's ``attn_v_b`` (which gives none itself) or read whole from
    ``attn_kv_b``, in F32; the rest as stored."""
    from gguf import GGMLQuantizationType

    parts = name.split(".")
    kind = parts[2] if parts[0] == "blk" and len(parts) == 4 else ""
    if kind not in ("attn_k_b", "attn_v_b", "attn_kv_b"):
        hf = gguf_to_hf_name(name, ARCH)
        return [] if hf is None else [(hf, qtype, data)]
    if kind == "attn_v_b":
        return []
    kv_b = f"model.layers.{parts[1]}.self_attn.kv_b_proj.weight"
    if kind == "attn_kv_b":
        return [(kv_b, GGMLQuantizationType.F32, _values(data, qtype))]
    v_b = tensors.get(f"blk.{parts[1]}.attn_v_b.weight")
    if v_b is None:
        raise ValueError(f"GGUF file holds {name} without blk.{parts[1]}.attn_v_b.weight: kv_b_proj cannot be rebuilt")
    return [(kv_b, GGMLQuantizationType.F32, joined_kv_b(_values(data, qtype), _values(v_b.data, v_b.tensor_type)))]


def joined_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """``kv_b_proj`` ``[heads × (nope + v), rank]`` from ``k_b`` ``[heads, rank, nope]`` (each
    head's nope rows, transposed) and ``v_b`` ``[heads, v, rank]``: per head, nope rows then v rows."""
    heads, rank = v_b.shape[0], v_b.shape[2]
    if k_b.ndim != 3 or k_b.shape[:2] != (heads, rank):
        raise ValueError(f"attn_k_b of shape {k_b.shape} does not pair with attn_v_b of shape {v_b.shape}")
    return np.ascontiguousarray(np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, rank))


def _values(data: np.ndarray, qtype: Any) -> np.ndarray:
    """A tensor's values in float32 (from values or blocks)."""
    from gguf.quants import dequantize

    return np.asarray(dequantize(data, qtype), dtype=np.float32)
