"""The dense decoder every family is built from: attention, gated MLP, decoder layer, causal LM.

A family is this decoder with its choices made: a ``DenseArch`` (what its layers have beyond
Llama's: per-head q/k norms, Gemma's four norms a layer, ``(1 + w)`` norms, scaled embeddings,
attention sinks) and its checkpoint names, registered in ``radixlm.runtime.models.registry``.
What varies per layer comes from the config (``ModelConfig.window``, ``uses_rope``, Gemma 3's
local RoPE base) and reaches the attention backend as an ``AttentionSpec``. A config with
``mla`` (DeepSeek) attends through ``LatentAttention`` over a latent pool instead of grouped-query
attention; the rest of the layer is the same.

Attention itself is delegated to the batch's attention backend, which reads the cached prefix
through the slot table and writes the new tokens' KV into the pool. Under tensor parallelism
(``shard`` and ``group`` given) each rank builds the same modules at its shard's sizes (see
``radixlm.runtime.models.sharding``) and sums the partial outputs of the row-parallel
projections and of the vocabulary-parallel embedding with one all-reduce each.

One layer, as the two norm layouts compute it (the residual add is fused into the next norm)::

    Llama:  x ─ norm ─ attn ─(+)─ norm ─ mlp ─(+)─
    Gemma:  x ─ norm ─ attn ─ norm ─(+)─ norm ─ mlp ─ norm ─(+)─
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.layers.activation import clamped_swiglu, gelu_tanh_and_mul, silu_and_mul
from radixlm.runtime.layers.attention_spec import AttentionSpec
from radixlm.runtime.layers.decode_stack import DecodeStacks, StackDeltaLayer, StackLayer
from radixlm.runtime.layers.forward_batch import ForwardBatch
from radixlm.runtime.layers.gated_delta import GatedDeltaNet
from radixlm.runtime.layers.mla import LatentAttention
from radixlm.runtime.layers.moe import MoEBlock
from radixlm.runtime.layers.norm import RMSNorm
from radixlm.runtime.layers.rope import RotaryEmbedding, apply_rotary
from radixlm.runtime.models.config import ModelConfig
from radixlm.runtime.models.sharding import Spans, TPShard, linear_spec, shard_spans
from radixlm.runtime.models.weight_names import FUSED, module_of, target_of

if TYPE_CHECKING:
    from radixlm.runtime.distributed.group import TPGroup

RopeTable = tuple[torch.Tensor, torch.Tensor]

ACTIVATIONS: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {
    # the config's hidden_act -> (the decode stack's name for it, the function)
    "silu": ("silu", silu_and_mul),
    "swish": ("silu", silu_and_mul),
    "gelu_pytorch_tanh": ("gelu_tanh", gelu_tanh_and_mul),
    "gelu_tanh": ("gelu_tanh", gelu_tanh_and_mul),
}


@dataclass(frozen=True)
class DenseArch:
    """What a family's decoder layers have beyond Llama's."""

    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k, before RoPE
    sandwich_norms: bool = False  # Gemma 2/3: norms on the attention and MLP outputs too (four a layer)
    norm_offset: float = 0.0  # Gemma: norms scale by (1 + weight); the 1 is added to the weights at load
    embed_scale: bool = False  # Gemma: embeddings multiplied by sqrt(hidden_size)
    sinks: bool = False  # GPT-OSS: a learned attention-sink logit per query head
    attn_output_gate: bool = False  # Qwen3-Next, Qwen3.5: q_proj gives each head a gate too; output * sigmoid(gate)


class DenseAttention(nn.Module):
    """Grouped-query self-attention with fused q/k/v projection, RoPE and the layer's AttentionSpec."""

    def __init__(self, cfg: ModelConfig, arch: DenseArch, layer_id: int, shard: TPShard | None = None, group: TPGroup | None = None) -> None:
        super().__init__()
        self.layer_id = cfg.pool_layer(layer_id)  # the KV pool's layer (hybrid models keep KV for their attention layers only)
        self.num_heads = cfg.num_heads if shard is None else shard.num_heads
        self.num_kv_heads = cfg.num_kv_heads if shard is None else shard.num_kv_heads
        self.head_dim = cfg.head_dim
        self.group = group
        self.gated = arch.attn_output_gate
        self.q_size = self.num_heads * cfg.head_dim * (2 if self.gated else 1)  # gated: each head's query, then its gate
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if arch.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if arch.sinks else None
        self.rope_table = rope_table_of(cfg, layer_id)
        scale = cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else cfg.head_dim**-0.5
        self._spec = (scale, cfg.window(layer_id), cfg.attn_logit_softcapping)

    def spec(self) -> AttentionSpec:
        """This layer's scale, window, soft-cap and sinks, as the attention backends take them."""
        scale, window, softcap = self._spec
        return AttentionSpec(scale, window, softcap, None if self.sinks is None else self.sinks.float())

    def forward(self, ropes: list[RopeTable], x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attend each new token to its sequence's cached prefix and to earlier new tokens."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.gated:
            q, gate = q.reshape(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(-1, self.num_heads * self.head_dim)
        if self.q_norm is not None:  # over each head's dims, as one [T * H, D] batch of rows
            q, k = self.q_norm(q.reshape(-1, self.head_dim)), self.k_norm(k.reshape(-1, self.head_dim))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.rope_table is not None:
            q, k = apply_rotary(q, k, ropes[self.rope_table])
        out = batch.attn_backend.forward(q, k, v, self.layer_id, batch, self.spec())
        if gate is not None:
            out = out * torch.sigmoid(gate)
        out = self.o_proj(out)
        return out if self.group is None else self.group.all_reduce(out)


class DenseMLP(nn.Module):
    """Gated feed-forward (SwiGLU or GeGLU) with a fused gate/up projection."""

    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None, group: TPGroup | None = None) -> None:
        super().__init__()
        self.activation, self.act_fn = _activation(cfg)
        inter = cfg.intermediate_size if shard is None else shard.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, projected back to the hidden size."""
        out = self.down_proj(self.act_fn(self.gate_up_proj(x)))
        return out if self.group is None else self.group.all_reduce(out)


class DenseDecoderLayer(nn.Module):
    """Attention and MLP blocks with pre-norms (and, for Gemma, post-norms) around residual adds."""

    def __init__(self, cfg: ModelConfig, arch: DenseArch, layer_id: int, shard: TPShard | None = None, group: TPGroup | None = None) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        if cfg.is_linear(layer_id):  # a hybrid model's linear-attention layer: a recurrent state, no KV
            self.linear_attn = GatedDeltaNet(hidden, linear_spec(cfg, shard), cfg.pool_layer(layer_id), eps, group)
        else:
            self.self_attn = DenseAttention(cfg, arch, layer_id, shard, group) if cfg.mla is None else latent_attention(cfg, layer_id, shard, group)
        self.post_attention_layernorm = RMSNorm(hidden, eps)  # Gemma: on the attention output; else: before the MLP
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps) if arch.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(hidden, eps) if arch.sandwich_norms else None
        self.mlp = moe_block(cfg, shard, group) if cfg.sparse(layer_id) else DenseMLP(cfg, shard, group)

    def forward(self, ropes: list[RopeTable], x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """One block on the previous block's output and the residual stream (None for the first
        block); returns this block's output and the residual stream before it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_forward(x, residual)
        attn = self.linear_attn(h, batch) if hasattr(self, "linear_attn") else self.self_attn(ropes, h, batch)
        if self.pre_feedforward_layernorm is None:
            residual, h = self.post_attention_layernorm.add_forward(attn, residual)
            return self.mlp(h), residual
        residual, h = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm(attn), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual

    def stack_layer(self) -> StackLayer | StackDeltaLayer | None:
        """This layer's parts, as the fused C++ decode stack reads them (None: it has no stack form, as
        latent attention)."""
        attn, mlp = getattr(self, "self_attn", None), self.mlp
        dense = isinstance(mlp, DenseMLP)
        gate_up, down, activation = (mlp.gate_up_proj, mlp.down_proj, mlp.activation) if dense else (None, None, "silu")
        experts = None if dense else mlp
        sandwich = self.pre_feedforward_layernorm is not None
        if hasattr(self, "linear_attn"):
            if sandwich:
                return None
            return StackDeltaLayer(self.input_layernorm, self.linear_attn, self.post_attention_layernorm, gate_up, down, activation, experts)
        if not isinstance(attn, DenseAttention):
            return None
        return StackLayer(
            attn.num_heads, attn.num_kv_heads, attn.head_dim, self.input_layernorm, attn.qkv_proj, attn.o_proj,
            self.pre_feedforward_layernorm if sandwich else self.post_attention_layernorm, gate_up, down,
            attention=attn.spec(), q_norm=attn.q_norm, k_norm=attn.k_norm, rope_table=attn.rope_table,
            attn_out_norm=self.post_attention_layernorm if sandwich else None,
            mlp_out_norm=self.post_feedforward_layernorm, activation=activation, output_gate=attn.gated, experts=experts,
        )  # fmt: skip


def latent_attention(cfg: ModelConfig, layer_id: int, shard: TPShard | None = None, group: TPGroup | None = None) -> LatentAttention:
    """The multi-head latent attention of layer ``layer_id`` of an MLA model ``cfg``, at this rank's heads."""
    heads = cfg.num_heads if shard is None else shard.num_heads
    scale = cfg.mla.softmax_scale(cfg.rope_scaling)
    return LatentAttention(cfg.hidden_size, heads, cfg.mla, layer_id, scale, cfg.attention_bias, rope_table_of(cfg, layer_id), group)


def moe_block(cfg: ModelConfig, shard: TPShard | None = None, group: TPGroup | None = None) -> MoEBlock:
    """The routed experts (and shared experts) of a sparse layer of ``cfg``, at this rank's slice."""
    moe = cfg.moe
    if moe.swiglu_limit is not None:
        act_fn = functools.partial(clamped_swiglu, alpha=moe.swiglu_alpha, limit=moe.swiglu_limit)
    else:
        act_fn = _activation(cfg)[1]
    if shard is None:
        return MoEBlock(cfg.hidden_size, moe.router, moe.intermediate_size, act_fn, moe.shared_intermediate_size, bias=moe.expert_bias, shared_gate=moe.shared_gate)
    inter, shared = shard.expert_intermediate_size, shard.shared_intermediate_size
    return MoEBlock(cfg.hidden_size, moe.router, inter, act_fn, shared, group, bias=moe.expert_bias, shared_gate=moe.shared_gate)


def _activation(cfg: ModelConfig) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The config's MLP activation: the decode stack's name for it and the function."""
    if cfg.hidden_act not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; radixlm runs {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[cfg.hidden_act]


def rope_table_of(cfg: ModelConfig, layer: int) -> int | None:
    """Which RoPE table ``layer`` rotates with: 0 the model's, 1 the sliding layers' own (Gemma 3), None none (NoPE)."""
    if not cfg.uses_rope(layer):
        return None
    return 1 if cfg.local_rope_theta is not None and cfg.window(layer) is not None else 0


class DenseForCausalLM(nn.Module):
    """A dense causal LM over the paged KV pool; a family subclasses it with its ``arch``.

    With a tensor-parallel ``shard``, the model holds only that rank's slices and
    ``compute_logits`` returns the logits of its vocabulary slice."""

    arch = DenseArch()
    plain_norms: tuple[str, ...] = ()  # norms that keep their weights as stored where the family's others add norm_offset
    keep_hidden = False  # set by a proposer that reads each pass's pre-norm hidden states (DeepSeek's MTP)
    kept_hidden: torch.Tensor | None = None  # while keep_hidden: the last pass's ``[T, hidden]`` before the final norm

    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None, group: TPGroup | None = None) -> None:
        super().__init__()
        self.config, self.shard, self.group = cfg, shard, group
        vocab = cfg.vocab_size if shard is None else shard.vocab_size
        self.rotary = _rotary(cfg, cfg.rope_theta, cfg.rope_scaling)
        self.local_rotary = None if cfg.local_rope_theta is None else _rotary(cfg, cfg.local_rope_theta, cfg.local_rope_scaling)
        # given weight storage: no random init (whose first call imports torch._dynamo, ~1.5 s)
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size, _weight=torch.empty(vocab, cfg.hidden_size))
        self.layers = nn.ModuleList(DenseDecoderLayer(cfg, self.arch, i, shard, group) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab, bias=False)
        self.head_fp32: torch.Tensor | None = None
        self.decode_stacks = DecodeStacks(self.layers, group is not None)  # decode steps on CPUs, every layer in one C++ call

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``input_ids`` (summed over the ranks' vocabulary slices under TP)."""
        if self.shard is None:
            x = self.embed_tokens(input_ids)
        else:
            first, stop = self.shard.vocab
            local = input_ids - first
            inside = (local >= 0) & (local < stop - first)
            x = self.embed_tokens(local.clamp(0, stop - first - 1)) * inside.unsqueeze(-1).to(self.embed_tokens.weight.dtype)
            x = self.group.all_reduce(x)
        if self.arch.embed_scale:  # in the activations' dtype, as transformers rounds it
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> list[RopeTable]:
        """The cos/sin tables of this forward's positions: the model's, then the sliding layers' own."""
        tables = [self.rotary.table(positions, dtype)]
        if self.local_rotary is not None:
            tables.append(self.local_rotary.table(positions, dtype))
        return tables

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the batch's new tokens."""
        x = self.embed(batch.input_ids)
        ropes = self.rope_tables(batch.positions, x.dtype)
        stacked = self.decode_stacks.run(x, ropes, batch)
        if stacked is not None:
            return self._final_norm(*stacked)
        residual = None
        for layer in self.layers:
            x, residual = layer(ropes, x, residual, batch)
        return self._final_norm(x, residual)

    def _final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The final norm of the last block's output; the pre-norm sum kept in ``kept_hidden`` while ``keep_hidden``."""
        if residual is None:
            total, out = x, self.norm(x)
        else:
            total, out = self.norm.add_forward(x, residual)
        if self.keep_hidden:
            self.kept_hidden = total
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (fp32) for the given hidden states (soft-capped where the family caps them)."""
        if self.head_fp32 is not None:
            logits = F.linear(hidden.float(), self.head_fp32)
        elif self.lm_head is None:  # tied to the embedding
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def keep_head_in_fp32(self) -> None:
        """Compute logits from an fp32 copy of the output head (used when the model runs in bf16/fp16).

        The head is the widest matmul; on CPUs a bf16 matrix-vector product there is slower than
        fp32, and fp32 logits keep logprobs and near-ties faithful.
        """
        weight = getattr(self.embed_tokens if self.lm_head is None else self.lm_head, "weight", None)
        if weight is None or type(self.lm_head) not in (nn.Linear, type(None)) or not isinstance(self.embed_tokens, nn.Embedding):
            return  # a head kept in a stored format computes in fp32 already
        self.head_fp32 = weight.detach().float()

    def rebuild_buffers(self, device: torch.device) -> None:
        """Recompute the RoPE tables on ``device`` (after building on the meta device discarded them)."""
        for rotary in (self.rotary, self.local_rotary):
            if rotary is not None:
                rotary.rebuild(device)

    # ---------------------------------------------------------------- weights
    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's plain tensors under the names and values ``weight_target`` expects
        (a family whose checkpoints differ from the Hugging Face Llama layout converts them here)."""
        offset = self.arch.norm_offset
        for name, source in weights:
            if offset and name.endswith("norm.weight") and not name.endswith(self.plain_norms):
                yield name, source[:].float() + offset
            else:
                yield name, source

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into this model's (partly fused) parameters."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        cfg, shard = self.config, self.shard
        for name, source in self.checkpoint_tensors(weights):
            target, offset = self.weight_target(name)
            if target is None:
                continue
            if target not in params:
                if name.endswith(".bias") and not source[:].any():
                    continue  # GPTQ writers save a zero bias for every quantized layer
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            tensor = _take(source, None if shard is None else shard_spans(shard, cfg, module_of(name)), shard)
            param = params[target]
            dst = param.data if offset is None else param.data.narrow(0, offset, tensor.shape[0])
            if dst.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(target if offset is None else f"{target}@{offset}")
        self._check_complete(params, loaded)

    def weight_target(self, name: str) -> tuple[str | None, int | None]:
        """Where the checkpoint tensor ``name`` goes: this model's parameter and the row it starts
        at within a fused one (None), or ``(None, None)`` for a tensor the model does not keep."""
        if name == "lm_head.weight" and self.lm_head is None:
            return None, None  # tied to the embedding
        target = target_of(name)
        if target is None:
            return None, None
        if target.part is None:
            return target.param, (0 if target.module.endswith(FUSED) else None)
        return target.param, sum(self._part_sizes(target.module)[: target.part])

    def _part_sizes(self, fused: str) -> list[int]:
        """The row counts of a fused projection's parts: q, k, v or gate, up."""
        if fused.endswith("qkv_proj"):
            attn = self.get_submodule(fused.rsplit(".", 1)[0])
            return [attn.q_size, attn.kv_size, attn.kv_size]
        if fused.endswith("in_proj"):
            return self.get_submodule(fused.rsplit(".", 1)[0]).part_sizes()
        rows = self.get_submodule(fused).out_features
        return [rows // 2, rows // 2]

    def _check_complete(self, params: dict, loaded: set[str]) -> None:
        missing = []
        for name in params:
            module, _, kind = name.rpartition(".")
            if module.endswith(FUSED) and kind in ("weight", "bias"):
                sizes = self._part_sizes(module)
                offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            else:
                offsets = [None]
            for off in offsets:
                if (name if off is None else f"{name}@{off}") not in loaded:
                    missing.append(name)
                    break
        if missing:
            raise ValueError(f"checkpoint is missing weights for {missing[:5]}{' …' if len(missing) > 5 else ''}")


def _rotary(cfg: ModelConfig, theta: float, scaling: dict | None) -> RotaryEmbedding:
    """The RoPE table of ``cfg``'s heads at base ``theta`` (rotating the configured share of each head)."""
    rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
    if rotary_dim == cfg.head_dim:
        return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, theta, scaling)
    return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, theta, scaling, rotary_dim=rotary_dim)


def _take(source, spans: Spans | None, shard: TPShard | None = None) -> torch.Tensor:
    """The part of a checkpoint tensor (a tensor or a lazy safetensors slice) this rank keeps.

    A row-parallel projection's bias is added once to the sum of the ranks' partial outputs:
    rank 0 keeps it, the others hold zeros."""
    if spans is None:
        return source[:]
    dim, ranges = spans
    if dim == 1 and len(source.get_shape() if hasattr(source, "get_shape") else source.shape) == 1:
        bias = source[:]
        return bias if shard is None or shard.rank == 0 else torch.zeros_like(bias)
    parts = [source[start:stop] if dim == 0 else source[:, start:stop] for start, stop in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
