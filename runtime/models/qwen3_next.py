"""Qwen3-Next and Qwen3.5: hybrid models, Gated DeltaNet layers between gated full-attention layers.

Three of every four layers (``layer_types`` "linear_attention") mix tokens through a Gated DeltaNet
(``radixlm.runtime.layers.gated_delta``): a fixed-size state per request, no KV. The others attend
as Qwen3 does (per-head q/k norms, partial RoPE over a quarter of each head) with an **output
gate**: ``q_proj`` gives each head a gate beside its query, and the attention output is multiplied
by its sigmoid before ``o_proj``. Every RMSNorm scales by ``1 + weight`` (the 1 is added at load)
except the DeltaNet's gated output norm, which scales by its weight as stored.

Qwen3-Next's and Qwen3.5-MoE's feed-forward blocks are routed experts plus one shared expert whose
output a learned sigmoid gate scales per token; Qwen3.5's dense models have a gated MLP. Qwen3-Next's checkpoints
store the DeltaNet projections interleaved per key head (``in_proj_qkvz``, ``in_proj_ba``); they
are reordered here into Qwen3.5's four (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``), which load into one fused ``in_proj``. A Qwen3.5 checkpoint of the vision-language
class keeps its text model under ``model.language_model``; its vision tower and MTP head are not loaded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from radixlm.runtime.models.dense import DenseArch, DenseForCausalLM
from radixlm.runtime.models.registry import register_family

_INTERLEAVED = re.compile(r"^(model\.layers\.\d+\.linear_attn\.)in_proj_(qkvz|ba)\.weight$")
_SKIPPED = ("model.visual.", "mtp.", "model.mtp.")


def _qwen35_name(name: str) -> str:
    """A checkpoint tensor's name in Qwen3.5's spelling: the text model's prefix, the shared expert's names."""
    name = name.replace("model.language_model.", "model.", 1)
    return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.").replace(".mlp.shared_expert_gate.", ".mlp.shared_gate.")


@register_family(
    Qwen3NextForCausalLM="qwen3_next",
    Qwen3_5ForCausalLM="qwen3_5",
    Qwen3_5ForConditionalGeneration="qwen3_5",
    Qwen3_5MoeForCausalLM="qwen3_5_moe",
    Qwen3_5MoeForConditionalGeneration="qwen3_5_moe",
)
class Qwen3NextForCausalLM(DenseForCausalLM):
    """Gated DeltaNet and gated-attention layers, with a dense MLP or routed and shared experts."""

    arch = DenseArch(qk_norm=True, norm_offset=1.0, attn_output_gate=True)
    plain_norms = ("linear_attn.norm.weight",)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors in Qwen3.5's names (``1 + w`` norms as stored ``w`` plus 1)."""
        return super().checkpoint_tensors(self._renamed(weights))

    def weight_target(self, name: str) -> tuple[str | None, int | None]:
        """Where a tensor goes, by Qwen3.5's name (stored weights, such as a GGUF file's quantized
        shared expert, come here under the checkpoint's own names)."""
        return super().weight_target(_qwen35_name(name))

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, source in weights:
            name = _qwen35_name(name)
            if name.startswith(_SKIPPED):
                continue
            interleaved = _INTERLEAVED.match(name)
            if interleaved is None:
                yield name, source
                continue
            prefix, kind = interleaved.groups()
            yield from self._deinterleave(prefix, kind, source[:])

    def _deinterleave(self, prefix: str, kind: str, weight: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Qwen3-Next's per-key-head groups ``[q k v z]`` / ``[b a]`` as Qwen3.5's separate projections."""
        spec = self.config.linear
        groups, per = spec.num_k_heads, spec.num_v_heads // spec.num_k_heads
        hidden = weight.shape[-1]
        if kind == "qkvz":
            dk, dv = spec.head_k_dim, per * spec.head_v_dim
            q, k, v, z = weight.reshape(groups, -1, hidden).split([dk, dk, dv, dv], dim=1)
            yield f"{prefix}in_proj_qkv.weight", torch.cat([t.reshape(-1, hidden) for t in (q, k, v)])
            yield f"{prefix}in_proj_z.weight", z.reshape(-1, hidden)
        else:
            b, a = weight.reshape(groups, -1, hidden).split([per, per], dim=1)
            yield f"{prefix}in_proj_b.weight", b.reshape(-1, hidden)
            yield f"{prefix}in_proj_a.weight", a.reshape(-1, hidden)
