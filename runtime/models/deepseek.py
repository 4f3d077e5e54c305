"""DeepSeek-V2 and V3 (V2-Lite, V2.5, V3, R1): multi-head latent attention and routed experts.

Attention is MLA (``radixlm.runtime.layers.mla``) over a latent KV pool: one row
``[c_kv | k_pe]`` per token and layer instead of per-head keys and values. The first
``first_k_dense_replace`` layers keep a dense MLP; the rest route to experts every
``moe_layer_freq`` layers, with shared experts beside them. V2 routes by softmax, limited to the
best ``topk_group`` groups by their best expert; V3 by sigmoid with a correction bias, groups
ranked by their two best, weights renormalised; both scale by ``routed_scaling_factor``
(``MoEConfig.from_hf_dict``).

The checkpoints rotate RoPE over interleaved pairs ``(x0, x1), (x2, x3), …`` of the rope dims
(V2 always, V3 where ``rope_interleave``). The decoder rotates halves (``x_i`` with ``x_{i+P/2}``),
so the rope rows of the query projection and of ``kv_a_proj_with_mqa`` are permuted at load
(evens first, then odds): both sides of every score move alike, so the scores are unchanged.
A projection kept as stored (GGUF blocks: the converter leaves these rows as the checkpoint has
them; FP8 with its scales) moves its rows the same way; a form that cannot (AWQ/GPTQ) is refused.

Not run: the multi-token-prediction layer of V3 checkpoints (``model.layers.{num_hidden_layers}``
is skipped at load), the C++ decode stack and CUDA graphs (latent attention has no stack form;
the PyTorch attention backend serves the latent pool).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from radixlm.runtime.layers.stored_weight import StoredWeight
from radixlm.runtime.models.dense import DenseForCausalLM
from radixlm.runtime.models.registry import register_family

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_QUERY = re.compile(r"\.self_attn\.(q_proj|q_b_proj)\.weight$")
_LATENT = re.compile(r"\.self_attn\.kv_a_proj_with_mqa\.(weight|bias)$")
_PLAIN_QUERY = re.compile(r"^model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)$")


def deinterleave(rows: torch.Tensor, start: int, width: int, period: int) -> torch.Tensor:
    """``rows`` (``[k * period, …]``) with rows ``[k * period + start, … + width)`` of every block reordered evens first, then odds."""
    order = torch.arange(period)
    order[start : start + width] = start + torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])
    return rows.view(-1, period, *rows.shape[1:])[:, order].reshape(rows.shape)


@register_family(DeepseekV2ForCausalLM="deepseek_v2", DeepseekV3ForCausalLM="deepseek_v3")
class DeepseekForCausalLM(DenseForCausalLM):
    """Multi-head latent attention, a dense MLP in the first layers, then routed and shared experts."""

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors without the MTP layer, with interleaved RoPE rows put in rotate-half order."""
        for name, source in super().checkpoint_tensors(weights):
            layer = _LAYER.match(name)
            if layer is not None and int(layer.group(1)) >= self.config.num_layers:
                continue  # the multi-token-prediction layer
            rows = self._rope_rows(name)
            yield name, source if rows is None else deinterleave(source[:], *rows)

    def stored_weight(self, name: str, weight: StoredWeight) -> StoredWeight:
        """A stored weight with its rows in ``checkpoint_tensors``' order: the interleaved RoPE rows
        reordered as a plain tensor's rows are (GGUF rows of blocks; FP8 rows with their per-channel
        scales, or inside their blocks of rows). A form that cannot move its rows is refused by name."""
        rows = self._rope_rows(name)
        if rows is None:
            return weight
        moved = weight.take_rows(deinterleave(torch.arange(weight.out_features).unsqueeze(1), *rows).squeeze(1))
        if moved is None:
            raise ValueError(f"{name}: its RoPE rows must be reordered at load, which a {weight.format} weight cannot do as stored; load the checkpoint dequantized (--quantization none)")
        return moved

    def _rope_rows(self, name: str) -> tuple[int, int, int] | None:
        """Where the interleaved RoPE rows of tensor ``name`` lie (``deinterleave``'s start, width and
        period), or None where it has none to reorder."""
        mla = self.config.mla
        if not mla.rope_interleave:
            return None
        if _QUERY.search(name):
            return mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.qk_head_dim
        if _LATENT.search(name):
            return mla.kv_lora_rank, mla.qk_rope_head_dim, mla.row_dim
        return None

    def weight_target(self, name: str) -> tuple[str | None, int | None]:
        """As the dense decoder's, but a plain ``q_proj`` (V2-Lite) is latent attention's own, not part of a fused q/k/v."""
        plain = _PLAIN_QUERY.match(name)
        if plain is not None:
            return f"layers.{plain.group(1)}.self_attn.q_proj.{plain.group(2)}", None
        return super().weight_target(name)
