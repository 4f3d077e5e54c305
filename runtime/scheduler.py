"""Scheduler: continuous batching with prefix-aware admission, chunked prefill and retraction.

Each ``step``:
1. drop aborted requests;
2. decode rows: every running request whose prompt is done gets one new token (retracting the
   newest requests when the pool cannot hold even that);
3. prefill rows: unfinished prompts continue, then waiting requests are admitted in policy order
   (``lpm``: longest cached prefix first) while the chunked-prefill token budget, the request
   limit and the KV budget (free + evictable, minus headroom reserved for running decodes) allow;
4. one forward pass over all rows, sampling where a row reached the end of its sequence;
5. bookkeeping: append tokens, stream text, finish requests, hand their KV to the radix tree.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from radixlm.radix_cache.manager import KVManager
from radixlm.radix_cache.tree import RadixCache
from radixlm.runtime.constrained.base import bitmask_width, unpack_bitmask
from radixlm.runtime.constrained.jump_forward import forced_prefix, plan_jump
from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.output import OutputBuilder
from radixlm.runtime.request import FinishReason, Req
from radixlm.runtime.sampler import SamplingRow, prompt_logprobs, sample
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

CLIP_MAX_NEW_TOKENS = 4096  # headroom estimates never count more than this per request
LPM_FALLBACK_QUEUE_LEN = 128  # above this many waiting requests lpm ordering is skipped (FCFS)
IN_BATCH_PREFIX_THRESHOLD = 32  # defer a request sharing this many uncached tokens with one admitted
INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY = 0.7, 0.1, 0.001


@dataclass
class _Row:
    req: Req
    start: int  # first position computed
    length: int  # positions computed
    sample: bool  # the row reaches the end of its sequence and picks a token


@dataclass
class StepStats:
    """Counters of the last step, for metrics and tests."""

    num_decode: int = 0
    num_prefill_tokens: int = 0
    num_retracted: int = 0
    forward_s: float = 0.0


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
        self.tokenizer = tokenizer
        self.vocab_size = runner.config.vocab_size
        self.context_len = runner.context_len
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.generator = torch.Generator(device=runner.device).manual_seed(args.random_seed)
        self.stats = StepStats()
        self.total_retracted = 0
        self.forward_passes = 0

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        """Queue a validated request (appending any text its grammar forces at the start)."""
        if req.grammar is not None and not self.args.disable_jump_forward and not req.output_ids:
            tokens = forced_prefix(self.tokenizer, req.grammar.forced_text(), req.grammar, req.params.max_new_tokens)
            req.output_ids.extend(tokens)
            req.jump_tokens += len(tokens)
            if req.return_logprob:
                req.output_logprobs.extend([0.0] * len(tokens))
                req.output_top_logprobs.extend([None] * len(tokens))
        self.waiting.append(req)

    def has_work(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def abort(self, rid: str) -> bool:
        """Mark a request for abortion at the next step; False if it is unknown."""
        for req in self.waiting + self.running:
            if req.rid == rid and req.finish is None:
                req.abort_requested = True
                return True
        return False

    def abort_all(self, message: str) -> None:
        """Abort every request, e.g. at shutdown."""
        for req in self.waiting + self.running:
            req.abort_requested = True
        self._drop_aborted(message)

    # ------------------------------------------------------------------- step
    def step(self) -> bool:
        """Advance every request by one step; False when there was nothing to run."""
        self._drop_aborted("aborted by request")
        self.stats = StepStats()
        rows = self._decode_rows()
        rows += self._prefill_rows(self.args.chunked_prefill_size)
        if not rows:
            return False
        rows.sort(key=lambda r: r.length != 1)  # decode-shaped rows first
        self._run(rows)
        return True

    def _drop_aborted(self, message: str) -> None:
        for req in [r for r in self.waiting if r.abort_requested]:
            self.waiting.remove(req)
            self._finish(req, FinishReason("abort", message=message))
        for req in [r for r in self.running if r.abort_requested]:
            self.running.remove(req)
            self._finish(req, FinishReason("abort", message=message))

    # ---------------------------------------------------------- batch forming
    def _decode_rows(self) -> list[_Row]:
        decoding = [r for r in self.running if r.prefill_done]
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
            rows.append(_Row(req, req.kv.kv_len, 1, sample=req.params.max_new_tokens > 0))
        return rows

    def _retract(self, req: Req) -> None:
        """Free a decoding request's KV and queue it again; it recomputes later."""
        if len(self.running) == 1:
            self.running.remove(req)
            self._finish(req, FinishReason("abort", message="the KV pool cannot hold this request"))
            return
        self.running.remove(req)
        self.kv.release(req.kv, req.fill_ids)
        req.kv = None
        self.waiting.insert(0, req)
        self.stats.num_retracted += 1
        self.total_retracted += 1
        self.new_token_ratio = 1.0
        logger.info("retracted request %s (%d tokens)", req.rid, req.seq_len)

    def _reserved_headroom(self) -> int:
        total = 0
        for r in self.running:
            total += max(r.seq_len - r.kv.alloc_len, 0)
            total += int(min(r.remaining_tokens(), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)
        return total

    def _order_waiting(self) -> list[Req]:
        ready = list(self.waiting)
        if self.args.schedule_policy == "fcfs" or len(ready) > LPM_FALLBACK_QUEUE_LEN or self.kv.tree.disable:
            return ready
        tree = self.kv.tree
        lengths = {}
        for r in ready:
            lengths[id(r)] = tree.match_prefix(r.fill_ids[: r.max_cacheable_prefix()]).length
        return sorted(ready, key=lambda r: -lengths[id(r)])  # stable: FCFS on ties

    def _prefill_rows(self, budget: int) -> list[_Row]:
        rows = []
        for req in self.running:  # unfinished (chunked) prompts first
            if budget <= 0:
                return rows
            if req.prefill_done:
                continue
            row = self._extend_row(req, budget)
            if row is None:
                break
            rows.append(row)
            budget -= row.length
        if budget <= 0 or not self.waiting:
            return rows
        in_batch = RadixCache(lambda slots: None)  # prompts admitted this step (tokens only)
        for req in self._order_waiting():
            if budget <= 0 or len(self.running) >= self.args.max_running_requests:
                break
            prefix_slots, node = self.kv.match(req.fill_ids, req.max_cacheable_prefix())
            if self._shares_in_batch(in_batch, req, len(prefix_slots)):
                continue
            length = min(req.seq_len - len(prefix_slots), budget)
            need = self.kv.pages_for(None, len(prefix_slots) + length) - len(prefix_slots)
            if self.running:
                need += int(min(req.remaining_tokens(), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)
                need += self._reserved_headroom()
            state = self.kv.admit(prefix_slots, node)
            if state is None:
                break
            if need > self.kv.available() or not self.kv.reserve(state, len(prefix_slots) + length):
                self.kv.release(state, None)
                break
            req.kv = state
            if req.cached_tokens < 0:
                req.cached_tokens = len(prefix_slots)
                self.kv.tree.record(len(req.input_ids), len(prefix_slots))
                if req.needs_prompt_logprobs() and req.logprob_start_len == 0:
                    req.input_logprobs.append(None)
                    req.input_top_logprobs.append(None)
            self.waiting.remove(req)
            self.running.append(req)
            in_batch.insert(req.fill_ids, torch.zeros(req.seq_len, dtype=torch.int64))
            rows.append(_Row(req, state.kv_len, length, sample=self._samples(req, state.kv_len + length)))
            budget -= length
        return rows

    def _shares_in_batch(self, in_batch: RadixCache, req: Req, cached: int) -> bool:
        if self.kv.tree.disable or in_batch.total_size() == 0:
            return False
        shared = in_batch.match_prefix(req.fill_ids[: req.max_cacheable_prefix()]).length
        return shared - cached >= IN_BATCH_PREFIX_THRESHOLD

    def _extend_row(self, req: Req, budget: int) -> _Row | None:
        length = min(req.seq_len - req.kv.kv_len, budget)
        if not self.kv.reserve(req.kv, req.kv.kv_len + length):
            return None
        return _Row(req, req.kv.kv_len, length, sample=self._samples(req, req.kv.kv_len + length))

    @staticmethod
    def _samples(req: Req, end: int) -> bool:
        return end == req.seq_len and req.params.max_new_tokens > 0

    # ----------------------------------------------------------- the forward
    def _run(self, rows: list[_Row]) -> None:
        device = self.runner.device
        ids, positions, out_slots, logit_rows, sample_at = [], [], [], [], []
        prompt_lp: list[tuple[_Row, int, int, int]] = []  # row, first logit index, first pos, count
        n_tokens = 0
        for row in rows:
            req = row.req
            end = row.start + row.length
            ids.extend(req.fill_ids[row.start : end])
            positions.append(torch.arange(row.start, end))
            out_slots.append(self.kv.slots(req.kv, row.start, end))
            if req.needs_prompt_logprobs():
                lo = max(row.start, max(req.logprob_start_len, 1) - 1)
                hi = min(end, len(req.input_ids) - 1)
                if hi > lo:
                    prompt_lp.append((row, len(logit_rows), lo, hi - lo))
                    logit_rows.extend(range(n_tokens + lo - row.start, n_tokens + hi - row.start))
            if row.sample:
                sample_at.append(len(logit_rows))
                logit_rows.append(n_tokens + row.length - 1)
            n_tokens += row.length
        num_decode = sum(1 for r in rows if r.length == 1)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.cat(positions).to(device),
            out_slots=torch.cat(out_slots),
            req_rows=torch.tensor([r.req.kv.row for r in rows], dtype=torch.int64, device=device),
            prefix_lens=[r.start for r in rows],
            extend_lens=[r.length for r in rows],
            num_decode=num_decode,
            logits_indices=torch.tensor(logit_rows, dtype=torch.int64, device=device),
            req_to_token=self.kv.table.table,
            kv_pool=self.runner.kv_pool,
            attn_backend=self.runner.attn_backend,
        )
        t0 = time.perf_counter()
        logits = self.runner.forward(batch)
        self.forward_passes += 1
        self.stats.forward_s = time.perf_counter() - t0
        self.stats.num_decode = num_decode
        self.stats.num_prefill_tokens = n_tokens - num_decode

        for row, first, pos, count in prompt_lp:
            req = row.req
            values, tops = prompt_logprobs(logits[first : first + count], req.input_ids[pos + 1 : pos + 1 + count], req.top_logprobs_num)
            req.input_logprobs.extend(values)
            req.input_top_logprobs.extend(tops or [None] * count)

        sampling = [r for r in rows if r.sample]
        sampled = None
        if sampling:
            sampled = self._sample(sampling, logits.index_select(0, torch.tensor(sample_at, device=logits.device)))
        for row in rows:
            row.req.kv.kv_len = row.start + row.length
        self._advance(rows, sampling, sampled)

    def _grammar_mask(self, reqs: list[Req]) -> torch.Tensor | None:
        """Allowed tokens per row (bool ``[B, V]``) from the rows' grammars; None if none has one."""
        if all(r.grammar is None for r in reqs):
            return None
        bitmask = torch.full((len(reqs), bitmask_width(self.vocab_size)), -1, dtype=torch.int32)
        for i, req in enumerate(reqs):
            if req.grammar is not None:
                req.grammar.fill_bitmask(bitmask, i)
        return unpack_bitmask(bitmask, self.vocab_size).to(self.runner.device)

    def _sample(self, rows: list[_Row], logits: torch.Tensor):
        reqs = [r.req for r in rows]
        allowed = self._grammar_mask(reqs)
        srows = []
        for req in reqs:
            banned = ()
            if len(req.output_ids) < req.params.min_new_tokens and req.grammar is None:
                banned = sorted((set() if req.params.ignore_eos else self.end_ids) | set(req.params.stop_token_ids))
            srows.append(
                SamplingRow(
                    params=req.params,
                    prompt_ids=req.input_ids,
                    output_ids=req.output_ids,
                    generator=req.generator,
                    banned_ids=banned,
                    want_logprob=req.return_logprob,
                    top_logprobs_num=req.top_logprobs_num,
                )
            )
        return sample(logits, srows, self.generator, allowed)

    # ------------------------------------------------------------- bookkeeping
    def _advance(self, rows: list[_Row], sampling: list[_Row], sampled) -> None:
        now = time.monotonic()
        for i, row in enumerate(sampling):
            req = row.req
            token = sampled.token_ids[i]
            req.output_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            if req.return_logprob:
                req.output_logprobs.append(sampled.logprobs[i])
                req.output_top_logprobs.append(sampled.top_logprobs[i])
            if req.grammar is not None and not req.grammar.accept(token):
                self.running.remove(req)  # cannot happen with the mask applied; never emit invalid output
                self._finish(req, FinishReason("abort", message="the grammar rejected a sampled token"))
                continue
            reason = self._check_finish(req, token)
            if reason is None and req.grammar is not None and not self.args.disable_jump_forward:
                reason = self._jump_forward(req)
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason)
            elif req.stream:
                req.sink(self.outputs.build(req, finished=False))
        for row in rows:
            req = row.req
            if req.finish is not None:
                continue
            if not row.sample and row.start + row.length == req.seq_len:  # max_new_tokens == 0
                self.running.remove(req)
                self._finish(req, FinishReason("length"))
            elif row.length > 1:
                self.kv.cache_prefix(req.kv, req.fill_ids)  # share the prompt while it runs
        if not self.stats.num_retracted:
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)

    def _jump_forward(self, req: Req) -> FinishReason | None:
        """Append what the grammar forces next; the new tokens are prefilled in the next step."""
        budget = req.params.max_new_tokens - len(req.output_ids)
        jump = plan_jump(self.tokenizer, req.output_ids, req.grammar.forced_text(), req.grammar, budget)
        if jump is None:
            return None
        if jump.drop:
            del req.output_ids[-jump.drop :]
            if req.return_logprob:
                del req.output_logprobs[-jump.drop :]
                del req.output_top_logprobs[-jump.drop :]
            req.kv.kv_len = min(req.kv.kv_len, req.seq_len)
            req.detok = None  # the tail was re-tokenized: decode the output afresh
        req.output_ids.extend(jump.tokens)
        req.jump_tokens += len(jump.tokens) - jump.drop
        if req.return_logprob:
            req.output_logprobs.extend([0.0] * len(jump.tokens))
            req.output_top_logprobs.extend([None] * len(jump.tokens))
        return self._check_finish(req, req.output_ids[-1])

    def _check_finish(self, req: Req, token: int) -> FinishReason | None:
        p = req.params
        n_out = len(req.output_ids)
        if not p.ignore_eos and token in self.end_ids and n_out >= p.min_new_tokens:
            self.outputs.update_text(req, final=True)
            return FinishReason("stop", matched=token)
        if token in p.stop_token_ids and n_out >= p.min_new_tokens:
            self.outputs.update_text(req, final=True)
            return FinishReason("stop", matched=token)
        if req.grammar is not None and req.grammar.is_terminated():
            self.outputs.update_text(req, final=True)
            return FinishReason("stop", matched=None)
        stop = self.outputs.update_text(req, final=False)
        if stop is not None and n_out >= p.min_new_tokens:
            return FinishReason("stop", matched=stop)
        if n_out >= p.max_new_tokens or req.seq_len >= self.context_len:
            self.outputs.update_text(req, final=True)
            return FinishReason("length")
        return None

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finish = reason
        if req.kv is not None:
            self.kv.release(req.kv, req.fill_ids)
            req.kv = None
        if req.grammar is not None:
            req.grammar = None
        req.sink(self.outputs.build(req, finished=True))

    # ------------------------------------------------------------ inspection
    def check_accounting(self) -> None:
        """Assert the KV invariant: free + tree + running-owned slots = pool size."""
        self.kv.check_accounting([r.kv for r in self.running if r.kv is not None])
