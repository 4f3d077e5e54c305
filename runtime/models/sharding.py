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
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    if cfg.linear is not None and size > 1:
        raise ValueError(f"tp_size {size} (--tp-size): a hybrid linear-attention model ({cfg.architecture}) runs on one rank only")
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
    return TPShard(rank, size, head_range, kv_range, inter, vocab, per_rank, experts, shared)


def _split_rows(rows: int, size: int, rank: int, what: str) -> tuple[int, int]:
    """Rank ``rank``'s slice of an MLP's ``rows`` intermediate rows (whole quantization groups where they allow)."""
    if rows < size:
        raise ValueError(f"tp_size {size} is larger than the {what} {rows}")
    unit = QUANT_GROUP if rows % QUANT_GROUP == 0 and rows // QUANT_GROUP >= size else 1
    return _split(rows, size, rank, unit)


def shard_rows(shard: TPShard, cfg: ModelConfig, hf_module: str) -> tuple[int, int, int] | None:
    """``(dim, start, stop)`` of a checkpoint tensor that this rank keeps, or None for all of it.

    ``hf_module`` is the Hugging Face module name without layer prefix or ``.weight``/``.bias``
    (``self_attn.q_proj``, ``mlp.down_proj``, ``embed_tokens``, ``lm_head``, …).
    """
    if cfg.mla is not None and hf_module in _MLA_ROWS:
        per_head = _MLA_ROWS[hf_module](cfg)
        return (1 if hf_module == "self_attn.o_proj" else 0), shard.heads[0] * per_head, shard.heads[1] * per_head
    d = cfg.head_dim
    if hf_module == "self_attn.q_proj":
        return 0, shard.heads[0] * d, shard.heads[1] * d
    if hf_module in ("self_attn.k_proj", "self_attn.v_proj"):
        return 0, shard.kv_heads[0] * d, shard.kv_heads[1] * d
    if hf_module == "self_attn.sinks":
        return 0, *shard.heads
    if hf_module == "self_attn.o_proj":
        return 1, shard.heads[0] * d, shard.heads[1] * d
    mlp = _MLP_PART.match(hf_module)
    if mlp:
        owner, part = mlp.groups()
        rows = shard.intermediate if owner == "mlp" else shard.shared_intermediate if owner.endswith("shared_experts") else shard.expert_intermediate
        return (1, *rows) if part == "down_proj" else (0, *rows)
    if hf_module in ("embed_tokens", "lm_head"):
        return 0, *shard.vocab
    return None
