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

The multi-token-prediction (MTP) layer of V3 checkpoints (``model.layers.{num_hidden_layers}``)
is skipped when the model loads; ``DeepseekMTP`` holds it as a separate module, the
draft of ``--speculative-algorithm mtp`` (``radixlm.runtime.speculative.mtp``). From the target's
hidden state ``h_p`` at position ``p`` before the final norm and the token ``x_{p+1}``::

    u = eh_proj([enorm(embed(x_{p+1})) | hnorm(h_p)])     embedding first, then the hidden state
    h'_p = decoder_layer(u)  (its own latent KV at position p)   logits(x_{p+2}) = head(shared_head.norm(h'_p))

The concatenation order (embedding first) and the norms (``enorm`` on the embedding, ``hnorm`` on
the hidden state, ``shared_head.norm`` before the head) follow SGLang's and vLLM's DeepSeek
NextN/MTP modules (the paper writes the two halves the other way round). The hidden state fed is
the target's before its final norm, as issue 36 specifies; public engines differ on this (SGLang
feeds what its logits processor captured, with a before-norm option), which moves acceptance
only, never the output. Chained drafts feed ``h'_p`` (before ``shared_head.norm``).

Not run: the C++ decode stack and CUDA graphs (latent attention has no stack form; the PyTorch
attention backend serves the latent pool).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from radixlm.runtime.layers.forward_batch import ForwardBatch
from radixlm.runtime.layers.norm import RMSNorm
from radixlm.runtime.layers.stored_weight import StoredWeight
from radixlm.runtime.models.config import ModelConfig
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
        """As the dense decoder's, but a plain ``q_proj`` (V2-Lite) is latent attention's own, not part
        of a fused q/k/v, and the MTP layers' weights (past the model's layers) have no target here."""
        layer = _LAYER.match(name)
        if layer is not None and int(layer.group(1)) >= self.config.num_layers:
            return None, None
        plain = _PLAIN_QUERY.match(name)
        if plain is not None:
            return f"layers.{plain.group(1)}.self_attn.q_proj.{plain.group(2)}", None
        return super().weight_target(name)


SHARED_PARAMS = ("embed_tokens.weight", "lm_head.weight")  # the MTP's parameters the target may lend it


class DeepseekMTP(DeepseekForCausalLM):
    """DeepSeek-V3's multi-token-prediction layer: ``enorm``, ``hnorm``, ``eh_proj``, one decoder
    layer (latent attention over its own one-layer pool, experts) and the shared head's norm."""

    def __init__(self, cfg: ModelConfig, source_layer: int) -> None:
        super().__init__(cfg)
        self.source_layer = source_layer  # the checkpoint's index of this layer (``num_hidden_layers``)
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP's hidden states ``[T, hidden]`` before ``shared_head.norm``, for tokens ``x_{p+1}``
        (``batch.input_ids``) at positions ``p`` and the previous hidden states ``h_p`` (``hidden``)."""
        x = self.embed(batch.input_ids)
        x = self.eh_proj(torch.cat([self.enorm(x), self.hnorm(hidden.to(x.dtype))], dim=-1))
        x, residual = self.layers[0](self.rope_tables(batch.positions, x.dtype), x, None, batch)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits of the MTP's pre-norm hidden states (``shared_head.norm``, then the head)."""
        return super().compute_logits(self.norm(hidden))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The MTP layer's tensors only, renamed as a one-layer model's (its decoder layer as layer 0)."""
        return super().checkpoint_tensors(self._renamed(weights))

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        prefix = f"model.layers.{self.source_layer}."
        own = {"shared_head.norm.weight": "model.norm.weight", "shared_head.head.weight": "lm_head.weight", "embed_tokens.weight": "model.embed_tokens.weight",
               "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight"}  # fmt: skip
        for name, source in weights:
            if name.startswith(prefix):
                rest = name[len(prefix) :]
                yield own.get(rest, "model.layers.0." + rest), source

    def _check_complete(self, params: dict, loaded: set[str]) -> None:
        """As the model's, but the embedding and head may be absent (the target's are used)."""
        super()._check_complete({k: v for k, v in params.items() if k not in SHARED_PARAMS or k in loaded}, loaded)

    def share(self, target: DeepseekForCausalLM, loaded: set[str]) -> None:
        """Use the target's embedding and head where the checkpoint has none for the MTP or equal ones."""
        if "embed_tokens.weight" not in loaded or torch.equal(self.embed_tokens.weight, target.embed_tokens.weight):
            self.embed_tokens = target.embed_tokens
        target_head = target.embed_tokens if target.lm_head is None else target.lm_head
        if self.lm_head is None or "lm_head.weight" not in loaded or torch.equal(self.lm_head.weight, target_head.weight):
            self.lm_head, self.head_fp32 = target.lm_head, target.head_fp32
            if target.lm_head is None:  # tied: the head is the target's embedding
                self.lm_head = _TiedHead(target.embed_tokens)


class _TiedHead(nn.Module):
    """A head that is an embedding table (a tied target's)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """The config of a one-layer model holding the first MTP layer of ``cfg``."""
    moe = cfg.moe if cfg.moe is None else dataclasses.replace(cfg.moe, sparse_layers=(cfg.sparse(cfg.num_layers),))
    return dataclasses.replace(cfg, num_layers=1, moe=moe, mtp_layers=0, tie_word_embeddings=False)
