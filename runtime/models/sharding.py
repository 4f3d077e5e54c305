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

Slices of the intermediate size are whole multiples of 32 where it allows, so the row-parallel
down projection can still be quantized to int4 (groups of 32 inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixlm.runtime.models.config import ModelConfig

QUANT_GROUP = 32


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
    inter = cfg.intermediate_size
    unit = QUANT_GROUP if inter % QUANT_GROUP == 0 and inter // QUANT_GROUP >= size else 1
    if inter < size:
        raise ValueError(f"tp_size {size} is larger than the intermediate size {inter}")
    per_rank = -(-cfg.vocab_size // size)
    vocab = (min(rank * per_rank, cfg.vocab_size), min((rank + 1) * per_rank, cfg.vocab_size))
    return TPShard(rank, size, head_range, kv_range, _split(inter, size, rank, unit), vocab, per_rank)


def shard_rows(shard: TPShard, cfg: ModelConfig, hf_module: str) -> tuple[int, int, int] | None:
    """``(dim, start, stop)`` of a checkpoint tensor that this rank keeps, or None for all of it.

    ``hf_module`` is the Hugging Face module name without layer prefix or ``.weight``/``.bias``
    (``self_attn.q_proj``, ``mlp.down_proj``, ``embed_tokens``, ``lm_head``, …).
    """
    d = cfg.head_dim
    if hf_module == "self_attn.q_proj":
        return 0, shard.heads[0] * d, shard.heads[1] * d
    if hf_module in ("self_attn.k_proj", "self_attn.v_proj"):
        return 0, shard.kv_heads[0] * d, shard.kv_heads[1] * d
    if hf_module == "self_attn.sinks":
        return 0, *shard.heads
    if hf_module == "self_attn.o_proj":
        return 1, shard.heads[0] * d, shard.heads[1] * d
    if hf_module in ("mlp.gate_proj", "mlp.up_proj"):
        return 0, *shard.intermediate
    if hf_module == "mlp.down_proj":
        return 1, *shard.intermediate
    if hf_module in ("embed_tokens", "lm_head"):
        return 0, *shard.vocab
    return None
