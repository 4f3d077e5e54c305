"""The Llama family (Llama, SmolLM2, Mistral, Qwen2): decoder layers over the paged KV pool.

Differences inside the family are configuration: Qwen2 has q/k/v biases, SmolLM2 ties the
output head to the embedding, Llama 3 scales RoPE frequencies, Mistral's sliding window caps the
context length. Attention itself is delegated to the batch's attention backend, which reads the
cached prefix through the slot table and writes the new tokens' KV into the pool.

Under tensor parallelism (``shard`` and ``group`` given) each rank builds the same modules at its
shard's sizes (see ``radixlm.runtime.models.sharding``) and sums the partial outputs of the
row-parallel projections and of the vocabulary-parallel embedding with one all-reduce each.

Top to bottom: attention, MLP, the decoder layer (norm, attention, norm, MLP), the model
(embedding, layers, final norm, head), then loading Hugging Face-named weights into it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.layers.activation import silu_and_mul
from radixlm.runtime.layers.decode_stack import DecodeStacks, StackLayer
from radixlm.runtime.layers.forward_batch import ForwardBatch
from radixlm.runtime.layers.norm import RMSNorm
from radixlm.runtime.layers.rope import RotaryEmbedding, apply_rotary
from radixlm.runtime.models.config import ModelConfig
from radixlm.runtime.models.registry import register_family
from radixlm.runtime.models.sharding import TPShard, shard_rows

if TYPE_CHECKING:
    from radixlm.runtime.distributed.group import TPGroup


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with fused q/k/v projection and RoPE."""

    def __init__(self, cfg: ModelConfig, layer_id: int, shard: TPShard | None = None, group: TPGroup | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_heads if shard is None else shard.num_heads
        self.num_kv_heads = cfg.num_kv_heads if shard is None else shard.num_kv_heads
        self.head_dim = cfg.head_dim
        self.group = group
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attend each new token to its sequence's cached prefix and to earlier new tokens."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, rope)
        out = self.o_proj(batch.attn_backend.forward(q, k, v, self.layer_id, batch))
        return out if self.group is None else self.group.all_reduce(out)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with a fused gate/up projection."""

    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None, group: TPGroup | None = None) -> None:
        super().__init__()
        inter = cfg.intermediate_size if shard is None else shard.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, projected back to the hidden size."""
        out = self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return out if self.group is None else self.group.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, cfg: ModelConfig, layer_id: int, shard: TPShard | None = None, group: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id, shard, group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, shard, group)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One transformer block on the previous block's output and the residual stream (None
        for the first block); returns this block's output and the residual stream before it.

        Each residual add is fused into the norm that follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_forward(x, residual)
        residual, h = self.post_attention_layernorm.add_forward(self.self_attn(rope, h, batch), residual)
        return self.mlp(h), residual

    def stack_layer(self) -> StackLayer:
        """This layer's parts, as the fused C++ decode stack reads them."""
        attn, mlp = self.self_attn, self.mlp
        return StackLayer(
            attn.num_heads, attn.num_kv_heads, attn.head_dim, self.input_layernorm, attn.qkv_proj, attn.o_proj,
            self.post_attention_layernorm, mlp.gate_up_proj, mlp.down_proj,
        )  # fmt: skip


@register_family(LlamaForCausalLM="llama", MistralForCausalLM="mistral", Qwen2ForCausalLM="qwen2")
class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM that runs flat token batches over the paged KV pool.

    With a tensor-parallel ``shard``, the model holds only that rank's slices and
    ``compute_logits`` returns the logits of its vocabulary slice."""

    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None, group: TPGroup | None = None) -> None:
        super().__init__()
        self.config, self.shard, self.group = cfg, shard, group
        vocab = cfg.vocab_size if shard is None else shard.vocab_size
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        # given weight storage: no random init (whose first call imports torch._dynamo, ~1.5 s)
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size, _weight=torch.empty(vocab, cfg.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, shard, group) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab, bias=False)
        self.head_fp32: torch.Tensor | None = None
        self.decode_stacks = DecodeStacks(self.layers, group is not None)  # decode steps on CPUs, every layer in one C++ call

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``input_ids`` (summed over the ranks' vocabulary slices under TP)."""
        if self.shard is None:
            return self.embed_tokens(input_ids)
        first, stop = self.shard.vocab
        local = input_ids - first
        inside = (local >= 0) & (local < stop - first)
        x = self.embed_tokens(local.clamp(0, stop - first - 1)) * inside.unsqueeze(-1).to(self.embed_tokens.weight.dtype)
        return self.group.all_reduce(x)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the batch's new tokens."""
        x = self.embed(batch.input_ids)
        rope = self.rotary.table(batch.positions, x.dtype)
        stacked = self.decode_stacks.run(x, rope, batch)
        if stacked is not None:
            x, residual = stacked
            return self.norm.add_forward(x, residual)[1]
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, batch)
        return self.norm.add_forward(x, residual)[1] if residual is not None else self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (fp32) for the given hidden states."""
        if self.head_fp32 is not None:
            return F.linear(hidden.float(), self.head_fp32)
        if self.lm_head is None:  # tied to the embedding
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def keep_head_in_fp32(self) -> None:
        """Compute logits from an fp32 copy of the output head (used when the model runs in bf16/fp16).

        The head is the widest matmul; on CPUs a bf16 matrix-vector product there is slower than
        fp32, and fp32 logits keep logprobs and near-ties faithful.
        """
        weight = getattr(self.embed_tokens if self.lm_head is None else self.lm_head, "weight", None)
        if weight is None or type(self.lm_head) not in (nn.Linear, type(None)) or not isinstance(self.embed_tokens, nn.Embedding):
            return  # a head kept in a stored format computes in fp32 already
        self.head_fp32 = weight.detach().float()

    # ---------------------------------------------------------------- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into this model's (partly fused) parameters."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        cfg, shard = self.config, self.shard
        qkv_sizes = self._qkv_sizes()
        for name, source in weights:
            target, offset = self.weight_target(name)
            if target is None:
                continue
            if target not in params:
                if name.endswith(".bias") and not source[:].any():
                    continue  # GPTQ writers save a zero bias for every quantized layer
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            tensor = _take(source, None if shard is None else shard_rows(shard, cfg, _module_of(name)))
            param = params[target]
            dst = param.data if offset is None else param.data.narrow(0, offset, tensor.shape[0])
            if dst.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(target if offset is None else f"{target}@{offset}")
        self._check_complete(params, loaded, qkv_sizes)

    def _qkv_sizes(self) -> list[int]:
        attn = self.layers[0].self_attn
        return [attn.q_size, attn.kv_size, attn.kv_size]

    def _intermediate_size(self) -> int:
        return self.config.intermediate_size if self.shard is None else self.shard.intermediate_size

    def weight_target(self, name: str) -> tuple[str | None, int | None]:
        """Where the checkpoint tensor ``name`` goes: this model's parameter and the row it starts
        at within a fused one (None), or ``(None, None)`` for a tensor the model does not keep."""
        qkv_sizes, inter = self._qkv_sizes(), self._intermediate_size()
        if "rotary_emb" in name:
            return None, None
        if name == "lm_head.weight" and self.lm_head is None:
            return None, None  # tied to the embedding
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            return name.removeprefix("model."), None
        if name == "lm_head.weight":
            return name, None
        m = _LAYER_NAME.match(name)
        if not m:
            return name, None
        layer, module, kind = m.groups()
        if module in _FUSED:
            fused, shard = _FUSED[module]
            sizes = qkv_sizes if fused.endswith("qkv_proj") else [inter, inter]
            return f"layers.{layer}.{fused}.{kind}", sum(sizes[:shard])
        return f"layers.{layer}.{module}.{kind}", None

    def _check_complete(self, params: dict, loaded: set[str], qkv_sizes: list[int]) -> None:
        missing = []
        for name in params:
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                offsets = [sum(qkv_sizes[:i]) for i in range(3)]
            elif name.endswith("gate_up_proj.weight"):
                offsets = [0, self._intermediate_size()]
            else:
                offsets = [None]
            for off in offsets:
                if (name if off is None else f"{name}@{off}") not in loaded:
                    missing.append(name)
                    break
        if missing:
            raise ValueError(f"checkpoint is missing weights for {missing[:5]}{' …' if len(missing) > 5 else ''}")


# ------------------------------------------------ checkpoint names → this model's parameters
# Hugging Face parameter names → (our parameter, shard index within a fused parameter).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def _module_of(hf_name: str) -> str:
    """``model.layers.3.mlp.down_proj.weight`` → ``mlp.down_proj``; ``model.embed_tokens.weight`` → ``embed_tokens``."""
    m = _LAYER_NAME.match(hf_name)
    if m:
        return m.group(2)
    return hf_name.removeprefix("model.").rsplit(".", 1)[0]


def _take(source, rows: tuple[int, int, int] | None) -> torch.Tensor:
    """The part of a checkpoint tensor (a tensor or a lazy safetensors slice) this rank keeps."""
    if rows is None:
        return source[:]
    dim, start, stop = rows
    if dim == 1 and len(source.get_shape() if hasattr(source, "get_shape") else source.shape) == 1:
        raise ValueError("tensor parallelism cannot split a row-parallel projection's bias")
    return source[start:stop] if dim == 0 else source[:, start:stop]
