"""How a request leaves the scheduler: its KV freed (and cached unless it failed), its final output sent."""

from __future__ import annotations

import logging

from radixlm.runtime.request import FinishReason, Req, ReqOutput
from radixlm.runtime.scheduler.state import SchedulerState

logger = logging.getLogger(__name__)


class Finishing(SchedulerState):
    """Ending requests: by their own end, by an abort, or by an error that is theirs alone."""

    def finish(self, req: Req, reason: FinishReason) -> None:
        """End a request: free (and, unless it failed, cache) its KV and send its final output."""
        req.finish = reason
        hand_over = None
        if self.pd is not None:
            try:
                hand_over = self.pd.prepare(req, reason)  # copies the KV out before it is released
            except Exception as exc:
                logger.exception("preparing the KV hand-over of request %s failed", req.rid)
                req.finish = reason = FinishReason.failure(f"preparing the KV hand-over failed: {exc}")
        self.finished_output_tokens += len(req.output_ids)
        self.speculator.drop_drafts(req)
        try:
            self.speculator.release(req)
        except Exception:
            logger.exception("releasing the speculation state of request %s failed", req.rid)
        if req.kv is not None:
            state, req.kv = req.kv, None
            try:
                self.kv.release(state, req.cache_ids if reason.status is None else None)
                if req.retention and reason.status is None:
                    self._protect(req)
            except Exception:
                logger.exception("caching the KV of request %s failed; freeing it uncached", req.rid)
                if state.alloc_len:
                    self.kv.release(state, None)
        req.grammar = None
        try:
            if self.faults is not None:
                self.faults.check(req.rid, "output")
            out = self.outputs.build(req, finished=True)
        except Exception as exc:
            logger.exception("building the output of request %s failed", req.rid)
            req.finish = FinishReason.failure(f"building the output failed: {exc}")
            out = ReqOutput(req.rid, req.text, list(req.output_ids), {"id": req.rid, "finish_reason": req.finish.to_dict()}, True)
        try:
            if hand_over is not None:
                self.pd.hand_over(hand_over, out, req.sink)
            else:
                req.sink(out)
        except Exception:
            logger.exception("delivering the output of request %s failed", req.rid)

    def fail(self, req: Req, message: str) -> None:
        """Take a request out of the queues and end it with an error."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.finish(req, FinishReason.failure(message))

    def _drop_aborted(self, message: str, status: int | None = None) -> None:
        for req in [r for r in self.waiting if r.abort_requested]:
            self.waiting.remove(req)
            self.finish(req, FinishReason("abort", message=message, status=status))
        for req in [r for r in self.running if r.abort_requested]:
            self.running.remove(req)
            self.finish(req, FinishReason("abort", message=message, status=status))
        if self.pd is not None:
            self.pd.drop_aborted(message, status)

    def _protect(self, req: Req) -> None:
        """Apply a finished request's retention hints to its now cached prefixes."""
        ids = req.cache_ids
        for length, ttl in req.retention:
            self.kv.tree.protect(ids[: min(length, len(ids))], ttl)
