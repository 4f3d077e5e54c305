"""Hugging Face checkpoint tensor names → the dense decoder's parameters.

The decoder fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (in attention, in
dense MLPs, in every expert and in the shared experts), and calls an MoE router ``router``::

    model.layers.3.self_attn.k_proj.weight          -> layers.3.self_attn.qkv_proj.weight, part 1
    model.layers.3.mlp.experts.7.up_proj.weight     -> layers.3.mlp.experts.7.gate_up_proj.weight, part 1
    model.layers.3.mlp.gate.weight                  -> layers.3.mlp.router.weight
    model.layers.3.mlp.gate.e_score_correction_bias -> layers.3.mlp.router.correction_bias
    model.embed_tokens.weight                       -> embed_tokens.weight

A family whose checkpoints spell these otherwise (Mixtral's ``block_sparse_moe.experts.N.w1``)
renames them first, in its ``checkpoint_tensors``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# per-layer tensors whose names do not end in ``<module>.weight`` / ``.bias``: name tail -> (module, parameter)
_OTHER_LAYER_TENSORS = {
    "self_attn.sinks": ("self_attn", "sinks"),
    "mlp.gate.e_score_correction_bias": ("mlp.router", "correction_bias"),
    "linear_attn.A_log": ("linear_attn", "A_log"),
    "linear_attn.dt_bias": ("linear_attn", "dt_bias"),
}
_OTHER_NAME = re.compile(r"^model\.layers\.(\d+)\.(" + "|".join(re.escape(k) for k in _OTHER_LAYER_TENSORS) + r")$")
_PARTS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    # Gated DeltaNet (Qwen3.5 spelling): one in_proj of q/k/v, z, b, a
    "in_proj_qkv": ("in_proj", 0), "in_proj_z": ("in_proj", 1), "in_proj_b": ("in_proj", 2), "in_proj_a": ("in_proj", 3),
}  # fmt: skip
FUSED = ("qkv_proj", "gate_up_proj", "in_proj")
_RENAMED = {"mlp.gate": "mlp.router"}


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: a parameter of the model, and which part of a fused one
    (``part`` None: the whole parameter, also where a checkpoint stores it fused, as Phi-3's)."""

    param: str
    part: int | None = None

    @property
    def module(self) -> str:
        """The parameter's module path (``layers.3.self_attn.qkv_proj``)."""
        return self.param.rsplit(".", 1)[0]


def target_of(name: str) -> Target | None:
    """The parameter ``name`` loads into (by name alone; the row offset of a part is the model's to
    compute from its sizes), or None for a tensor the model does not keep (RoPE tables)."""
    if "rotary_emb" in name:
        return None
    other = _OTHER_NAME.match(name)
    if other:
        module, param = _OTHER_LAYER_TENSORS[other.group(2)]
        return Target(f"layers.{other.group(1)}.{module}.{param}")
    m = LAYER_NAME.match(name)
    if not m:
        return Target(name.removeprefix("model."))
    layer, module, kind = m.groups()
    module = _RENAMED.get(module, module)
    parent, _, leaf = module.rpartition(".")
    if leaf in _PARTS:
        fused, part = _PARTS[leaf]
        return Target(f"layers.{layer}.{parent}.{fused}.{kind}", part)
    return Target(f"layers.{layer}.{module}.{kind}")


def module_of(hf_name: str) -> str:
    """The Hugging Face module of a tensor, without layer prefix or ``.weight``/``.bias``:
    ``model.layers.3.mlp.down_proj.weight`` → ``mlp.down_proj``; ``model.embed_tokens.weight`` →
    ``embed_tokens``; ``model.layers.3.self_attn.sinks`` → ``self_attn.sinks``."""
    other = _OTHER_NAME.match(hf_name)
    if other:
        return other.group(2)
    m = LAYER_NAME.match(hf_name)
    if m:
        return m.group(2)
    return hf_name.removeprefix("model.").rsplit(".", 1)[0]
