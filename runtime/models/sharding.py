"""How a dense decoder splits across tensor-parallel ranks (Megatron-style).

Column-parallel (each rank keeps a slice of the output rows): the fused q/k/v projection (its
rank's query heads and the KV heads they read) and the fused gate/up projection (a slice of the
intermediate size). Row-parallel (a slice of the input columns, partial sums all-reduced): the
output projection and the down projection. Vocabulary-parallel: the embedding and the output head
each keep a contiguous slice of the vocabulary. Per-head attention sinks go with their heads;
norms (the hidden-size ones and the per-head q/k norms) are whole on every rank.

Query heads go with their KV head, so every rank keeps grouped-query attention's uniform group:

- at least as many KV heads as ranks: each rank takes whole KV groups, as evenly as possible
  (SmolLM2, 3 KV heads of 3 query heads each: tp=2 gives 2 groups and 1 group, tp=3 one each);
- fewer KV heads than ranks: each KV head is replicated on ``tp / Hkv`` ranks, which split its
  query heads (needs ``tp`` a multiple of ``Hkv`` and the group divisible by the replication).

Multi-head latent attention (DeepSeek) splits by query heads as DeepSeek's own code does: each
rank keeps its heads' rows of the query projection (``q_proj``, or ``q_b_proj`` after the
shared ``q_a_proj``) and of ``kv_b_proj`` (their nope keys and values), and their columns of
``o_proj``; the latent projections (``q_a_proj``, ``kv_a_proj_with_mqa``) and their norms are
whole on every rank, so every rank computes and stores the same latent rows for its own heads.

Slices of the intermediate size are whole multiples of 32 where it allows, so the row-parallel
down projection can still be quantized to int4 (groups of 32 inputs).

Mixture-of-experts layers split the same way inside every expert: each rank keeps a slice of
each routed expert's intermediate size (and of the shared experts'), so every rank runs every
chosen expert on a slice and one all-reduce sums the block. The alternative, whole experts per
rank, reads fewer, larger matrices but leaves ranks idle when a batch's tokens choose experts
on one rank; at batch 1 (k of E experts chosen) it would put all of a token's work on at most k
ranks. The router is whole on every rank, so all ranks choose the same experts.

A hybrid model's Gated DeltaNet layers split by key heads, each with the value heads that read
it (as grouped-query attention splits by KV heads): a rank keeps its heads' rows of the q, k and v
parts of ``in_proj_qkv`` and of the short convolution's channels (three spans each), its value
heads' rows of ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``A_log`` and ``dt_bias``, and their
columns of ``out_proj`` (row-parallel, all-reduced). The gated output norm acts per value head and
is whole on every rank. So each rank holds the recurrent and convolution states of its own heads
only; the per-request state pool and the tree's snapshots split with them. The full-attention
layers' ``q_proj`` holds each head's query and gate side by side: a rank keeps both for its heads.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixlm.runtime.layers.gated_delta import GatedDeltaSpec
    from radixlm.runtime.models.config import ModelConfig

QUANT_GROUP = 32
_MLA_ROWS = {  # latent attention's per-head projections -> each head's rows (o_proj: columns)
    "self_attn.q_proj": lambda cfg: cfg.mla.qk_head_dim,
    "self_attn.q_b_proj": lambda cfg: cfg.mla.qk_head_dim,
    "self_attn.kv_b_proj": lambda cfg: cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim,
    "self_attn.o_proj": lambda cfg: cfg.mla.v_head_dim,
}
_MLP_PART = re.compile(r"^(mlp|mlp\.shared_experts|mlp\.experts\.\d+)\.(gate_proj|up_proj|down_proj)$")


@dataclass(frozen=True)
class TPShard:
    """One rank's share of the model: half-open ranges of heads, KV heads, MLP rows, vocabulary."""

    rank: int
    size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_per_rank: int  # width every rank's logits are padded to before they are gathered
    expert_intermediate: tuple[int, int] = (0, 0)  # each routed expert's rows on this rank (MoE models)
    shared_intermediate: tuple[int, int] = (0, 0)  # the shared experts' rows on this rank
    linear_k_heads: tuple[int, int] = (0, 0)  # hybrid models: the Gated DeltaNet key heads on this rank (with their value heads)

    @property
    def expert_intermediate_size(self) -> int:
        """Rows of each routed expert's gate (and up) projection on this rank."""
        return self.expert_intermediate[1] - self.expert_intermediate[0]

    @property
    def shared_intermediate_size(self) -> int:
        """Rows of the shared experts' gate (and up) projection on this rank."""
        return self.shared_intermediate[1] - self.shared_intermediate[0]

    @property
    def num_heads(self) -> int:
        """Query heads on this rank."""
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        """KV heads on this rank (its KV pool's width)."""
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        """MLP rows on this rank."""
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_size(self) -> int:
        """Vocabulary rows of the embedding and the head on this rank."""
        return self.vocab[1] - self.vocab[0]


def _split(total: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """The ``index``-th of ``parts`` contiguous, near-equal ranges of ``range(total)`` (in ``unit`` steps)."""
    units = total // unit
    base, extra = divmod(units, parts)
    start = index * base + min(index, extra)
    stop = start + base + (index < extra)
    return start * unit, (stop * unit if index < parts - 1 else total)


def plan_shard(cfg: ModelConfig, rank: int, size: int) -> TPShard:
    """Rank ``rank``'s shard of ``cfg`` when the model is split ``size`` ways."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tp rank {rank} is outside a group of size {size}")
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    linear = (0, 0)
    if cfg.linear is not None:
        if cfg.linear.num_k_heads < size:
            raise ValueError(f"tp_size {size} (--tp-size) is larger than the {cfg.linear.num_k_heads} linear-attention key heads a hybrid model splits across ranks")
        linear = _split(cfg.linear.num_k_heads, size, rank)
    if cfg.mla is not None and size > heads:
        raise ValueError(f"tp_size {size} (--tp-size) is larger than the {heads} attention heads a latent-attention model splits across ranks")
    group = heads // kv
    if kv >= size:
        kv_range = _split(kv, size, rank)
        head_range = (kv_range[0] * group, kv_range[1] * group)
    else:
        replicas = size // kv
        if size % kv or group % replicas:
            raise ValueError(
                f"tp_size {size} cannot split a model with {heads} query heads and {kv} KV heads: with fewer "
                f"KV heads than ranks, tp_size must be a multiple of {kv} and the {group} query heads of each "
                f"KV head must divide evenly among the ranks that share it"
            )
        k = rank // replicas
        per = group // replicas
        kv_range = (k, k + 1)
        first = k * group + (rank % replicas) * per
        head_range = (first, first + per)
    per_rank = -(-cfg.vocab_size // size)
    vocab = (min(rank * per_rank, cfg.vocab_size), min((rank + 1) * per_rank, cfg.vocab_size))
    moe = cfg.moe
    experts = (0, 0) if moe is None else _split_rows(moe.intermediate_size, size, rank, "moe_intermediate_size")
    shared = (0, 0) if moe is None or not moe.shared_intermediate_size else _split_rows(moe.shared_intermediate_size, size, rank, "the shared experts' intermediate size")
    inter = _split_rows(cfg.intermediate_size, size, rank, "intermediate size")
    return TPShard(rank, size, head_range, kv_range, inter, vocab, per_rank, experts, shared, linear)


def linear_spec(cfg: ModelConfig, shard: TPShard | None) -> GatedDeltaSpec | None:
    """The Gated DeltaNet shapes on ``shard``'s rank (its key heads and their value heads); the
    whole model's without a shard, None for a model without linear-attention layers."""
    spec = cfg.linear
    if spec is None or shard is None:
        return spec
    keys = shard.linear_k_heads[1] - shard.linear_k_heads[0]
    return dataclasses.replace(spec, num_k_heads=keys, num_v_heads=keys * (spec.num_v_heads // spec.num_k_heads))


def _split_rows(rows: int, size: int, rank: int, what: str) -> tuple[int, int]:
    """Rank ``rank``'s slice of an MLP's ``rows`` intermediate rows (whole quantization groups where they allow)."""
    if rows < size:
        raise ValueError(f"tp_size {size} is larger than the {what} {rows}")
    unit = QUANT_GROUP if rows % QUANT_GROUP == 0 and rows // QUANT_GROUP >= size else 1
    return _split(rows, size, rank, unit)


Spans = tuple[int, tuple[tuple[int, int], ...]]  # (dim, ((start, stop), ...)): the slices of a tensor a rank keeps, in order


def shard_spans(shard: TPShard, cfg: ModelConfig, hf_module: str) -> Spans | None:
    """``(dim, spans)``: the slices along ``dim`` of a checkpoint tensor that this rank keeps
    (concatenated in order), or None for all of it.

    ``hf_module`` is the Hugging Face module name without layer prefix or ``.weight``/``.bias``
    (``self_attn.q_proj``, ``mlp.down_proj``, ``embed_tokens``, ``lm_head``, ``linear_attn.A_log``, …).
    """
    if cfg.linear is not None and hf_module.startswith("linear_attn."):
        return _linear_spans(shard, cfg.linear, hf_module.removeprefix("linear_attn."))
    if cfg.mla is not None and hf_module in _MLA_ROWS:
        per_head = _MLA_ROWS[hf_module](cfg)
        return (1 if hf_module == "self_attn.o_proj" else 0), ((shard.heads[0] * per_head, shard.heads[1] * per_head),)
    d = cfg.head_dim
    if hf_module == "self_attn.q_proj":
        per_head = d * (2 if cfg.attn_output_gate else 1)  # gated: each head's query rows, then its gate rows
        return 0, ((shard.heads[0] * per_head, shard.heads[1] * per_head),)
    if hf_module in ("self_attn.k_proj", "self_attn.v_proj"):
        return 0, ((shard.kv_heads[0] * d, shard.kv_heads[1] * d),)
    if hf_module == "self_attn.sinks":
        return 0, (shard.heads,)
    if hf_module == "self_attn.o_proj":
        return 1, ((shard.heads[0] * d, shard.heads[1] * d),)
    mlp = _MLP_PART.match(hf_module)
    if mlp:
        owner, part = mlp.groups()
        rows = shard.intermediate if owner == "mlp" else shard.shared_intermediate if owner.endswith("shared_experts") else shard.expert_intermediate
        return (1, (rows,)) if part == "down_proj" else (0, (rows,))
    if hf_module in ("embed_tokens", "lm_head"):
        return 0, (shard.vocab,)
    return None


def _linear_spans(shard: TPShard, spec: GatedDeltaSpec, part: str) -> Spans | None:
    """The slices of a Gated DeltaNet tensor (``part`` of ``linear_attn``) on ``shard``'s rank."""
    k0, k1 = shard.linear_k_heads
    per = spec.num_v_heads // spec.num_k_heads
    v0, v1 = k0 * per, k1 * per
    dk, dv = spec.head_k_dim, spec.head_v_dim
    if part in ("in_proj_qkv", "conv1d"):  # q, k and v side by side: this rank's heads of each
        key = spec.key_dim
        return 0, ((k0 * dk, k1 * dk), (key + k0 * dk, key + k1 * dk), (2 * key + v0 * dv, 2 * key + v1 * dv))
    if part == "in_proj_z":
        return 0, ((v0 * dv, v1 * dv),)
    if part in ("in_proj_b", "in_proj_a", "A_log", "dt_bias"):
        return 0, ((v0, v1),)
    if part == "out_proj":
        return 1, ((v0 * dv, v1 * dv),)
    return None  # the gated output norm: per value head, whole on every rank
