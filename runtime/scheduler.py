"""Scheduler: continuous batching with prefix-aware admission, chunked prefill and retraction.

Each ``step``:
1. drop aborted requests;
2. decode rows: every running request whose prompt is done gets one new token, plus its draft
   tokens if it has any (retracting the newest requests when the pool cannot hold that);
3. prefill rows: unfinished prompts continue, then waiting requests are admitted in policy order
   (``lpm``: longest cached prefix first) while the chunked-prefill token budget, the request
   limit and the KV budget (free + evictable, minus headroom reserved for running decodes) allow;
   an unfinished prompt sits the step out while others decode or a short prompt waits, for at
   most ``--prefill-yield-share`` (0.2) of its own expected prefill time (``PrefillClock``);
4. one forward pass over all rows (``schedule_batch``); the ``Decoder`` picks tokens where a row
   reached the end of its sequence, appends them and checks stop conditions;
5. finished requests hand their KV to the radix tree; prompts just computed are shared at once.

Faults stay with the request that caused them: an error while admitting, sampling or building
one request's output fails that request alone (``FinishReason.failure``), and its KV is freed
without being cached. A forward pass that raises is split in halves and re-run until the failing
request is found. Nothing a request does can raise out of ``step``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.radix_cache.manager import KVManager
from radixlm.radix_cache.origin import Origin
from radixlm.radix_cache.tree import RadixCache
from radixlm.runtime.cache_explain import CacheExplainer
from radixlm.runtime.decoder import Decoder
from radixlm.runtime.disaggregation.scheduling import Disaggregation
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.faults import FatalEngineError, FaultInjector
from radixlm.runtime.output import OutputBuilder
from radixlm.runtime.request import ANY_SALT, FinishReason, Req, ReqOutput, same_tenant
from radixlm.runtime.schedule_batch import Row, build_forward_batch
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.speculative.speculator import Speculator

logger = logging.getLogger(__name__)

CLIP_MAX_NEW_TOKENS = 4096  # headroom estimates never count more than this per request
LPM_FALLBACK_QUEUE_LEN = 128  # above this many waiting requests lpm ordering is skipped (FCFS)
IN_BATCH_PREFIX_THRESHOLD = 32  # defer a request sharing this many uncached tokens with one admitted
INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY = 0.7, 0.1, 0.001


@dataclass
class StepStats:
    """Counters of the last step, for metrics and tests."""

    num_decode: int = 0
    num_prefill_tokens: int = 0
    num_retracted: int = 0
    num_prefills_paused: int = 0  # unfinished prompts that sat the step out to let others run
    forward_s: float = 0.0


@dataclass
class PrefillClock:
    """Forward seconds one chunked prompt has run and sat out, which bound how long it gives way.

    A prompt computed over many steps makes every step it joins last seconds. While other
    requests decode (or a short prompt waits) it sits steps out, so theirs stay fast, but only
    while the time it sat out is under ``share`` of its expected prefill time: its own seconds
    so far scaled by its uncomputed tokens (an underestimate, since attention grows with the
    prefix). So it never finishes more than about ``share`` later than it would have alone.
    """

    start: int  # KV length when its prefill began (the cached prefix)
    run_s: float = 0.0  # forward seconds of the steps that computed a chunk of it
    paused_s: float = 0.0  # forward seconds of the steps it sat out

    def may_pause(self, computed: int, total: int, share: float) -> bool:
        """True while the time sat out is within ``share`` of the expected prefill time."""
        done = computed - self.start
        return done > 0 and self.paused_s < share * self.run_s * (total - self.start) / done


class Scheduler:
    """Forms batches from waiting and running requests and advances them one step at a time."""

    def __init__(
        self,
        args: ServerArgs,
        runner: ModelRunner,
        kv: KVManager,
        outputs: OutputBuilder,
        end_ids: set[int],
        tokenizer,
    ) -> None:
        self.args = args
        self.runner = runner
        self.kv = kv
        self.outputs = outputs
        self.end_ids = end_ids
        self.faults = FaultInjector() if args.debug_fault_injection else None
        self.decoder = Decoder(args, tokenizer, outputs, end_ids, runner.config.vocab_size, runner.context_len, runner.device, self.faults)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = StepStats()
        self.total_retracted = 0
        self.forward_passes = 0
        self.explainer = None if args.disable_cache_explain else CacheExplainer(tokenizer)
        self.finished_output_tokens = 0  # output tokens of ended requests (for tokens/s)
        self.prefill_tokens = 0  # prompt tokens computed, all steps
        self.speculator = Speculator(args, runner, tokenizer, kv)
        self.pd: Disaggregation | None = None  # the prefill/decode hand-over (attach_pd)
        self.prefill_yield_share = args.prefill_yield_share
        self.prefill_clocks: dict[Req, PrefillClock] = {}  # the unfinished prompts' clocks
        self._paused: list[Req] = []  # unfinished prompts sitting out the step being formed

    def attach_pd(self, side) -> Disaggregation:
        """Make this scheduler one side of a prefill/decode pair over ``side``'s KV link."""
        self.pd = Disaggregation(self, side)
        return self.pd

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        """Queue a validated request (with drafts for any text its grammar forces at the start)."""
        try:
            self.decoder.propose_initial_drafts(req)
        except Exception as exc:
            logger.exception("request %s failed on admission", req.rid)
            self._finish(req, FinishReason.failure(f"admission failed: {exc}"))
            return
        if self.pd is not None:
            try:
                self.pd.on_add(req)
            except Exception as exc:
                self._finish(req, FinishReason.failure(f"the KV link to the prefill worker is down: {exc}", 503))
                return
        self.waiting.append(req)

    def has_work(self) -> bool:
        """True while any request waits or runs (not counting those waiting for a KV hand-over)."""
        return bool(self.waiting or self.running)

    def idle(self) -> bool:
        """True when no request holds or waits for KV."""
        return not self.has_work() and not (self.pd is not None and self.pd.receiving)

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
            self._fail(req, message)

    # ------------------------------------------------------------------- step
    def step(self) -> bool:
        """Advance every request by one step; False when there was nothing to run."""
        self._drop_aborted("aborted by request")
        self.stats = StepStats()
        rows = self._decode_rows()
        rows += self._prefill_rows(self.args.chunked_prefill_size, decoding=bool(rows))
        if not rows and self.running:  # every running prompt is stuck on memory: make room
            self._retract(max(self.running, key=lambda r: r.arrival))
            rows = self._decode_rows()
            rows += self._prefill_rows(self.args.chunked_prefill_size, decoding=bool(rows))
        if not rows:
            return False
        self._run(rows)
        self._tick_prefill_clocks(rows)
        return True

    def _drop_aborted(self, message: str, status: int | None = None) -> None:
        for req in [r for r in self.waiting if r.abort_requested]:
            self.waiting.remove(req)
            self._finish(req, FinishReason("abort", message=message, status=status))
        for req in [r for r in self.running if r.abort_requested]:
            self.running.remove(req)
            self._finish(req, FinishReason("abort", message=message, status=status))
        if self.pd is not None:
            self.pd.drop_aborted(message, status)

    def _fail(self, req: Req, message: str) -> None:
        """Take a request out of the queues and end it with an error."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, FinishReason.failure(message))

    # ---------------------------------------------------------- batch forming
    def _decode_rows(self) -> list[Row]:
        decoding = [r for r in self.running if r.generating]
        need = sum(self.kv.pages_for(r.kv, r.seq_len) for r in decoding)
        if need > self.kv.available():  # speculative drafts are the first thing to give up
            for r in decoding:
                self.speculator.drop_drafts(r)
            need = sum(self.kv.pages_for(r.kv, r.seq_len) for r in decoding)
        while need > self.kv.available() and decoding:
            victim = max(decoding, key=lambda r: r.arrival)
            decoding.remove(victim)
            need -= self.kv.pages_for(victim.kv, victim.seq_len)
            self._retract(victim)
        rows = []
        for req in decoding:
            if not self.kv.reserve(req.kv, req.seq_len):  # cannot happen after the check above
                raise RuntimeError("KV reservation failed after the capacity check")
            rows.append(Row(req, req.kv.kv_len, req.seq_len - req.kv.kv_len, sample=req.params.max_new_tokens > 0))
        return rows

    def _retract(self, req: Req) -> None:
        """Free a decoding request's KV and queue it again; it recomputes later."""
        if len(self.running) == 1:
            self.running.remove(req)
            self._finish(req, FinishReason("abort", message="the KV pool cannot hold this request"))
            return
        self.running.remove(req)
        self.speculator.drop_drafts(req)
        self.speculator.release(req)
        self.kv.release(req.kv, req.cache_ids)
        req.kv = None
        self.waiting.insert(0, req)
        self.stats.num_retracted += 1
        self.total_retracted += 1
        self.new_token_ratio = 1.0
        logger.info("retracted request %s (%d tokens)", req.rid, req.seq_len)

    def _reserved_headroom(self) -> int:
        total = 0
        for r in self.running:
            total += self.kv.headroom(r.kv, r.seq_len)
            total += int(min(r.remaining_tokens(), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)
        return total

    def _order_waiting(self) -> list[Req]:
        ready = list(self.waiting)
        if self.args.schedule_policy == "fcfs" or len(ready) > LPM_FALLBACK_QUEUE_LEN or self.kv.tree.disable:
            return ready
        tree = self.kv.tree
        lengths = {}
        for r in ready:
            lengths[id(r)] = tree.match_prefix(r.cache_ids[: r.max_cacheable_prefix()]).length
        return sorted(ready, key=lambda r: -lengths[id(r)])  # stable: FCFS on ties

    def _prefill_rows(self, budget: int, decoding: bool = False) -> list[Row]:
        rows = []
        # Unfinished (chunked) prompts go first, but while others wait they get half the budget,
        # so one long prompt never keeps new requests out for its whole prefill; while others
        # decode or a short prompt waits, they sit the step out (within their PrefillClock).
        chunk_budget = max(budget // 2, self.kv.page_size) if self.waiting else budget
        give_way = decoding or any(r.seq_len <= budget for r in self.waiting)
        self._paused = []
        for req in self.running:
            if chunk_budget <= 0:
                break
            if req.generating:
                continue
            if give_way and self._may_pause(req):
                self._paused.append(req)
                continue
            row = self._extend_row(req, chunk_budget)
            if row is None:
                break
            rows.append(row)
            budget -= row.length
            chunk_budget -= row.length
        admitted = self._admit_rows(budget) if budget > 0 and self.waiting else []
        budget -= sum(row.length for row in admitted)
        if self._paused and not decoding and not any(self._completes_prompt(row) for row in admitted):
            for req in self._paused:  # nobody to give way to after all
                share = min(budget, chunk_budget)
                row = self._extend_row(req, share) if share > 0 else None
                if row is None:
                    break
                rows.append(row)
                budget -= row.length
                chunk_budget -= row.length
            self._paused = []
        self.stats.num_prefills_paused = len(self._paused)
        return rows + admitted

    def _admit_rows(self, budget: int) -> list[Row]:
        """Admit waiting requests in policy order while ``budget`` and KV allow; their first rows."""
        rows = []
        in_batch = RadixCache(lambda slots: None)  # prompts admitted this step (tokens only)
        for req in self._order_waiting():
            if budget <= 0 or len(self.running) >= self.args.max_running_requests:
                break
            if self.pd is not None and self.pd.takes(req):
                if not self.pd.admit(req):  # its KV comes from the prefill worker: no compute here
                    break
                continue
            prefix_slots, node = self.kv.match(req.cache_ids, req.max_cacheable_prefix())
            if self._shares_in_batch(in_batch, req, len(prefix_slots)):
                continue
            length = self._chunk_len(req, len(prefix_slots), budget)
            state = None
            try:
                state = self.reserve_admission(req, prefix_slots, node, len(prefix_slots) + length)
                if state is None:
                    break
                if self.faults is not None:
                    self.faults.check(req.rid, "admit")
            except Exception as exc:
                logger.exception("request %s failed on admission", req.rid)
                if state is not None:
                    self.kv.release(state, None)
                self._fail(req, f"admission failed: {exc}")
                continue
            req.kv = state
            self.note_admission(req, len(prefix_slots), node)
            self.waiting.remove(req)
            self.running.append(req)
            in_batch.insert(req.cache_ids, torch.zeros(req.seq_len, dtype=torch.int64))
            row = Row(req, state.kv_len, length, sample=self._samples(req, state.kv_len + length))
            if req.seq_len - state.kv_len > self.args.chunked_prefill_size:  # a long prompt: it may pause
                self.prefill_clocks[req] = PrefillClock(state.kv_len)
            rows.append(row)
            budget -= length
        return rows

    @staticmethod
    def _completes_prompt(row: Row) -> bool:
        """True when the row computes the rest of its request's sequence (it decodes next)."""
        return row.start + row.length >= row.req.seq_len

    def _may_pause(self, req: Req) -> bool:
        """True when an unfinished prompt may sit this step out: it is long (more than one step's
        budget when admitted) and its clock allows it. Prompts cut short by a full step never pause."""
        clock = self.prefill_clocks.get(req)
        return clock is not None and clock.may_pause(req.kv.kv_len, req.seq_len, self.prefill_yield_share)

    def _tick_prefill_clocks(self, rows: list[Row]) -> None:
        """Charge the step's forward time to the prompts it computed or that sat it out."""
        seconds = self.stats.forward_s
        computed = {row.req for row in rows}
        paused = set(self._paused)
        running = set(self.running)
        for req, clock in list(self.prefill_clocks.items()):
            if req not in running or req.kv is None or req.generating:
                del self.prefill_clocks[req]  # done, finished or retracted
            elif req in paused:
                clock.paused_s += seconds
            elif req in computed:
                clock.run_s += seconds

    def reserve_admission(self, req: Req, prefix_slots: torch.Tensor, node, new_len: int):
        """Lock a waiting request's cached prefix and reserve its slots up to ``new_len``, leaving
        room for the running requests' decoding; None (holding nothing) when KV is short now.
        Raises (holding nothing) when ``new_len`` does not fit a slot-table row."""
        need = self.kv.pages_for(None, new_len) - len(prefix_slots)
        if self.running:
            need += int(min(req.remaining_tokens(), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)
            need += self._reserved_headroom()
        origin = Origin(req.rid, req.program, req.prompt_cache_key) if self.kv.tree.track_origins else None
        state = self.kv.admit(prefix_slots, node, origin)
        if state is None:
            return None
        try:
            if need > self.kv.available() or not self.kv.reserve(state, new_len):
                self.kv.release(state, None)
                return None
        except BaseException:
            self.kv.release(state, None)
            raise
        return state

    def note_admission(self, req: Req, cached: int, node) -> None:
        """Record a request's prefix hit at its first admission (not again after a retraction)."""
        if req.cached_tokens >= 0:
            return
        req.cached_tokens = cached
        self.kv.tree.record(len(req.input_ids), cached)
        self._note_match(req, node)
        if req.needs_prompt_logprobs() and req.logprob_start_len == 0:
            req.input_logprobs.append(None)
            req.input_top_logprobs.append(None)

    def _note_match(self, req: Req, node) -> None:
        """Count the reuse of the matched path and explain the request's hit (first admission)."""
        tree = self.kv.tree
        tree.note_reuse(node)
        if self.explainer is not None:
            req.cache_info = self.explainer.explain(tree, req, node, req.max_cacheable_prefix())

    def _protect(self, req: Req) -> None:
        """Apply a finished request's retention hints to its now cached prefixes."""
        ids = req.cache_ids
        for length, ttl in req.retention:
            self.kv.tree.protect(ids[: min(length, len(ids))], ttl)

    def _shares_in_batch(self, in_batch: RadixCache, req: Req, cached: int) -> bool:
        if self.kv.tree.disable or in_batch.total_size() == 0:
            return False
        shared = in_batch.match_prefix(req.cache_ids[: req.max_cacheable_prefix()]).length
        # The samples of one prompt (n > 1) wait for the first one's prompt KV however short it
        # is: as soon as one more whole page of it could come from the cache.
        return shared - cached >= (self.kv.page_size if req.params.n > 1 else IN_BATCH_PREFIX_THRESHOLD)

    @staticmethod
    def _chunk_len(req: Req, start: int, budget: int) -> int:
        """Positions to compute from ``start``: within budget, never splitting the drafted tail."""
        remaining = req.seq_len - start
        if remaining <= budget:
            return remaining
        cut = min(budget, remaining - 1 - len(req.draft_ids))
        return cut if cut > 0 else remaining

    def _extend_row(self, req: Req, budget: int) -> Row | None:
        length = self._chunk_len(req, req.kv.kv_len, budget)
        if not self.kv.reserve(req.kv, req.kv.kv_len + length):
            return None
        return Row(req, req.kv.kv_len, length, sample=self._samples(req, req.kv.kv_len + length))

    @staticmethod
    def _samples(req: Req, end: int) -> bool:
        return end == req.seq_len and req.params.max_new_tokens > 0

    # ----------------------------------------------------------- the forward
    def _run(self, rows: list[Row]) -> None:
        for row in self._forward(rows):
            req = row.req
            if req.finish is not None:
                continue
            try:
                if not row.sample and row.start + row.length == req.seq_len:  # max_new_tokens == 0
                    self.running.remove(req)
                    self._finish(req, FinishReason("length"))
                elif row.length > 1 and row.start < len(req.input_ids):
                    self.kv.cache_prefix(req.kv, req.cache_ids)  # share the prompt while it runs
            except Exception as exc:
                logger.exception("request %s failed after its forward pass", req.rid)
                self._fail(req, f"internal error: {exc}")
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
                self._fail(rows[0].req, f"forward pass failed: {exc}")
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
        for req, reason in self.decoder.process(logits, spans):
            self.running.remove(req)
            self._finish(req, reason)
        for row in rows:
            req = row.req
            if req.finish is None and req.kv is not None:  # KV of rejected drafts: stale, its pages freed
                self.kv.truncate(req.kv, req.seq_len - 1 - len(req.draft_ids))
        return rows

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

    def _finish(self, req: Req, reason: FinishReason) -> None:
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
