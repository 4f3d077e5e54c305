"""Admission: matching waiting requests against the radix cache, deciding what fits, planning chunks.

Unfinished prompts continue first, then waiting requests are admitted in policy order (``lpm``:
longest cached prefix first; ``priority``: by class, then lpm within a class, ``priority.py``)
while the chunked-prefill token budget, the request limit and the KV budget (free + evictable,
minus headroom reserved for running decodes) allow. An unfinished
prompt sits the step out while others decode or a short prompt waits, for at most
``--prefill-yield-share`` of its own expected prefill time (``PrefillClock``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from radixlm.radix_cache.manager import KVState
from radixlm.radix_cache.origin import Origin
from radixlm.radix_cache.tiers import LOWER_TIERS
from radixlm.radix_cache.tree import RadixCache, TreeNode
from radixlm.runtime.lora.manager import lora_admits
from radixlm.runtime.request import Req
from radixlm.runtime.schedule_batch import Row
from radixlm.runtime.scheduler import priority
from radixlm.runtime.scheduler.finish import Finishing
from radixlm.runtime.scheduler.prefill_clock import PrefillClock

logger = logging.getLogger(__name__)

CLIP_MAX_NEW_TOKENS = 4096  # headroom estimates never count more than this per request
LPM_FALLBACK_QUEUE_LEN = 128  # above this many waiting requests lpm ordering is skipped (FCFS)
IN_BATCH_PREFIX_THRESHOLD = 32  # defer a request sharing this many uncached tokens with one admitted


class Admission(Finishing):
    """The prefill rows of a step: unfinished prompts continued, waiting requests admitted."""

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

    def _order_waiting(self) -> list[Req]:
        ready = list(self.waiting)
        by_class = self.args.schedule_policy == "priority"
        if self.args.schedule_policy == "fcfs" or len(ready) > LPM_FALLBACK_QUEUE_LEN or self.kv.tree.disable:
            return priority.order_by_class(ready, None, self.args.priority_aging_s) if by_class else ready
        tree = self.kv.tree
        lengths = {}
        for r in ready:
            lengths[id(r)] = tree.match_prefix(r.cache_ids[: r.max_cacheable_prefix()]).length
        if by_class:
            return priority.order_by_class(ready, lengths, self.args.priority_aging_s)
        return sorted(ready, key=lambda r: -lengths[id(r)])  # stable: FCFS on ties

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
            if self.kv.tiers is not None:
                if req.tier_fetch is not None and not req.tier_fetch.done():
                    continue  # its prefix is still being read from the disk tier: others go first
                prefix_slots, node = self._promote(req, prefix_slots, node)
            if self._shares_in_batch(in_batch, req, len(prefix_slots)):
                continue
            length = self._chunk_len(req, len(prefix_slots), budget)
            state = None
            try:
                if not lora_admits(self.runner, req, self.running):  # its adapter loaded, within --max-loras-per-batch
                    continue
                state = self.reserve_admission(req, prefix_slots, node, len(prefix_slots) + length)
                if state is None:
                    break
                if self.faults is not None:
                    self.faults.check(req.rid, "admit")
            except Exception as exc:
                logger.exception("request %s failed on admission", req.rid)
                if state is not None:
                    self.kv.release(state, None)
                self.fail(req, f"admission failed: {exc}")
                continue
            req.kv = state
            req.state_marks = self.kv.snapshot_points(req.cache_ids, req.max_cacheable_prefix(), len(prefix_slots))
            if self.pd is not None:
                req.state_marks = self.pd.marks_for(req, req.state_marks)
            req.run_class = priority.effective_class(req, priority.clock(), self.args.priority_aging_s)
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

    def _promote(self, req: Req, prefix_slots: torch.Tensor, node: TreeNode) -> tuple[torch.Tensor, TreeNode]:
        """The match extended with what the KV tiers hold past it (unchanged if loading fails)."""
        loaded: dict[str, int] = {}
        fetch, req.tier_fetch = req.tier_fetch, None
        try:
            staged = fetch.result() if fetch is not None and fetch.exception() is None else None
            prefix_slots, node, loaded = self.kv.promote(req.cache_ids, req.max_cacheable_prefix(), prefix_slots, node, staged)
        except Exception:
            logger.exception("loading request %s's prefix from the KV tiers failed; computing it instead", req.rid)
        if req.cached_tokens < 0 and (loaded or req.tier_tokens is None):  # before its first admission: what meta_info reports
            req.tier_tokens = {tier: loaded.get(tier, 0) for tier in LOWER_TIERS}  # (kept if admission must wait after loading)
        return prefix_slots, node

    def prefetch_tiers(self, req: Req) -> None:
        """Start reading the disk blocks that continue ``req``'s cached prefix (at enqueue time)."""
        tiers = self.kv.tiers
        if tiers is None or tiers.disk is None or self.kv.tree.disable:
            return
        try:
            limit = req.max_cacheable_prefix()
            cached = self.kv.tree.match_prefix(req.cache_ids[:limit]).length
            req.tier_fetch = tiers.prefetch(req.cache_ids, cached, limit)
        except Exception:
            logger.exception("prefetching request %s's prefix from the disk tier failed", req.rid)

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

    def _reserved_headroom(self, exclude: Sequence[Req] = ()) -> int:
        total = 0
        for r in self.running:
            if r in exclude:
                continue
            total += self.kv.headroom(r.kv, r.seq_len)
            total += int(min(r.remaining_tokens(), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)
        return total

    def _admission_need(self, req: Req, cached: int, new_len: int, exclude: Sequence[Req] = ()) -> int:
        """KV slots admitting ``req`` up to ``new_len`` takes, with ``cached`` of them from the tree,
        plus the room the running requests (but those in ``exclude``) and ``req`` keep for decoding."""
        need = self.kv.pages_for(None, new_len) - cached
        if len(self.running) > len(exclude):
            need += int(min(req.remaining_tokens(), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)
            need += self._reserved_headroom(exclude)
        return need

    def reserve_admission(self, req: Req, prefix_slots: torch.Tensor, node: TreeNode, new_len: int) -> KVState | None:
        """Lock a waiting request's cached prefix and reserve its slots up to ``new_len``, leaving
        room for the running requests' decoding; None (holding nothing) when KV is short now.
        Raises (holding nothing) when ``new_len`` does not fit a slot-table row."""
        need = self._admission_need(req, len(prefix_slots), new_len)
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

    def note_admission(self, req: Req, cached: int, node: TreeNode) -> None:
        """Record a request's prefix hit at its first admission (not again after a retraction)."""
        if req.cached_tokens >= 0:
            return
        req.cached_tokens = cached
        req.admitted_at = time.monotonic()
        self.kv.tree.record(len(req.input_ids), cached)
        self._note_match(req, node)
        if req.needs_prompt_logprobs() and req.logprob_start_len == 0:
            req.input_logprobs.append(None)
            req.input_top_logprobs.append(None)

    def _note_match(self, req: Req, node: TreeNode) -> None:
        """Count the reuse of the matched path and explain the request's hit (first admission)."""
        tree = self.kv.tree
        tree.note_reuse(node)
        if self.explainer is not None:
            req.cache_info = self.explainer.explain(tree, req, node, req.max_cacheable_prefix())

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
