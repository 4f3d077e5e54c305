"""CUDA graphs of the decode step: one captured forward per batch-size bucket, replayed for decode-only batches.

A decode step of a small model on a GPU is launch-bound: about ten kernels a layer, each a few
microseconds of work behind the Python and launch overhead that precedes it. Capturing the whole
forward (embedding, every layer, the output head) once per bucket of batch sizes and replaying it
costs one launch.

A graph reads and writes fixed addresses, so the inputs live in static tensors (token ids,
positions, KV slots, slot-table rows) sized for the largest bucket, and the logits in a static
``[max_bs, vocab]`` tensor. A step copies its batch into the first rows and pads the rest of its
bucket: a padded row has token 0 at position 0, writes its KV into a slot no request owns (the
runner's ``pad_write_slot``) and reads one token through slot-table row 0; its logits are
dropped. Each row's sequence length is its position plus one, computed inside the graph. What is
Python at capture stays fixed: the decode kernel's split count is the bucket's (correct for any
lengths, see ``radixlm.kernels.triton_decode``), and the slot table and KV pool are the tensors
captured with (a batch over another table runs eagerly).

A batch takes a graph when every row is a decode row, it fits the largest bucket and the
attention backend can run from static metadata (Triton's); anything else runs eagerly. A capture
that fails is logged and turns graphs off; that step and the later ones run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from radixlm.runtime.layers.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from radixlm.radix_cache.pool import KVPool
    from radixlm.runtime.layers.attention.base import DecodeCapturingBackend

logger = logging.getLogger(__name__)


class StepGraph(Protocol):
    """A recorded step: ``capture(fn)`` records what ``fn`` launches, ``replay()`` launches it again."""

    def capture(self, fn: Callable[[], None]) -> None:
        """Record ``fn``'s work."""

    def replay(self) -> None:
        """Run the recorded work again on the current contents of its static tensors."""


class CudaStepGraph:
    """A ``torch.cuda.CUDAGraph`` of one step, warmed up on a side stream and captured into a shared memory pool."""

    def __init__(self, pool: tuple[int, int] | None = None, warmups: int = 2) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.warmups = warmups

    def capture(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` ``warmups`` times (compiles the kernels, allocates workspaces), then capture it."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmups):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=self.pool):
            fn()

    def replay(self) -> None:
        """Launch the captured step."""
        self.graph.replay()


def graph_buckets(max_bs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 8 up to ``max_bs`` (always the last)."""
    if not isinstance(max_bs, int) or max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be a positive integer, got {max_bs!r}")
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs] + list(range(16, max_bs, 8))
    return [*sizes, max_bs]


class DecodeGraphs:
    """Captured decode steps for batch-size buckets up to ``max_bs``; ``run`` replays the smallest that fits.

    ``make_graph`` builds the recorder of one bucket (default: a CUDA graph in a pool shared by all
    buckets); buckets are captured on first use."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: KVPool,
        attn_backend: DecodeCapturingBackend,
        pad_write_slot: int,
        max_bs: int,
        make_graph: Callable[[], StepGraph] | None = None,
        max_seq_len: int = 1,
    ) -> None:
        self.model, self.kv_pool, self.attn_backend = model, kv_pool, attn_backend
        self.buckets = graph_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self.pad_write_slot = pad_write_slot
        self.max_seq_len = max_seq_len
        if make_graph is None:
            pool = torch.cuda.graph_pool_handle()
            make_graph = lambda: CudaStepGraph(pool)  # noqa: E731
        self.make_graph = make_graph
        self.enabled = True
        self.replays = 0
        device = kv_pool.device
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_slots = torch.full((n,), pad_write_slot, dtype=torch.int64, device=device)
        self.req_rows = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.logits = torch.zeros(n, model.config.vocab_size, dtype=torch.float32, device=device)
        self._captured: dict[int, StepGraph] = {}  # bucket size -> its recorded step
        self._table: torch.Tensor | None = None  # the slot table the graphs were captured with

    @property
    def captured(self) -> list[int]:
        """Bucket sizes captured so far."""
        return sorted(self._captured)

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` is one a graph replays: decode rows only, at most ``max_bs`` of them, the captured table."""
        n = batch.batch_size
        if not self.enabled or n == 0 or n > self.max_bs or batch.num_decode != n or batch.inject_worker_fault:
            return False
        if batch.kv_pool is not self.kv_pool or batch.attn_backend is not self.attn_backend:
            return False
        return self._table is None or batch.req_to_token is self._table

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits of ``batch.logits_indices`` from a replayed graph, or None when the batch runs eagerly."""
        if not self.can_run(batch):
            return None
        n = batch.batch_size
        size = next(s for s in self.buckets if s >= n)
        graph = self._captured.get(size)
        if graph is None:
            graph = self._capture(size, batch.req_to_token)
            if graph is None:
                return None
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.out_slots[:n].copy_(batch.out_slots)
        self.req_rows[:n].copy_(batch.req_rows)
        if n < size:
            self._pad(n, size)
        graph.replay()
        self.replays += 1
        return self.logits[:n].index_select(0, batch.logits_indices)

    def _pad(self, start: int, stop: int) -> None:
        """Rows ``start .. stop`` become padding: token 0 at position 0, KV into the spare slot."""
        self.input_ids[start:stop].zero_()
        self.positions[start:stop].zero_()
        self.out_slots[start:stop].fill_(self.pad_write_slot)
        self.req_rows[start:stop].zero_()

    def _capture(self, size: int, table: torch.Tensor) -> StepGraph | None:
        """Record the step for ``size`` rows (all padding while it is recorded); None, and graphs off, if that fails."""
        self._pad(0, size)
        step = self._step(size, table)
        graph = self.make_graph()
        try:
            graph.capture(step)
        except Exception:
            logger.warning("capturing the decode step for %d rows failed; decode steps run without CUDA graphs", size, exc_info=True)
            self.enabled = False
            self._pad(0, size)  # whatever the failed attempt left in the static rows
            return None
        self._table = table
        self._captured[size] = graph
        logger.info("captured the decode step for batches of up to %d rows", size)
        return graph

    def _step(self, size: int, table: torch.Tensor) -> Callable[[], None]:
        """The forward that a graph of ``size`` rows records: static inputs in, static logits out."""
        meta = self.attn_backend.static_decode_metadata(self.req_rows[:size], self.seq_lens[:size], self.max_seq_len, self.kv_pool.num_kv_heads)
        batch = ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            out_slots=self.out_slots[:size],
            req_rows=self.req_rows[:size],
            prefix_lens=[0] * size,  # unused: the static metadata reads the lengths from seq_lens
            extend_lens=[1] * size,
            num_decode=size,
            logits_indices=torch.arange(size, device=self.logits.device),
            req_to_token=table,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            attn_meta=meta,
        )
        model, positions, seq_lens, logits = self.model, self.positions[:size], self.seq_lens[:size], self.logits[:size]

        def step() -> None:
            seq_lens.copy_(positions + 1)
            logits.copy_(model.compute_logits(model(batch)))

        return step
