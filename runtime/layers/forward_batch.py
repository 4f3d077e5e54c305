"""ForwardBatch: the tensors and row layout of one model forward pass.

The batch is a flat run of ``T`` new tokens grouped into rows (one row per request). Row ``i``
extends a sequence that already has ``prefix_lens[i]`` tokens of KV in the pool by
``extend_lens[i]`` new tokens. Decode rows (one new token each) come first, then prefill rows::

    tokens:  d0 d1 d2 | p0 p0 p0 p0 | p1 p1        (num_decode = 3)
    rows:    0  1  2  | 3           | 4
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from radixlm.radix_cache.pool import KVPool
    from radixlm.radix_cache.state_pool import StatePool
    from radixlm.runtime.layers.attention_spec import AttentionSpec


class BatchAttention(Protocol):
    """What a batch's attention backend offers its layers (the backends: ``radixlm.runtime.layers.attention``)."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare whatever index tensors every layer of this batch will reuse."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, spec: AttentionSpec | None = None
    ) -> torch.Tensor:
        """Store ``k``/``v`` ``[T, Hkv, D]`` in the pool and attend ``q`` ``[T, H, D]`` as ``spec`` says; returns ``[T, H*D]``."""


@dataclass
class ForwardBatch:
    """Tokens, positions, KV placement and row layout for one forward pass."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] pool slots that receive the new tokens' KV
    req_rows: torch.Tensor  # [B] rows of the request → slot table
    prefix_lens: list[int]  # [B] tokens already in the pool per row
    extend_lens: list[int]  # [B] new tokens per row
    num_decode: int  # the first num_decode rows have exactly one new token
    logits_indices: torch.Tensor  # token indices (into T) whose logits are wanted
    req_to_token: torch.Tensor  # the request → slot table
    kv_pool: KVPool
    attn_backend: BatchAttention
    attn_meta: Any = field(default=None)
    inject_worker_fault: bool = False  # test only (--debug-fault-injection): tensor-parallel workers raise in this pass
    hidden_indices: torch.Tensor | None = None  # token indices whose final hidden states pooling requests want (rank 0 only)
    hidden_out: torch.Tensor | None = None  # set by the runner: fp32 [len(hidden_indices), hidden] of those tokens
    lora: Any = None  # the LoRA adapter segments of this pass (runtime/lora/batch.py), None without adapter rows
    state_pool: StatePool | None = None  # linear-attention states (hybrid models only)
    state_keeps: list[int] | None = None  # per row: after how many of its last tokens a state is staged (None: the last only)
    state_marks: list[list[int]] | None = None  # per row: positions inside it whose states are staged for the tree's snapshots
    state_rows: torch.Tensor | None = None  # tensor-parallel workers: the state pool's rows of the batch's rows (rank 0's table rows)

    @property
    def batch_size(self) -> int:
        """Number of rows."""
        return len(self.extend_lens)

    @property
    def pool_rows(self) -> torch.Tensor:
        """The state pool's rows of the batch's rows: the request-table rows, as rank 0 numbers them."""
        return self.req_rows if self.state_rows is None else self.state_rows

    def state_keep(self, row: int) -> int:
        """After how many of row ``row``'s last tokens a linear-attention state is staged (those
        whose KV the pass may drop: drafts under verification), at least the last one."""
        return 1 if self.state_keeps is None else self.state_keeps[row]

    def state_marks_of(self, row: int) -> list[int]:
        """The snapshot positions within row ``row``, as counts of its new tokens (ascending)."""
        if self.state_marks is None:
            return []
        start = self.prefix_lens[row]
        return [p - start for p in self.state_marks[row]]

    @property
    def seq_lens(self) -> list[int]:
        """Total sequence length of each row after this pass."""
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]
