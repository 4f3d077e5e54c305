"""GGUF files of the hybrid linear-attention families: Qwen3-Next (``qwen3next``), Qwen3.5
(``qwen35``) and Qwen3.5-MoE (``qwen35moe``), as llama.cpp's converter writes them
(``Qwen3NextModel`` and its Qwen3.5 subclasses, ``_LinearAttentionVReorderBase``): the Hugging
Face config their metadata describes, and each tensor back in the form the Hugging Face
checkpoint holds it. Qwen3.5-MoE is Qwen3.5's layers with Qwen3-Next's experts (merged expert
tensors, split by ``gguf.py``) and gated shared expert.

What the converter changed, undone here:

- every RMSNorm weight but the Gated DeltaNet's output norm (``ssm_norm``) is stored as ``1 + w``;
- ``A_log`` is stored as ``ssm_a = -exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, and the
  convolution's weight ``[C, 1, K]`` squeezed to ``[C, K]``;
- Qwen3-Next's ``in_proj_qkvz`` (per key head ``[q k v z]``) is split into ``attn_qkv`` (every q,
  every k, every v) and ``attn_gate`` (z), Qwen3.5's split as it is; files from before the split
  hold it whole as ``ssm_in``. Qwen3-Next's ``in_proj_ba`` (per key head ``[b a]``) stays whole as
  ``ssm_ba``. Both are split here into Qwen3.5's parts (rows move whole, so blocks move too);
- Qwen3.5 with more value heads than key heads: the value heads, grouped by key head in Hugging
  Face's order (``[k0: v0 v1, k1: v0 v1]``), are stored tiled (``[k0 v0, k1 v0, k0 v1, k1 v1]``):
  in the v rows of ``attn_qkv`` and ``ssm_conv1d``, the rows of ``attn_gate``, ``ssm_beta``,
  ``ssm_alpha``, ``ssm_a``, ``ssm_dt`` and the columns of ``ssm_out`` (a quantized one moves its
  blocks where a head is whole blocks, else it is dequantized);
- with ``--fuse-qkv``, a full-attention layer's q (with its output gates), k and v rows are one
  ``attn_qkv``: split here;
- the multi-token-prediction layers (``nextn_predict_layers`` blocks after the model's) are left out.

llama.cpp marks the linear-attention layers with ``attention.recurrent_layers`` (else: all but
every ``full_attention_interval``-th), and takes the value head width as the key head width
(``ssm.state_size``); the Hugging Face configs need not, so it is ``ssm.inner_size`` over the
value heads here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from radixlm.runtime.checkpoints.gguf_names import gguf_to_hf_name

HYBRID_ARCHITECTURES = frozenset({"qwen3next", "qwen35", "qwen35moe"})
_TILED = frozenset({"qwen35", "qwen35moe"})  # value heads stored tiled (``_LinearAttentionVReorderBase``)
FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16

Rows = np.ndarray | None  # the file's rows an HF tensor takes, in its order (None: all, as they are)


def hybrid_config(arch: str, get: Callable[..., Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """The config fields of a hybrid file's layers: which are linear attention, the Gated DeltaNet's
    shapes, the share of each head RoPE turns; the shared expert's width."""
    layers = cfg["num_hidden_layers"] - int(get("nextn_predict_layers") or 0)
    recurrent = get("attention.recurrent_layers")
    if recurrent is None:  # llama.cpp's rule: the last of every ``interval`` layers attends
        interval = int(get("full_attention_interval") or 4)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    values = int(get("ssm.time_step_rank"))
    rotary = get("rope.dimension_count")
    out: dict[str, Any] = {
        "num_hidden_layers": layers,
        "layer_types": ["linear_attention" if r else "full_attention" for r in list(recurrent)[:layers]],
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
        "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_num_key_heads": int(get("ssm.group_count")),
        "linear_num_value_heads": values,
        "linear_value_head_dim": int(get("ssm.inner_size")) // values,
        "rope_parameters": {**cfg["rope_parameters"], "partial_rotary_factor": int(rotary) / cfg["head_dim"] if rotary else 1.0},
    }
    if arch in ("qwen3next", "qwen35moe"):
        out["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length") or cfg.get("intermediate_size") or get("expert_feed_forward_length"))
    return out


def hybrid_weights(name: str, qtype: Any, data: np.ndarray, arch: str, cfg: dict[str, Any]) -> list[tuple[str, Any, np.ndarray]]:
    """The Hugging Face tensors ``(name, GGML type, data)`` the hybrid file's tensor ``name`` holds
    (``data``: values, or rows of blocks), in Hugging Face's form; none for tensors the model does
    not load (the caller leaves out the MTP layers'). Tensors whose values change come back
    dequantized (F32)."""
    parts = name.split(".")
    layer = int(parts[1]) if parts[0] == "blk" else -1
    kind = parts[2] if layer >= 0 else ""
    if kind == "attn_qkv" and cfg["layer_types"][layer] == "full_attention":  # --fuse-qkv: q (with its gates), k, v rows
        q, kv = 2 * cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
        rows = np.split(np.arange(q + 2 * kv), [q, q + kv])
        return [(f"model.layers.{layer}.self_attn.{p}_proj.{parts[3]}", qtype, data[r]) for p, r in zip("qkv", rows)]
    hf = gguf_to_hf_name(name, arch)
    if hf is None:
        return []
    untile = arch in _TILED and kind == "ssm_out"
    if _changes_values(kind, name) or (untile and not _columns_move_as_blocks(qtype, cfg)):
        from gguf import GGMLQuantizationType

        data, qtype = _values(data, qtype), GGMLQuantizationType.F32
    data = _in_hf_values(kind, name, data)
    if untile:
        data = _untiled_columns(data, cfg)
    prefix = f"model.layers.{layer}.linear_attn."
    return [(part, qtype, data if rows is None else data[rows]) for part, rows in _row_parts(kind, hf, prefix, arch, cfg)]


def _changes_values(kind: str, name: str) -> bool:
    return kind in ("ssm_a", "ssm_conv1d", "ffn_gate_inp_shexp") or _shifted_norm(kind, name)


def _shifted_norm(kind: str, name: str) -> bool:
    """Stored as ``1 + w``: every norm but the DeltaNet's output norm."""
    return name.endswith("norm.weight") and kind != "ssm_norm"


def _values(data: np.ndarray, qtype: Any) -> np.ndarray:
    from gguf.quants import dequantize

    return np.asarray(dequantize(data, qtype), dtype=np.float32)


def _in_hf_values(kind: str, name: str, data: np.ndarray) -> np.ndarray:
    """Values as Hugging Face has them: ``A_log`` from ``-exp(A_log)``, norms without the 1, the
    convolution's ``[C, 1, K]``, the shared expert's gate as a ``[1, hidden]`` matrix."""
    if kind == "ssm_a":
        return np.log(-data.astype(np.float32))
    if _shifted_norm(kind, name):
        return data.astype(np.float32) - np.float32(1)
    if kind == "ssm_conv1d":
        return data.reshape(data.shape[0], 1, -1)
    if kind == "ffn_gate_inp_shexp":
        return data.reshape(1, -1)
    return data


def _heads(cfg: dict[str, Any]) -> tuple[int, int]:
    """Key heads, and value heads per key head."""
    keys = cfg["linear_num_key_heads"]
    return keys, cfg["linear_num_value_heads"] // keys


def _grouped(heads: int, per: int, width: int) -> np.ndarray:
    """Indices taking tiled value heads (``[v0 of each key head, v1 of each ...]``, ``width`` each)
    into Hugging Face's grouped order (each key head's value heads together)."""
    return np.arange(heads * per * width).reshape(per, heads, width).transpose(1, 0, 2).reshape(-1)


def _columns_move_as_blocks(qtype: Any, cfg: dict[str, Any]) -> bool:
    """True where ``ssm_out``'s column reorder can move its data as stored (no reorder, a float
    type, or a value head of whole blocks)."""
    from gguf.constants import GGML_QUANT_SIZES

    if _heads(cfg)[1] == 1 or int(qtype) in FLOAT_TYPES:
        return True
    return cfg["linear_value_head_dim"] % GGML_QUANT_SIZES[qtype][0] == 0


def _untiled_columns(data: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """``ssm_out`` (values, or rows of blocks with whole blocks a head) with its input columns
    back in grouped value-head order."""
    heads, per = _heads(cfg)
    if per == 1:
        return data
    order = _grouped(heads, per, 1)
    return data.reshape(data.shape[0], heads * per, -1)[:, order].reshape(data.shape)


def _row_parts(kind: str, hf: str, prefix: str, arch: str, cfg: dict[str, Any]) -> list[tuple[str, Rows]]:
    """The HF tensors a GGUF tensor's rows make and the rows each takes: Qwen3-Next's ``ssm_ba``
    and ``ssm_in`` split into Qwen3.5's parts, Qwen3.5's tiled value heads back in grouped order."""
    heads, per = _heads(cfg)
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    keys = 2 * heads * dk  # q and k rows before the v rows
    if arch == "qwen3next" and kind == "ssm_ba":  # per key head [b (per rows), a (per rows)]
        rows = np.arange(heads * 2 * per).reshape(heads, 2, per)
        return [(f"{prefix}in_proj_b.weight", rows[:, 0].reshape(-1)), (f"{prefix}in_proj_a.weight", rows[:, 1].reshape(-1))]
    if arch == "qwen3next" and kind == "ssm_in":  # per key head [q (dk), k (dk), v (per * dv), z (per * dv)]
        rows = np.arange(heads * (2 * dk + 2 * per * dv)).reshape(heads, -1)
        q, k, v, z = np.split(rows, np.cumsum([dk, dk, per * dv]), axis=1)
        return [(f"{prefix}in_proj_qkv.weight", np.concatenate([q.reshape(-1), k.reshape(-1), v.reshape(-1)])), (f"{prefix}in_proj_z.weight", z.reshape(-1))]
    if arch not in _TILED or per == 1:
        return [(hf, None)]
    if kind in ("attn_qkv", "ssm_conv1d"):
        return [(hf, np.concatenate([np.arange(keys), keys + _grouped(heads, per, dv)]))]
    if kind == "attn_gate":
        return [(hf, _grouped(heads, per, dv))]
    if kind in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
        return [(hf, _grouped(heads, per, 1))]
    return [(hf, None)]
