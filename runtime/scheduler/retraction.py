"""Retraction: the decode rows of a step, and freeing KV when the pool cannot hold them.

Speculative drafts give way first; then the newest decoding requests (under ``--schedule-policy
priority``: of the least urgent class first) hand their KV to the radix tree and queue again
(they recompute what was evicted later). A request alone in the pool that still does not fit is
aborted.
"""

from __future__ import annotations

import logging

from radixlm.runtime.request import FinishReason, Req
from radixlm.runtime.schedule_batch import Row
from radixlm.runtime.scheduler.finish import Finishing
from radixlm.runtime.scheduler.priority import clock, victim_order

logger = logging.getLogger(__name__)


class Retraction(Finishing):
    """One new token (plus drafts) for every decoding request the pool can hold; the rest retracted."""

    def _decode_rows(self) -> list[Row]:
        decoding = [r for r in self.running if r.generating]
        need = sum(self.kv.pages_for(r.kv, r.seq_len) for r in decoding)
        if need > self.kv.available():  # speculative drafts are the first thing to give up
            for r in decoding:
                self.speculator.drop_drafts(r)
            need = sum(self.kv.pages_for(r.kv, r.seq_len) for r in decoding)
        while need > self.kv.available() and decoding:
            victim = self._retraction_victim(decoding)
            decoding.remove(victim)
            need -= self.kv.pages_for(victim.kv, victim.seq_len)
            self._retract(victim)
        rows = []
        for req in decoding:
            if not self.kv.reserve(req.kv, req.seq_len):  # cannot happen after the check above
                raise RuntimeError("KV reservation failed after the capacity check")
            rows.append(Row(req, req.kv.kv_len, req.seq_len - req.kv.kv_len, sample=req.params.max_new_tokens > 0))
        return rows

    def _retraction_victim(self, reqs: list[Req]) -> Req:
        """The request of ``reqs`` to retract first: the newest (of the least urgent class under
        the priority policy)."""
        if self.args.schedule_policy == "priority":
            return max(reqs, key=victim_order)
        return max(reqs, key=lambda r: r.arrival)

    def _retract(self, req: Req) -> None:
        """Free a decoding request's KV and queue it again; it recomputes later."""
        if len(self.running) == 1:
            self.running.remove(req)
            self.finish(req, FinishReason("abort", message="the KV pool cannot hold this request"))
            return
        self._requeue(req)
        self.stats.num_retracted += 1
        self.total_retracted += 1
        self.new_token_ratio = 1.0
        logger.info("retracted request %s (%d tokens)", req.rid, req.seq_len)

    def _requeue(self, req: Req) -> None:
        """Take a running request out of the batch: its computed KV goes to the radix tree and it
        queues again at the front, keeping its output so far."""
        self.running.remove(req)
        self.speculator.drop_drafts(req)
        self.speculator.release(req)
        self.kv.release(req.kv, req.cache_ids)
        req.kv = None
        req.queued_at = clock()
        self.waiting.insert(0, req)
