"""A PEFT LoRA adapter folder read and checked against the base model, as our fused modules take it.

A folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``adapter_model.bin``,
read with ``torch.load(weights_only=True)``). Each targeted Hugging Face projection ``P`` of layer
``i`` has ``A [r, in]`` and ``B [out, r]``; its output gains ``scaling * (x @ A.T) @ B.T`` with
``scaling = alpha / r`` (``alpha / sqrt(r)`` under rsLoRA).

The decoder fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``
(``radixlm.runtime.models.weight_names``), so the parts an adapter targets on one fused module are
packed into one low-rank pair whose ``B`` is zero outside each part's output rows::

    qkv_proj (q, k and v targeted, rank r each):
        A = [A_q; A_k; A_v]            [3r, hidden]
        B = | s*B_q   0      0    |    rows 0 .. q          (s: scaling, folded into B)
            |  0     s*B_k   0    |    rows q .. q+kv
            |  0      0     s*B_v |    rows q+kv .. q+2kv

so one ``(x @ A.T) @ B.T`` adds every part's delta to its own output slice.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixlm.runtime.models.config import ModelConfig

# Hugging Face projection -> (our module under the layer, which part of it); None: the whole module
_TARGETS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", None),
    "qkv_proj": ("self_attn.qkv_proj", None),  # Phi-3 checkpoints name the fused modules themselves
    "gate_up_proj": ("mlp.gate_up_proj", None),
}
SUPPORTED_TARGETS = tuple(_TARGETS)
MAX_RANK = 256
Block = tuple[int, int, int, int]
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.\w+)?\.weight$")


@dataclass
class LoraAdapter:
    """One adapter's low-rank pairs, keyed by our module path (``layers.3.self_attn.qkv_proj``)."""

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]  # the Hugging Face projections it changes
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # module -> (A [R, in], B [out, R], scaling folded in)
    blocks: dict[str, list[Block]] = field(default_factory=dict)  # module -> where B is not zero: (first row, end row, first column, end column)
    compact: dict[str, Any] = field(default_factory=dict)  # module -> its pairs part by part, without B's zero blocks (batch.py builds them on first use)

    def nbytes(self) -> int:
        """Bytes its tensors take."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def module_sizes(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Per module under a layer: its input width and the output rows of each of its parts."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "self_attn.qkv_proj": (cfg.hidden_size, [q, kv, kv]),
        "self_attn.o_proj": (q, [cfg.hidden_size]),
        "mlp.gate_up_proj": (cfg.hidden_size, [inter, inter]),
        "mlp.down_proj": (inter, [cfg.hidden_size]),
    }


def check_model(cfg: ModelConfig, tp_size: int = 1) -> None:
    """Raise ValueError when the base model cannot take LoRA adapters."""
    if tp_size > 1:
        raise ValueError("LoRA adapters do not run with tp_size > 1 yet (each rank would need its slice of every adapter)")
    if cfg.moe is not None or cfg.mla is not None:
        raise ValueError(f"LoRA adapters run on dense grouped-query models; {cfg.architecture} has {'experts' if cfg.moe else 'latent attention'}")


def load_adapter(path: str | Path, cfg: ModelConfig, name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LoraAdapter:
    """Read and check the adapter folder ``path`` against ``cfg`` (ValueError naming the file and field)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: {folder} is not a folder")
    config_file = folder / "adapter_config.json"
    rank, scaling, targets = _read_config(config_file)
    tensors, weights_file = _read_tensors(folder)
    pairs = _collect_pairs(tensors, weights_file, cfg)
    sizes = module_sizes(cfg)
    found: set[str] = set()
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    blocks: dict[str, list[Block]] = {}
    by_module: dict[tuple[int, str], dict[int | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, hf_module), (a, b) in sorted(pairs.items()):
        module, part = _TARGETS[hf_module]
        width, parts = sizes[module]
        out = sum(parts) if part is None else parts[part]
        where = f"{weights_file.name}: model.layers.{layer}.{hf_module}"
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != width or b.shape[0] != out or a.shape[0] != b.shape[1]:
            raise ValueError(f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base model (expected A [r, {width}], B [{out}, r])")
        if a.shape[0] != rank:
            raise ValueError(f"{where}: rank {a.shape[0]} differs from adapter_config.json's r = {rank}")
        by_module.setdefault((layer, module), {})[part] = (a, b)
        found.add(hf_module)
    for (layer, module), parts in by_module.items():
        key = f"layers.{layer}.{module}"
        a, b, blocks[key] = _pack(parts, sizes[module][1], scaling, dtype, device)
        weights[key] = (a, b)
    if not weights:
        raise ValueError(f"{weights_file.name}: no LoRA weights for {', '.join(SUPPORTED_TARGETS)}")
    return LoraAdapter(name, str(folder), rank, scaling, tuple(sorted(found)), weights, blocks)


def _read_config(config_file: Path) -> tuple[int, float, list[str] | str]:
    """``(r, scaling, target_modules)`` of adapter_config.json, refusing what we do not compute."""
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter folder {config_file.parent} has no {config_file.name}")
    try:
        conf = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_file}: not valid JSON ({exc})") from None
    if not isinstance(conf, dict):
        raise ValueError(f"{config_file}: expected a JSON object")
    where = config_file.name
    if conf.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {conf.get('peft_type')!r} is not LORA")
    rank = conf.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_RANK:
        raise ValueError(f"{where}: r must be an integer in [1, {MAX_RANK}], got {rank!r}")
    alpha = conf.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "modules_to_save": "fully trained modules (modules_to_save) are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) adapters are not supported",
        "trainable_token_indices": "trainable tokens are not supported",
    }
    for key, why in refused.items():
        if conf.get(key):
            raise ValueError(f"{where}: {key} = {conf[key]!r}: {why}")
    if conf.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias = {conf['bias']!r}: adapters that train biases are not supported")
    targets = conf.get("target_modules")
    if isinstance(targets, list):
        bad = [t for t in targets if t.rsplit(".", 1)[-1] not in _TARGETS]
        if bad:
            raise ValueError(f"{where}: target_modules {bad} not supported (LoRA applies to {', '.join(SUPPORTED_TARGETS)})")
    elif targets is not None and not isinstance(targets, str):
        raise ValueError(f"{where}: target_modules must be a list or a string, got {targets!r}")
    scaling = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    return rank, float(scaling), targets


def _read_tensors(folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The adapter's tensors by name, from its safetensors (or PyTorch) weights file."""
    st, pt = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    if st.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(st)), st
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(f"{st}: not a readable safetensors file ({exc})") from None
    if pt.is_file():
        try:
            loaded = torch.load(str(pt), map_location="cpu", weights_only=True)
        except Exception as exc:  # pickle errors come in many types
            raise ValueError(f"{pt}: not a readable weights file ({exc})") from None
        if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise ValueError(f"{pt}: expected a dict of tensors")
        return loaded, pt
    raise ValueError(f"LoRA adapter folder {folder} has no adapter_model.safetensors (nor adapter_model.bin)")


def _collect_pairs(tensors: dict[str, torch.Tensor], weights_file: Path, cfg: ModelConfig) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """``(layer, hf_module) -> (A, B)``, refusing tensors outside the supported projections."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in _TARGETS:
            why = "DoRA magnitudes are not supported" if "lora_magnitude" in key else f"LoRA applies to {', '.join(SUPPORTED_TARGETS)} only"
            raise ValueError(f"{weights_file.name}: tensor {key!r} not supported ({why})")
        layer, hf_module = int(m.group(1)), m.group(3)
        if layer >= cfg.num_layers:
            raise ValueError(f"{weights_file.name}: tensor {key!r} is for layer {layer}; the base model has {cfg.num_layers} layers")
        halves.setdefault((layer, hf_module), {})[m.group(4)] = tensor
    pairs = {}
    for (layer, hf_module), ab in halves.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"{weights_file.name}: model.layers.{layer}.{hf_module} has no {missing}")
        pairs[(layer, hf_module)] = (ab["A"], ab["B"])
    return pairs


def _pack(parts: dict[int | None, tuple[torch.Tensor, torch.Tensor]], sizes: list[int], scaling: float, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor, list[Block]]:
    """One ``(A, B)`` for a module from its targeted parts (None: the whole module), scaling folded
    into B, and B's non-zero blocks."""
    if None in parts:
        if len(parts) > 1:
            raise ValueError("an adapter targets both a fused module and one of its parts")
        a, b = parts[None]
        return a.to(device, dtype).contiguous(), (b.double() * scaling).to(device, dtype).contiguous(), [(0, sum(sizes), 0, a.shape[0])]
    ranks = {p: parts[p][0].shape[0] for p in parts}
    total_rank, out = sum(ranks.values()), sum(sizes)
    a_all = torch.zeros(total_rank, parts[next(iter(parts))][0].shape[1], dtype=torch.float64)
    b_all = torch.zeros(out, total_rank, dtype=torch.float64)
    col, blocks = 0, []
    for p in sorted(parts):
        a, b = parts[p]
        row = sum(sizes[:p])
        a_all[col : col + ranks[p]] = a.double()
        b_all[row : row + sizes[p], col : col + ranks[p]] = b.double() * scaling
        blocks.append((row, row + sizes[p], col, col + ranks[p]))
        col += ranks[p]
    return a_all.to(device, dtype).contiguous(), b_all.to(device, dtype).contiguous(), blocks
