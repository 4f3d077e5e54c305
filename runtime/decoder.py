"""Decoder: turns a forward pass's logits into tokens and advances the requests.

Per step it records prompt logprobs, applies each constrained row's grammar mask, samples one
token per plain row (batched), verifies draft tokens row by row, appends what was picked, checks
stop conditions and proposes the next drafts (jump-forward).

Jump-forward with verification: when the grammar forces a string, its tokens are appended as
*drafts* and computed in the next pass together with the token before them; the model then
picks a token at every draft position under the grammar mask, exactly as plain decoding would,
and a draft survives only if it is what was picked (speculative acceptance for sampled rows).
Speculative drafts (``runtime/speculative``: prediction, n-gram, draft model) take the same
path; a draft model's proposal distribution (``req.draft_probs``) goes to ``accept_draft``.
Greedy output is therefore identical with and without jump-forward; each pass still yields one
token at least, and one per accepted draft more.

Lazy masking (``--grammar-mask lazy``, the default): a constrained row whose pick does not depend
on what the mask leaves (greedy, or temperature without top-k/top-p/min-p) and whose grammar
forces no text is picked first without its mask; the grammar then takes the pick, or refuses it,
and only then is the mask computed and the row picked again with the same noise, which gives the
masked pick exactly (``sampler.sample``). Forced text is left to the mask because there the mask
allows only the canonical tokens of that text, while the grammar would take any split of it.
Where a grammar allows most of the vocabulary (inside strings: the slowest masks) the mask is
rarely needed.

Every per-request step (prompt logprobs, grammar mask, sampling, verification, appending) runs
under its own guard: a request whose step raises, whose logits are not finite, or whose row the
sampler could not sample (its logit_bias, penalties or temperature overflowed, every token banned)
is returned as failed (``FinishReason.failure``, a 500) and the others carry on; a request whose
stop_regex searches ran over their time limit fails as the client's error (a 400).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from radixlm.runtime.constrained.base import bitmask_width, unpack_bitmask
from radixlm.runtime.constrained.jump_forward import draft_tokens
from radixlm.runtime.faults import FaultInjector
from radixlm.runtime.output import OutputBuilder
from radixlm.runtime.request import FinishReason, Req
from radixlm.runtime.sampler import (
    SampleResult,
    SamplingRow,
    accept_draft,
    exact_without_mask,
    prompt_logprobs,
    sample,
)
from radixlm.runtime.schedule_batch import LogitSpans
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.stop_regex import StopRegexTooSlow

logger = logging.getLogger(__name__)


def _constraint_failure(req: Req) -> FinishReason | None:
    """The abort of a request whose grammar failed (nothing valid can follow), or None."""
    try:
        error = req.grammar.error() if req.grammar is not None else None
    except Exception:  # a broken matcher: the caller reports the failure it has
        return None
    return None if error is None else FinishReason("abort", message=f"constraint failed: {error}")


class SamplingFailed(RuntimeError):
    """A draft position's logits could not be sampled (the sampler said why)."""


@dataclass
class _Picked:
    """Tokens picked for one request in this step (and why the grammar stopped it, if it did)."""

    req: Req
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list = field(default_factory=list)
    refused: str | None = None

    def add(self, token: int, logprob: float | None, top) -> None:
        """Record one picked token."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.tops.append(top)


class Decoder:
    """Picks tokens from logits and applies them to requests (no KV bookkeeping)."""

    def __init__(self, args: ServerArgs, tokenizer, outputs: OutputBuilder, end_ids: set[int], vocab_size: int, context_len: int, device: torch.device, faults: FaultInjector | None = None) -> None:
        self.faults = faults
        self.args = args
        self.tokenizer = tokenizer
        self.outputs = outputs
        self.end_ids = end_ids
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(args.random_seed)
        self.grammar_masks = 0  # grammar masks computed
        self.grammar_lazy_picks = 0  # constrained picks the grammar took without a mask (lazy masking)

    # ------------------------------------------------------------ the step
    def process(self, logits: torch.Tensor, spans: LogitSpans) -> list[tuple[Req, FinishReason]]:
        """Consume the logits of one pass; returns the requests that finished (or failed) and why."""
        failed: dict[Req, FinishReason] = {}
        self._check_finite(logits, spans, failed)
        for row, first, pos, count in spans.prompt:
            req = row.req
            if req in failed:
                continue
            try:
                values, tops = prompt_logprobs(logits[first : first + count], req.input_ids[pos + 1 : pos + 1 + count], req.top_logprobs_num)
                req.input_logprobs.extend(values)
                req.input_top_logprobs.extend(tops or [None] * count)
            except Exception as exc:
                self._fail(req, failed, "computing prompt logprobs", exc)
        plain = [(row.req, first) for row, first, count in spans.picks if count == 1 and row.req not in failed]
        picked = self._pick_plain(logits, plain, failed)
        for row, first, count in spans.picks:
            if count > 1 and row.req not in failed:
                try:
                    picked.append(self._verify(row.req, logits[first : first + count]))
                except Exception as exc:
                    self._fail(row.req, failed, "verifying drafts", exc)
        finished = []
        now = time.monotonic()
        for pick in picked:
            try:
                reason = self._append(pick, now)
            except Exception as exc:
                self._fail(pick.req, failed, "building the output", exc)
                continue
            if reason is not None:
                finished.append((pick.req, reason))
        finished += list(failed.items())
        return finished

    @staticmethod
    def _fail(req: Req, failed: dict[Req, FinishReason], what: str, exc: Exception) -> None:
        reason = _constraint_failure(req)
        if reason is not None:  # the grammar left no token (its mask was empty): say why
            logger.warning("request %s failed while %s: %s", req.rid, what, reason.message)
            failed.setdefault(req, reason)
            return
        if isinstance(exc, StopRegexTooSlow):  # the client's pattern: its message names stop_regex
            logger.warning("request %s failed while %s: %s", req.rid, what, exc)
            failed.setdefault(req, FinishReason.failure(str(exc), status=exc.status))
            return
        logger.exception("request %s failed while %s", req.rid, what)
        failed.setdefault(req, FinishReason.failure(f"{what} failed: {exc}"))

    def _check_finite(self, logits: torch.Tensor, spans: LogitSpans, failed: dict[Req, FinishReason]) -> None:
        """Fail each request with a NaN or infinite logit: its KV must never reach the cache."""
        ranges = [(row.req, first, count) for row, first, _, count in spans.prompt]
        ranges += [(row.req, first, count) for row, first, count in spans.picks]
        if self.faults is not None:
            self.faults.poison(logits, [(req.rid, first, count) for req, first, count in ranges])
        # a row's sum is finite only when every entry is (an inf or NaN makes it inf or NaN), and
        # the sum is one cheap pass; a sum that overflowed is checked entry by entry below
        if logits.numel() == 0 or bool(torch.isfinite(logits.sum(dim=-1)).all()):
            return
        finite = torch.isfinite(logits).all(dim=-1)
        if bool(finite.all()):
            return
        finite = finite.tolist()
        for req, first, count in ranges:
            if not all(finite[first : first + count]):
                logger.error("request %s produced non-finite logits", req.rid)
                failed.setdefault(req, FinishReason.failure("the model produced non-finite logits (NaN or inf) for this request"))

    def _pick_plain(self, logits: torch.Tensor, plain: list[tuple[Req, int]], failed: dict[Req, FinishReason]) -> list[_Picked]:
        """Sample one token for each plain row: batched, or row by row when the batch raises."""
        masks: dict[Req, torch.Tensor | None] = {}
        lazy: set[Req] = set()  # picked before their mask; ``taken``: those whose grammar took the pick
        for req, _ in plain:
            try:
                if self._may_mask_lazily(req):
                    lazy.add(req)
                    masks[req] = None
                else:
                    masks[req] = self._grammar_row_mask(req)
            except Exception as exc:
                self._fail(req, failed, "computing the grammar mask", exc)
        plain = [(req, first) for req, first in plain if req not in failed]
        if not plain:
            return []
        taken: set[Req] = set()
        try:
            res = self._sample(logits, plain, masks, lazy, taken, failed)
            results = list(zip([r for r, _ in plain], res.token_ids, res.logprobs, res.top_logprobs))
            self._fail_unsampled([r for r, _ in plain], res, failed)
        except Exception:
            for req in taken:  # the batch's picks are void: their grammars step back
                req.grammar.rollback(1)
            taken.clear()
            results = []
            for req, first in plain:
                if req in failed:
                    continue
                try:
                    one = self._sample(logits, [(req, first)], masks, lazy, taken, failed)
                    results.append((req, one.token_ids[0], one.logprobs[0], one.top_logprobs[0]))
                    self._fail_unsampled([req], one, failed)
                except Exception as exc:
                    self._fail(req, failed, "sampling", exc)
        picked = []
        for r, t, lp, top in results:
            if r in failed:
                continue
            pick = _Picked(r)
            if r in taken or self._grammar_takes(r, t, pick):
                pick.add(t, lp, top)
            picked.append(pick)
        return picked

    @staticmethod
    def _fail_unsampled(reqs: list[Req], res: SampleResult, failed: dict[Req, FinishReason]) -> None:
        """Fail each request whose row the sampler could not sample (non-finite logits, all banned)."""
        for i, req in enumerate(reqs):
            message = res.failure(i)
            if message is not None:
                reason = _constraint_failure(req) or FinishReason.failure(message)
                logger.error("request %s: %s", req.rid, reason.message)
                failed.setdefault(req, reason)

    def _may_mask_lazily(self, req: Req) -> bool:
        """True when ``req``'s next token may be picked before its grammar mask (module doc)."""
        if req.grammar is None or req.beam_round or self.args.grammar_mask != "lazy" or not exact_without_mask(req.params):
            return False  # a beam's step needs the mask: its candidates are the allowed tokens
        if self.faults is not None:
            self.faults.check(req.rid, "grammar")
        # Where text is forced, llguidance's mask keeps only its canonical tokens while the grammar
        # takes other splits of it too (measured: no disagreement elsewhere): the mask decides there.
        return req.grammar.error() is None and not req.grammar.mask_needed() and not req.grammar.forced_text()

    def _sample(self, logits: torch.Tensor, plain: list[tuple[Req, int]], masks: dict[Req, torch.Tensor | None], lazy: set[Req], taken: set[Req], failed: dict[Req, FinishReason]):
        reqs = [r for r, _ in plain]
        if self.faults is not None:
            for r in reqs:
                self.faults.check(r.rid, "sample")
        firsts = [f for _, f in plain]
        if firsts == list(range(logits.shape[0])):  # every row, in order (a decode step): no copy
            rows_logits = logits
        else:
            rows_logits = logits.index_select(0, torch.tensor(firsts, device=logits.device))
        mask = None
        if any(masks[r] is not None for r in reqs):
            mask = self._unpack([masks[r] for r in reqs])

        def recheck(i: int, token: int) -> torch.Tensor | None:
            """None when the pick of a lazy row stands (its grammar took it), else its mask."""
            req = reqs[i]
            if req not in lazy or req in taken or req in failed:
                return None
            if token not in self.end_ids and req.grammar.accept(token):  # an end token: the mask decides
                taken.add(req)
                self.grammar_lazy_picks += 1
                return None
            try:
                masks[req] = self._grammar_row_mask(req)
            except Exception as exc:
                self._fail(req, failed, "computing the grammar mask", exc)
                return None
            lazy.discard(req)  # a row-by-row retry uses the mask now computed
            return self._unpack([masks[req]])[0]

        return sample(rows_logits, [self._sampling_row(r, r.output_ids) for r in reqs], self.generator, mask, recheck if lazy else None)

    # ------------------------------------------------------------ picking
    def _sampling_row(self, req: Req, output_ids: list[int]) -> SamplingRow:
        banned: tuple | list = ()
        if len(output_ids) < req.params.min_new_tokens and req.grammar is None:
            banned = sorted((set() if req.params.ignore_eos else self.end_ids) | set(req.params.stop_token_ids))
        return SamplingRow(req.params, req.input_ids, output_ids, req.generator, banned, req.return_logprob, req.top_logprobs_num, masked_tops=req.beam_round)

    def _unpack(self, rows: list[torch.Tensor | None]) -> torch.Tensor:
        """Bitmask rows (None: unconstrained) as one bool mask ``[B, V]`` on the logits' device:
        the packed words travel (a 32nd of the bools) and are unpacked there."""
        full = torch.full((bitmask_width(self.vocab_size),), -1, dtype=torch.int32)
        packed = torch.stack([full if r is None else r for r in rows]).to(self.device)
        return unpack_bitmask(packed, self.vocab_size)

    def _grammar_row_mask(self, req: Req) -> torch.Tensor | None:
        """Allowed tokens of one request as an int32 bitmask row ``[W]`` (on the CPU, where the
        backends write it); None when unconstrained."""
        if req.grammar is None:
            return None
        if self.faults is not None:
            self.faults.check(req.rid, "grammar")
        bitmask = torch.full((1, bitmask_width(self.vocab_size)), -1, dtype=torch.int32)
        self.grammar_masks += 1
        req.grammar.fill_bitmask(bitmask, 0)
        if req.grammar.error() is not None:  # fail closed: the pick is refused below
            bitmask[0] = 0
        return bitmask[0]

    def _grammar_takes(self, req: Req, token: int, pick: _Picked) -> bool:
        """Feed a picked token to the request's grammar; on refusal record why (fail closed)."""
        if req.grammar is None:
            return True
        error = req.grammar.error()
        if error is None and req.grammar.accept(token):
            return True
        pick.refused = error or f"the grammar refused token {token}"
        return False

    def _verify(self, req: Req, logits: torch.Tensor) -> _Picked:
        """Pick at each draft position in turn; stop at the first pick that differs from the draft."""
        drafts = req.draft_ids
        pick = _Picked(req)
        accepted = 0
        for i in range(len(drafts) + 1):
            srow = self._sampling_row(req, req.output_ids + pick.tokens)
            res = self._greedy_without_mask(req, logits[i], srow)
            if res is None:  # the mask decides
                row = self._grammar_row_mask(req)
                mask = None if row is None else self._unpack([row])[0]
                if i < len(drafts):
                    extra = {} if req.draft_probs is None else {"draft_probs": req.draft_probs[i]}
                    res = accept_draft(logits[i], srow, drafts[i], self.generator, mask, **extra)
                else:
                    res = sample(logits[i : i + 1], [srow], self.generator, None if mask is None else mask[None])
                if res.failure(0) is None and not self._grammar_takes(req, res.token_ids[0], pick):
                    break
            if res.failure(0) is not None:
                raise SamplingFailed(res.failure(0))
            token = res.token_ids[0]
            pick.add(token, res.logprobs[0], res.top_logprobs[0])
            if i == len(drafts) or token != drafts[i]:
                break
            accepted += 1
            if req.grammar is not None and req.grammar.is_terminated():
                break  # the drafts completed the grammar: nothing more to pick
            if self._is_stop_token(req, token, len(req.output_ids) + len(pick.tokens)):
                break  # a stop token among the drafts ends the request there
        self._count_verified(req, len(drafts), accepted)
        req.clear_drafts()
        return pick

    def _greedy_without_mask(self, req: Req, logits: torch.Tensor, srow: SamplingRow):
        """A greedy constrained row's pick at a draft position, taken by its grammar without a
        mask (the unmasked argmax, when the grammar takes it, is the masked one); None when the
        mask must decide (not lazy, not greedy, or the grammar refuses the argmax)."""
        if not srow.params.greedy or not self._may_mask_lazily(req):
            return None
        res = sample(logits[None], [srow], self.generator)
        token = res.token_ids[0]
        if res.failure(0) is not None or token in self.end_ids or not req.grammar.accept(token):
            return None
        self.grammar_lazy_picks += 1
        return res

    @staticmethod
    def _count_verified(req: Req, drafted: int, accepted: int) -> None:
        """Add one verify pass to the request's counters (speculative or jump-forward)."""
        if not req.speculating:
            req.accepted_draft_tokens += accepted
            return
        req.spec_verify_passes += 1
        req.spec_draft_tokens += drafted
        req.spec_accepted_tokens += accepted
        if req.draft_source == "prediction":
            req.prediction_draft_tokens += drafted
            req.prediction_accepted_tokens += accepted

    # ---------------------------------------------------------- bookkeeping
    def _append(self, pick: _Picked, now: float) -> FinishReason | None:
        """Append picked tokens; returns a finish reason, or None (and proposes new drafts)."""
        req = pick.req
        req.clear_drafts()
        if req.first_token_time is None:
            req.first_token_time = now
        keep = max(req.params.max_new_tokens - len(req.output_ids), 0)
        del pick.tokens[keep:], pick.logprobs[keep:], pick.tops[keep:]
        stop = self._extend(req, pick)
        if stop is not None:
            return stop
        if pick.refused is not None:
            self.outputs.update_text(req, final=True)
            return FinishReason("abort", message=f"constraint failed: {pick.refused}")
        reason = self._check_finish(req, pick.tokens[-1]) if pick.tokens else self._check_finish(req, None)
        if reason is None and req.grammar is not None and not self.args.disable_jump_forward:
            self._propose_drafts(req)
        if reason is None and req.stream and len(req.output_ids) - req.streamed_tokens >= (req.params.stream_interval or 1):
            if self.faults is not None:
                self.faults.check(req.rid, "output")
            req.streamed_tokens = len(req.output_ids)
            req.sink(self.outputs.build(req, finished=False))
        return reason

    def _extend(self, req: Req, pick: _Picked) -> FinishReason | None:
        """Append the picked tokens; with several and stop strings, one at a time, ending at the
        first token that completes a stop (as decoding them one per pass would)."""
        p = req.params
        if len(pick.tokens) < 2 or not (p.stop or p.stop_regex):
            req.output_ids.extend(pick.tokens)
            if req.return_logprob:
                req.output_logprobs.extend(pick.logprobs)
                req.output_top_logprobs.extend(pick.tops)
            return None
        for i, token in enumerate(pick.tokens):
            req.output_ids.append(token)
            if req.return_logprob:
                req.output_logprobs.append(pick.logprobs[i])
                req.output_top_logprobs.append(pick.tops[i])
            if i == len(pick.tokens) - 1:
                return None  # the last token is checked by _check_finish, as usual
            stop = self.outputs.update_text(req, final=False)
            if stop is not None and len(req.output_ids) >= p.min_new_tokens:
                return FinishReason("stop", matched=stop)
        return None

    def _is_stop_token(self, req: Req, token: int, n_out: int) -> bool:
        """True when ``token``, as output token number ``n_out``, ends the request."""
        p = req.params
        if n_out < p.min_new_tokens:
            return False
        return (not p.ignore_eos and token in self.end_ids) or token in p.stop_token_ids

    def _propose_drafts(self, req: Req) -> None:
        # The verifying pass yields one token past the drafts: leave room for it.
        budget = min(req.remaining_tokens() - 1, self.context_len - 1 - req.seq_len)
        req.clear_drafts()
        req.draft_ids = draft_tokens(self.tokenizer, req.grammar.forced_text(), budget)
        if req.draft_ids:
            req.draft_source = "jump_forward"

    def propose_initial_drafts(self, req: Req) -> None:
        """Drafts for text the grammar forces before anything is generated."""
        if req.grammar is not None and not self.args.disable_jump_forward and not req.output_ids and not req.beam_round:
            self._propose_drafts(req)

    def _check_finish(self, req: Req, token: int | None) -> FinishReason | None:
        reason = self._finish_of(req, token)
        if reason is not None and reason.type == "stop" and not isinstance(reason.matched, str) and req.grammar is not None and req.grammar.cut_short():
            return FinishReason("length", closed_within_budget=True)  # whole JSON, shortened to fit (a stop string is reported as it is)
        return reason

    def _finish_of(self, req: Req, token: int | None) -> FinishReason | None:
        p = req.params
        n_out = len(req.output_ids)
        if req.grammar is not None and req.grammar.error() is not None:
            self.outputs.update_text(req, final=True)
            return FinishReason("abort", message=f"constraint failed: {req.grammar.error()}")
        if not p.ignore_eos and token in self.end_ids and n_out >= p.min_new_tokens:
            self.outputs.update_text(req, final=True)
            return FinishReason("stop", matched=token)
        if token in p.stop_token_ids and n_out >= p.min_new_tokens:
            self.outputs.update_text(req, final=True)
            return FinishReason("stop", matched=token)
        if req.grammar is not None and req.grammar.is_terminated():
            stop = self.outputs.update_text(req, final=True)  # a stop in the last text is still reported
            return FinishReason("stop", matched=stop)
        stop = self.outputs.update_text(req, final=False)
        if stop is not None and n_out >= p.min_new_tokens:
            return FinishReason("stop", matched=stop)
        if n_out >= p.max_new_tokens or req.seq_len >= self.context_len:
            self.outputs.update_text(req, final=True)
            return FinishReason("length")
        return None
