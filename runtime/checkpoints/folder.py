"""Hugging Face model folders: ``config.json`` and safetensors files, dense or pre-quantized
(``quantization_config``: AWQ/GPTQ int4, FP8)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from radixlm.runtime.checkpoints.base import Checkpoint
from radixlm.runtime.layers.stored_weight import StoredWeight
from radixlm.runtime.models.config import ModelConfig

logger = logging.getLogger(__name__)

Reader = Callable[[dict, list[str], Callable[[str], torch.Tensor]], tuple[dict[str, StoredWeight], set[str]]]


def folder_config(path: str) -> ModelConfig:
    """The architecture of the model folder at ``path`` (with generation_config.json's eos ids)."""
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


def quantization_config(path: str) -> dict | None:
    """The folder's ``quantization_config`` (from config.json, or a separate quantize_config.json)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    q = cfg.get("quantization_config") or cfg.get("compression_config")
    if q is None:
        for name in ("quantize_config.json", "quant_config.json"):
            f = Path(path) / name
            if f.is_file():
                q = json.loads(f.read_text())
                q.setdefault("quant_method", "gptq" if name == "quantize_config.json" else "awq")
                break
    return q


def _reader_for(qconfig: dict) -> Reader:
    method = str(qconfig.get("quant_method", "")).lower()
    if method in ("gptq", "awq"):
        from radixlm.runtime.checkpoints import gptq_awq

        return gptq_awq.read_stored
    if method in ("fp8", "compressed-tensors"):
        from radixlm.runtime.checkpoints import fp8

        return fp8.read_stored
    if method == "mxfp4":
        from radixlm.runtime.checkpoints import mxfp4

        return mxfp4.read_stored
    raise ValueError(f"quantization_config quant_method {method!r} is not supported; radixlm reads gptq, awq, fp8, compressed-tensors (fp8) and mxfp4 (GPT-OSS)")


def _files(path: str) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {path!r} has no .safetensors files")
    return files


def tensor_names(path: str) -> dict[str, Path]:
    """Every tensor name in the folder's safetensors files, with the file that holds it (headers only)."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for file in _files(path):
        with safe_open(str(file), framework="pt") as f:
            where.update((key, file) for key in f.keys())
    return where


def dense_tensors(path: str, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's tensors whose names start with ``prefix``, dense (stored ones dequantized),
    reading only those: a part of a large checkpoint (an MTP layer) without loading the rest."""
    from safetensors import safe_open

    where = {name: file for name, file in tensor_names(path).items() if name.startswith(prefix)}

    def get(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as f:
            return f.get_tensor(name)

    qconfig = quantization_config(path)
    stored, consumed = _reader_for(qconfig)(qconfig, sorted(where), get) if qconfig is not None else ({}, set())
    for name in sorted(set(where) - consumed):
        yield name, get(name)
    for name, weight in stored.items():
        yield name, weight.dequantize()


def safetensors_tensors(path: str, skip: set[str] = frozenset()) -> Iterator[tuple[str, Any]]:
    """``(name, lazy slice)`` of every tensor in the folder's safetensors files (but ``skip``).

    A slice reads from the file only the part indexed (``s[:]``, ``s[a:b]``, ``s[:, a:b]``), so
    a tensor-parallel rank reads just its shard."""
    from safetensors import safe_open

    names = []
    for file in _files(path):
        with safe_open(str(file), framework="pt") as f:
            names.extend((file, key) for key in f.keys() if key not in skip)
    handles = {}
    try:
        for file, key in tqdm(names, desc="Loading weights", unit="tensor", leave=False):
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt").__enter__()
            yield key, handles[file].get_slice(key)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


def open_folder(path: str, native: bool = True) -> Checkpoint:
    """The folder as a checkpoint; a quantized one's weights as stored (``native``) or dequantized."""
    cfg = folder_config(path)
    size = sum(f.stat().st_size for f in _files(path))
    qconfig = quantization_config(path)
    if qconfig is None:
        return Checkpoint(cfg, lambda: safetensors_tensors(path), {}, size)
    from safetensors import safe_open

    where = tensor_names(path)

    def get(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as f:
            return f.get_tensor(name)

    stored, consumed = _reader_for(qconfig)(qconfig, sorted(where), get)
    if native:
        return Checkpoint(cfg, lambda: safetensors_tensors(path, consumed), stored, size)
    logger.info("dequantizing the %s checkpoint's weights", qconfig.get("quant_method"))

    def dense() -> Iterator[tuple[str, Any]]:
        yield from safetensors_tensors(path, consumed)
        for name, weight in stored.items():
            yield name, weight.dequantize()

    return Checkpoint(cfg, dense, {}, size)
