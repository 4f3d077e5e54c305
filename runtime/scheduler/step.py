"""Scheduler: the step that forms each batch, and the queue API the engine loop calls.

Each ``step``:
1. drop aborted requests; under the priority policy, preempt less urgent running requests when
   the most urgent waiting one would not fit (``priority.py``);
2. decode rows: every running request whose prompt is done gets one new token, plus its draft
   tokens if it has any (retracting the newest requests when the pool cannot hold that:
   ``retraction.py``);
3. prefill rows: unfinished prompts continue, then waiting requests are admitted in policy order
   while the token budget, the request limit and the KV budget allow (``admission.py``);
4. one forward pass over all rows (``schedule_batch``); the ``Decoder`` picks tokens where a row
   reached the end of its sequence, appends them and checks stop conditions (``forward.py``);
5. finished requests hand their KV to the radix tree; prompts just computed are shared at once
   (``finish.py``).

Faults stay with the request that caused them: an error while admitting, sampling or building
one request's output fails that request alone (``FinishReason.failure``), and its KV is freed
without being cached. A forward pass that raises is split in halves and re-run until the failing
request is found. Nothing a request does can raise out of ``step``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from radixlm.runtime.request import ANY_SALT, FinishReason, Req, same_tenant
from radixlm.runtime.scheduler.admission import Admission
from radixlm.runtime.scheduler.forward import ForwardPass
from radixlm.runtime.scheduler.hooks import DisaggregationHook
from radixlm.runtime.scheduler.priority import Preemption, clock
from radixlm.runtime.scheduler.retraction import Retraction
from radixlm.runtime.scheduler.state import StepStats

logger = logging.getLogger(__name__)


class Scheduler(Admission, Retraction, Preemption, ForwardPass):
    """Forms batches from waiting and running requests and advances them one step at a time."""

    def attach_pd(self, hook: DisaggregationHook) -> DisaggregationHook:
        """Make this scheduler one side of a prefill/decode pair, through ``hook``."""
        hook.bind(self)
        self.pd = hook
        return hook

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        """Queue a validated request (with drafts for any text its grammar forces at the start)."""
        try:
            self.decoder.propose_initial_drafts(req)
        except Exception as exc:
            logger.exception("request %s failed on admission", req.rid)
            self.finish(req, FinishReason.failure(f"admission failed: {exc}"))
            return
        if self.pd is not None:
            try:
                self.pd.on_add(req)
            except Exception as exc:
                self.finish(req, FinishReason.failure(f"the KV link to the prefill worker is down: {exc}", 503))
                return
        req.queued_at = clock()
        self.prefetch_tiers(req)
        self.waiting.append(req)

    def has_work(self) -> bool:
        """True while any request waits or runs (not counting those waiting for a KV hand-over)."""
        return bool(self.waiting or self.running)

    def idle(self) -> bool:
        """True when no request holds or waits for KV."""
        return not self.has_work() and not (self.pd is not None and self.pd.requests())

    def holding_kv(self) -> list[Req]:
        """Requests holding KV: the running ones and those receiving a hand-over."""
        return self.running + (self.pd.requests() if self.pd is not None else [])

    def abort(self, rid: str, cache_salt: Any = ANY_SALT) -> bool:
        """Mark the request ``rid`` of tenant ``cache_salt`` for abortion at the next step; False if unknown."""
        found = False
        for req in self.waiting + self.running:
            if req.rid == rid and req.finish is None and same_tenant(req.cache_salt, cache_salt):
                req.abort_requested = found = True
        return found or (self.pd is not None and self.pd.abort(rid, cache_salt))

    def abort_all(self, message: str, status: int | None = None) -> None:
        """End every request, e.g. at shutdown (``status``: the error it maps to, if any)."""
        for req in self.waiting + self.holding_kv():
            req.abort_requested = True
        self._drop_aborted(message, status)

    def fail_running(self, message: str) -> None:
        """Fail every running request without caching its KV (after an error no request owns)."""
        for req in list(self.running):
            self.fail(req, message)

    # ------------------------------------------------------------------- step
    def step(self) -> bool:
        """Advance every request by one step; False when there was nothing to run."""
        self._drop_aborted("aborted by request")
        self.stats = StepStats()
        self._preempt_for_waiting()
        rows = self._decode_rows()
        rows += self._prefill_rows(self.args.chunked_prefill_size, decoding=bool(rows))
        if not rows and self.running:  # every running prompt is stuck on memory: make room
            self._retract(self._retraction_victim(self.running))
            rows = self._decode_rows()
            rows += self._prefill_rows(self.args.chunked_prefill_size, decoding=bool(rows))
        if not rows:
            return False
        self._run(rows)
        self._tick_prefill_clocks(rows)
        return True

    # ------------------------------------------------------------ inspection
    def output_tokens(self) -> int:
        """Output tokens generated so far by every request, ended or not."""
        return self.finished_output_tokens + sum(len(r.output_ids) for r in self.running + self.waiting)

    def queue_view(self, limit: int = 50) -> dict[str, Any]:
        """The running and waiting queues, read-only: at most ``limit`` rows each, plus their lengths."""
        now = time.monotonic()

        def row(req: Req) -> dict[str, Any]:
            constraint = req.params.constraint
            return {
                "rid": req.rid,
                "prompt": len(req.input_ids),
                "hit": req.cached_tokens,
                "out": len(req.output_ids),
                "max": req.params.max_new_tokens,
                "constraint": constraint[0] if constraint else None,
                "phase": "decode" if req.generating else ("prefill" if req.kv is not None else "waiting"),
                "kv": req.kv.owned if req.kv is not None else 0,
                "age_s": round(now - req.arrival, 2),
                "priority": req.priority,
            }

        return {
            "running": [row(r) for r in self.running[:limit]],
            "waiting": [row(r) for r in self.waiting[:limit]],
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
        }

    def check_accounting(self, full: bool = True) -> None:
        """Assert the KV invariant: free + tree + running-owned slots = pool size."""
        self.kv.check_accounting([r.kv for r in self.holding_kv() if r.kv is not None], full)
        assert all(r.kv is None for r in self.waiting), "a waiting request holds KV"
