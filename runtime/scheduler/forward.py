"""The forward pass of a step: one pass over the rows, tokens applied, faults kept to their request.

A pass that raises is split in halves and each half re-run, until the failing request is found
and failed alone (its batch-mates recompute the same KV).
"""

from __future__ import annotations

import logging
import time

import torch

from radixlm.runtime import pooling
from radixlm.runtime.faults import FatalEngineError
from radixlm.runtime.layers.forward_batch import ForwardBatch
from radixlm.runtime.request import FinishReason
from radixlm.runtime.schedule_batch import LogitSpans, Row, build_forward_batch
from radixlm.runtime.scheduler.finish import Finishing
from radixlm.runtime.scheduler.state import MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY

logger = logging.getLogger(__name__)


class ForwardPass(Finishing):
    """Running the rows of a step through the model and advancing their requests."""

    def _run(self, rows: list[Row]) -> None:
        for row in self._forward(rows):
            req = row.req
            if req.finish is not None:
                continue
            try:
                if not row.sample and row.start + row.length == req.seq_len:  # max_new_tokens == 0
                    self.running.remove(req)
                    self.finish(req, FinishReason("length"))
                elif row.length > 1 and row.start < len(req.input_ids):
                    self.kv.cache_prefix(req.kv, req.cache_ids)  # share the prompt while it runs
            except Exception as exc:
                logger.exception("request %s failed after its forward pass", req.rid)
                self.fail(req, f"internal error: {exc}")
        if not self.stats.num_retracted:
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        self._speculate()  # after every half of a split pass ran: rows not yet computed get no drafts

    def _forward(self, rows: list[Row]) -> list[Row]:
        """One pass over ``rows`` and its tokens applied; returns the rows that were computed.

        When the pass raises, the rows are split in halves and each half runs on its own, so only
        the request that makes the pass fail is failed (its batch-mates recompute the same KV).
        """
        try:
            batch, spans = build_forward_batch(rows, self.kv, self.runner)
            if self.faults is not None:
                for row in rows:
                    self.faults.check(row.req.rid, "forward")
                batch.inject_worker_fault = any(self.faults.wants(row.req.rid, "tp_worker") for row in rows)
            t0 = time.perf_counter()
            logits = self.runner.forward(batch)
        except FatalEngineError:
            raise
        except Exception as exc:
            if len(rows) == 1:
                logger.exception("forward pass failed for request %s", rows[0].req.rid)
                self.fail(rows[0].req, f"forward pass failed: {exc}")
                return []
            mid = len(rows) // 2
            return self._forward(rows[:mid]) + self._forward(rows[mid:])
        self.forward_passes += 1
        seconds = time.perf_counter() - t0
        self.stats.forward_s += seconds
        if all(row.start >= len(row.req.input_ids) for row in rows):  # decode and verify rows only
            self.speculator.note_pass(seconds, len(batch.input_ids))
        self.stats.num_decode += batch.num_decode
        self.stats.num_prefill_tokens += len(batch.input_ids) - batch.num_decode
        self.prefill_tokens += len(batch.input_ids) - batch.num_decode
        for row in rows:
            self.kv.mark_computed(row.req.kv, row.start + row.length)
        if spans.pooled or spans.scores:
            self._pool(batch, spans, logits)
        for req, reason in self.decoder.process(logits, spans):
            self.running.remove(req)
            self.finish(req, reason)
        for row in rows:
            req = row.req
            if req.finish is None and req.kv is not None:  # KV of rejected drafts: stale, its pages freed
                self.kv.truncate(req.kv, req.seq_len - 1 - len(req.draft_ids))
                if self.kv_window is not None:  # before the prompt is shared: a row with holes is not
                    self.kv.slide(req.kv, self.kv_window)
        if batch.state_pool is not None:
            self._commit_states(batch, rows)
        self.speculator.observe(rows)  # an MTP draft takes the pass's hidden states (before another pass replaces them)
        return rows

    def _commit_states(self, batch: ForwardBatch, rows: list[Row]) -> None:
        """Keep each running row's linear-attention state at the length its KV was kept to (rows
        are in the batch's order), and hand the states at marked prompt positions to the tree;
        where that fails, the rows' requests fail, never the engine."""
        pool = batch.state_pool
        try:
            pool.commit([row.req.kv.kv_len if row.req.finish is None and row.req.kv is not None else None for row in rows])
        except Exception as exc:
            logger.exception("committing linear-attention states failed")
            for row in rows:
                if row.req.finish is None:
                    self.fail(row.req, f"internal error: {exc}")
            return
        for i, row in enumerate(rows):  # the prompt positions marked for the tree's state snapshots
            req = row.req
            try:
                marks = pool.marks(i) if req.finish is None and req.kv is not None else []
                if marks:
                    self.kv.cache_prefix(req.kv, req.cache_ids)  # their KV into the tree first
                    self.kv.take_snapshots(req.kv, req.cache_ids, marks)
            except Exception:  # a snapshot is an optimisation: the request goes on without it
                logger.exception("taking state snapshots for request %s failed", req.rid)

    def _pool(self, batch: ForwardBatch, spans: LogitSpans, logits: torch.Tensor) -> None:
        """Hand pooling rows their hidden states (or score logits); a row that ends its prompt
        gets its answer. A failure here fails that request alone."""
        for row, first, count in spans.pooled:
            req = row.req
            try:
                pooling.gather(req.pooling, batch.hidden_out[first : first + count], first=row.start == 0)
                if row.start + row.length == req.seq_len:
                    pooling.finish(req.pooling, None)
            except Exception as exc:
                logger.exception("pooling request %s failed", req.rid)
                self.fail(req, f"pooling failed: {exc}")
        for row, index in spans.scores:
            try:
                pooling.finish(row.req.pooling, logits[index])
            except Exception as exc:
                logger.exception("scoring request %s failed", row.req.rid)
                self.fail(row.req, f"scoring failed: {exc}")

    def _speculate(self) -> None:
        """Give the decoding requests without drafts their next speculative drafts (if gated in)."""
        decoding = [r for r in self.running if r.finish is None and r.generating and r.params.max_new_tokens > 0]
        ready = [r for r in decoding if not r.draft_ids]
        try:
            self.speculator.step(ready, len(decoding))
        except Exception:  # speculation is an optimisation: decode these rows plainly
            logger.exception("proposing speculative drafts failed")
            for req in ready:
                self.speculator.drop_drafts(req)
