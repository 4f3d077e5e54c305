"""LoraManager: the model runner's LoRA side: the adapter pool, the per-pass segments, the hooks.

Each targeted projection of every layer (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``) gets a forward hook that, while a pass with adapter rows runs (``running``), adds
the segments' deltas to the module's output. The projection's own module stays as it was
(a plain or quantized linear), so loading, quantization and the base path are untouched; a pass
with no adapter rows costs one attribute check per projection. Passes with adapter rows take the
Python path (the C++ decode stack and captured CUDA graphs compute the base model only); the
deltas themselves are the grouped kernels' (``batch.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixlm.kernels import triton_available
from radixlm.kernels.cpu_ext import cpu_kernels
from radixlm.runtime.lora.adapter import LoraAdapter, check_model, load_adapter, module_sizes
from radixlm.runtime.lora.batch import (
    LoraBatch,
    add_lora_deltas,
    grouped_plan,
    segments_of,
    stacked_plan,
)
from radixlm.runtime.lora.pool import LoraPool
from radixlm.runtime.models.config import ModelConfig

if TYPE_CHECKING:
    from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

STACK_CACHE = 4  # sets of adapters whose stacked weights are kept


def parse_lora_paths(specs: Sequence[str] | str | None) -> dict[str, str]:
    """``name=path`` entries (a bare path is named by its folder) as ``{name: path}``; ValueError naming ``lora_paths``."""
    if specs is None:
        return {}
    if isinstance(specs, str):
        specs = specs.split()
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = spec.rstrip("/").rsplit("/", 1)[-1], spec
        if not name or not path:
            raise ValueError(f"lora_paths entries must be name=path, got {spec!r}")
        if name in out:
            raise ValueError(f"lora_paths names {name!r} twice")
        out[name] = path
    return out


class LoraManager:
    """The adapters of one model runner and the hooks that apply them."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, args: ServerArgs, dtype: torch.dtype, device: torch.device, tp_size: int = 1) -> None:
        check_model(cfg, tp_size)
        self.device = device
        self.cfg = cfg
        self.pool = LoraPool(self.read, args.max_loaded_loras, args.max_loras_per_batch)
        self.active: LoraBatch | None = None
        self.kernels = cpu_kernels() if device.type == "cpu" else None  # the C++ grouped kernel (None: the PyTorch path)
        self.triton = _triton_kernels() if device.type == "cuda" else None  # the Triton grouped kernels (None: the PyTorch path)
        self.dtype = adapter_dtype(args.lora_dtype, dtype, self.kernels is not None or self.triton is not None)
        # per set of segment adapters: their weights stacked for batched decode steps (batch.py)
        self._part_rows = {module: rows for module, (_, rows) in module_sizes(cfg).items()}
        self._stacks: OrderedDict[tuple[int, ...], tuple[tuple[LoraAdapter, ...], dict]] = OrderedDict()
        self._hooks = [
            model.get_submodule(f"layers.{layer}.{module}").register_forward_hook(functools.partial(self._hook, f"layers.{layer}.{module}"))
            for layer in range(cfg.num_layers)
            for module in module_sizes(cfg)
        ]
        for name, path in parse_lora_paths(args.lora_paths).items():
            self.pool.register(name, path, self.read(name, path))  # a bad folder fails start-up, naming the file

    def read(self, name: str, path: str) -> LoraAdapter:
        """Adapter ``name`` read from ``path`` and checked against the base model (no pool change)."""
        return load_adapter(path, self.cfg, name, self.dtype, self.device)

    def batch_for(self, lengths: Sequence[int], names: Sequence[str | None]) -> LoraBatch | None:
        """The segments of a pass whose rows (``lengths`` tokens each, in batch order) use ``names``; None without adapter rows."""
        if not any(names):
            return None
        segments = segments_of(lengths, [None if n is None else self.pool.get(n) for n in names])
        if self.kernels is not None:
            return LoraBatch(segments, self._part_rows, kernels=self.kernels)
        key = tuple(id(a) for _, _, a in segments)
        cached = self._stacks.get(key)
        weights = None if cached is None else cached[1]
        if self.triton is not None:
            plan = grouped_plan(segments, self.triton, self.device, self._part_rows, weights)
        else:
            plan = stacked_plan(segments, self.device, self._part_rows, weights)
        if plan is not None and cached is None:
            self._stacks[key] = (plan.adapters, plan.weights)  # the adapters held: their ids stay theirs
            while len(self._stacks) > STACK_CACHE:
                self._stacks.popitem(last=False)
        elif cached is not None:
            self._stacks.move_to_end(key)
        return LoraBatch(segments, self._part_rows, plan)

    @contextlib.contextmanager
    def running(self, batch: LoraBatch | None) -> Iterator[None]:
        """Apply ``batch``'s segments in the projections while the block runs."""
        self.active = batch
        try:
            yield
        finally:
            self.active = None

    def _hook(self, module: str, _mod: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor | None:
        batch = self.active
        if batch is None:
            return None
        return add_lora_deltas(inputs[0], out, module, batch)

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def adapter_dtype(lora_dtype: str, model_dtype: torch.dtype, grouped_kernels: bool) -> torch.dtype:
    """The dtype adapters are stored in (``--lora-dtype``): another than the model's needs the
    grouped kernels, which widen each weight as they read it; the PyTorch path falls back."""
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dtype = names.get(lora_dtype, model_dtype)
    if dtype != model_dtype and not grouped_kernels:
        logger.warning("lora_dtype=%s needs the grouped LoRA kernels, which are not available here: adapters are stored in %s", lora_dtype, model_dtype)
        return model_dtype
    return dtype


def _triton_kernels() -> ModuleType | None:
    """``kernels/triton_lora.py``, or None where Triton is not installed."""
    if not triton_available():
        return None
    from radixlm.kernels import triton_lora

    return triton_lora


def lora_admits(runner: Any, req: Any, running: Iterable[Any]) -> bool:
    """True when ``req`` may be admitted beside ``running`` as far as LoRA goes (its adapter
    loaded, the batch within ``--max-loras-per-batch``); ValueError when its adapter was unloaded."""
    lora: LoraManager | None = getattr(runner, "lora", None)
    if lora is None or req.lora is None:
        return True
    return lora.pool.admits(req.lora, (r.lora for r in running))
