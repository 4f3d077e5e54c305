"""GGUF files: the config from their metadata, tensor names mapped to Hugging Face's, and the
weights either as stored (quantized blocks, ``GGUFWeight``) or dequantized once into the disk cache."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from radixlm.runtime.checkpoints.base import Checkpoint
from radixlm.runtime.checkpoints.folder import safetensors_tensors
from radixlm.runtime.disk_cache import entry_for, write_entry
from radixlm.runtime.layers.gguf_linear import GGUFWeight
from radixlm.runtime.models.config import ModelConfig

logger = logging.getLogger(__name__)

DENSE_TYPES = (0, 1, 30)  # F32, F16, BF16: loaded as plain tensors


def gguf_reader(path: str):
    """A ``gguf.GGUFReader`` over the file (memory-mapped)."""
    from gguf import GGUFReader

    return GGUFReader(path)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(path: str, reader=None) -> ModelConfig:
    """The architecture a GGUF file's metadata describes."""
    r = reader or gguf_reader(path)
    arch = _field(r, "general.architecture")
    if arch not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}; radixlm runs llama, mistral and qwen2")

    def get(key, default=None):
        return _field(r, f"{arch}.{key}", default)

    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    names = {t.name for t in r.tensors}
    vocab = get("vocab_size") or len(_field(r, "tokenizer.ggml.tokens", []))
    scaling = None
    if get("rope.scaling.type") in ("linear",):
        scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    eos = _field(r, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv", num_heads),
        head_dim=get("attention.key_length") or get("rope.dimension_count") or hidden // num_heads,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2",
        bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
    )


_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors the model does not use."""
    if name in _NAMES:
        return _NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row order on a q or k projection (rows = heads × dim);
    rows move whole, so a quantized tensor's rows of blocks move the same way."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rows_in_hf_order(name: str, arr: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    if cfg.architecture in ("llama", "mistral"):
        if ".attn_q." in name:
            return unpermute_rope_rows(arr, cfg.num_heads)
        if ".attn_k." in name:
            return unpermute_rope_rows(arr, cfg.num_kv_heads)
    return arr


def open_gguf(path: str, native: bool = True) -> Checkpoint:
    """The file as a checkpoint: quantized tensors as stored (``native``), or every tensor
    dequantized to float32 (kept in the disk cache, so tensor-parallel ranks read their slices)."""
    if not native:
        return _dequantized(path)
    from gguf.quants import dequantize

    reader = gguf_reader(path)
    cfg = gguf_config(path, reader)
    plain: list[tuple[str, torch.Tensor]] = []
    stored: dict[str, GGUFWeight] = {}
    for t in tqdm(reader.tensors, desc="Reading weights", unit="tensor", leave=False):
        hf = gguf_to_hf_name(t.name)
        if hf is None:
            continue
        qtype = int(t.tensor_type)
        if qtype in DENSE_TYPES:
            arr = dequantize(t.data, t.tensor_type)
            plain.append((hf, torch.from_numpy(np.array(_rows_in_hf_order(t.name, arr, cfg), copy=True))))
        else:
            blocks = np.array(_rows_in_hf_order(t.name, t.data, cfg), dtype=np.uint8, copy=True)
            stored[hf] = GGUFWeight(qtype, torch.from_numpy(blocks), int(t.shape[0]))
    return Checkpoint(cfg, lambda: iter(plain), stored, os.path.getsize(path))


def _dequantized_tensors(cfg: ModelConfig, reader) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    for t in tqdm(reader.tensors, desc="Loading weights", unit="tensor", leave=False):
        hf = gguf_to_hf_name(t.name)
        if hf is None:
            continue
        arr = _rows_in_hf_order(t.name, dequantize(t.data, t.tensor_type), cfg)
        yield hf, torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))


def _dequantized(path: str) -> Checkpoint:
    """Config and weights of a GGUF file, dequantized once and kept in the disk cache."""
    entry = entry_for(path, "weights")
    size = os.path.getsize(path)
    if (entry / "config.json").is_file() and (entry / "model.safetensors").is_file():
        try:
            cfg = ModelConfig(**json.loads((entry / "config.json").read_text()))
            return Checkpoint(cfg, lambda: safetensors_tensors(str(entry)), {}, size)
        except (OSError, TypeError, ValueError) as exc:
            logger.warning("ignoring unreadable weight cache %s: %s", entry, exc)
    reader = gguf_reader(path)
    cfg = gguf_config(path, reader)
    tensors = dict(_dequantized_tensors(cfg, reader))

    def fill(tmp: Path) -> None:
        from safetensors.torch import save_file

        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))

    if not write_entry(entry, fill):
        logger.warning("could not cache dequantized weights in %s", entry)
    items: list[tuple[str, Any]] = list(tensors.items())
    return Checkpoint(cfg, lambda: iter(items), {}, size)
