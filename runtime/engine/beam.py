"""The Engine's beam search: each round's live beams run as one-token requests through the
scheduler, and the radix cache shares what the beams have in common.

A request with ``beam_width`` k > 1 is never queued itself. Its beam search
(``runtime/beam_search.py``) runs rounds. In each round, every live beam becomes a request for
the prompt plus that beam's output so far, with one new token and the top candidates'
log-probabilities. All of a round's requests are queued together, so they share one forward
pass.

A beam's sequence extends its parent's by one token. The parent's KV is already in the radix
tree, where the previous round's request left it, so each round computes one token a beam. Beams
fork by reference: sibling beams lock the same tree nodes and own only their newest token's slot.
With pages of more than one token, a beam recomputes the shared partial last page instead of
copying it. KV held between rounds is the union of the beams' paths, unlocked, so it can be
evicted under pressure and is then recomputed.
"""

from __future__ import annotations

import asyncio
import math
import queue
import time
from collections.abc import Callable
from typing import Any

from radixlm.runtime.beam_search import BeamSearch, Hypothesis
from radixlm.runtime.engine.results import async_sink, await_final, wait_final
from radixlm.runtime.request import Req, ReqOutput
from radixlm.runtime.stop_regex import find_stop_regex, search_deadline


class BeamIntake:
    """Beam search for requests whose ``beam_width`` is above 1 (the Engine's part)."""

    make_request: Callable[..., Req]
    attach_grammar: Callable[[Req], None]
    attach_grammar_async: Callable[[Req], Any]
    submit: Callable[[Req], None]
    tokenizer: Any
    grammars: Any
    end_ids: set[int]

    def _beam_search_for(self, req: Req) -> BeamSearch:
        p = req.params
        ends = (set() if p.ignore_eos else set(self.end_ids)) | set(p.stop_token_ids)  # transformers' eos_token_id list
        return BeamSearch(p.beam_width, p.max_new_tokens, p.length_penalty, p.early_stopping, len(ends), self._beam_stop(req))

    def _beam_stop(self, req: Req) -> Callable[[list[int]], dict[str, Any] | None]:
        """Whether output tokens end there: SGLang's finish_reason (end token, stop token, stop string or regex)."""
        p = req.params
        ends = set() if p.ignore_eos else set(self.end_ids)
        stop_ids = set(p.stop_token_ids)
        grammar = self.grammars.compile(*p.constraint) if p.constraint is not None else None
        matchers: dict[tuple[int, ...], Any] = {}  # this round's parents, each advanced through its tokens

        def grammar_ends(tokens: list[int]) -> bool:
            """True when the constraint allows nothing but an end token after ``tokens``."""
            parent = tuple(tokens[:-1])
            m = matchers.get(parent)
            if m is None:
                if matchers and len(next(iter(matchers))) != len(parent):
                    matchers.clear()  # a new round
                m = matchers[parent] = grammar.matcher()
                for token in parent:
                    m.accept(token)
            if not m.accept(tokens[-1]):
                return False
            done = m.is_terminated()
            m.rollback(1)
            return done

        def stop(tokens: list[int]) -> dict[str, Any] | None:
            last = tokens[-1]
            if last in ends or last in stop_ids:
                return {"type": "stop", "matched": last}
            if p.stop or p.stop_regex:
                text = self.tokenizer.decode(tokens, skip_special_tokens=p.skip_special_tokens)
                for s in p.stop:
                    if s in text:
                        return {"type": "stop", "matched": s}
                # time-limited, as the decoder searches them: a pathological pattern raises StopRegexTooSlow
                found = find_stop_regex(text, len(text), p.stop_regex, search_deadline()) if p.stop_regex else None
                if found is not None:
                    return {"type": "stop", "matched": found[2]}
            if grammar is not None and grammar_ends(tokens):  # as the decoder ends a request there
                return {"type": "stop", "matched": None}
            return None

        return stop

    def _round_kwargs(self, req: Req, search: BeamSearch) -> list[dict[str, Any]]:
        """``make_request`` arguments of one round: a one-token request per live beam (with the
        search's constraint, whose matcher ``_start_round`` moves past the beam's tokens)."""
        sampling: dict[str, Any] = {"max_new_tokens": 1, "temperature": 0.0}
        if req.params.constraint is not None:
            kind, spec = req.params.constraint
            sampling.update({kind: spec, "json_schema_strict": req.params.json_schema_strict})
        common = dict(
            sampling_params=sampling,
            return_logprob=True,
            top_logprobs_num=search.candidates_per_beam() + len(self._banned_early(req)),
            cache_salt=req.cache_salt,
            program=req.program,
            prompt_cache_key=req.prompt_cache_key,
            priority=req.priority,
            lora=req.lora,
        )
        # round rids extend the search's own (so an operator's fault injection by rid reaches them)
        return [dict(input_ids=req.input_ids + beam.tokens, rid=f"{req.rid}-r{search.rounds}-b{i}", **common) for i, beam in enumerate(search.beams)]

    @staticmethod
    def _start_round(r: Req, tokens: list[int]) -> Req:
        """Mark a round's request as a beam step and move its grammar past the beam's output so far."""
        r.beam_round = True
        if r.grammar is not None:
            for token in tokens:
                if not r.grammar.accept(token):
                    raise RuntimeError(f"the grammar refused token {token} of a beam it proposed")
        return r

    def _banned_early(self, req: Req) -> set[int]:
        """Tokens a beam may not end with before ``min_new_tokens`` (as the sampler bans them)."""
        p = req.params
        return (set() if p.ignore_eos else set(self.end_ids)) | set(p.stop_token_ids) if p.min_new_tokens > 0 else set()

    def _proposals(self, out: ReqOutput, search: BeamSearch, req: Req) -> list[tuple[int, float]]:
        """A round's output as (token, log-probability) candidates; raises when it failed."""
        fr = out.meta_info.get("finish_reason") or {}
        if fr.get("type") == "abort":
            raise BeamAborted(fr.get("message") or "aborted", fr.get("status"))
        pairs = [(tid, lp) for lp, tid, _ in out.meta_info["output_top_logprobs"][0] if math.isfinite(lp)]  # -inf: refused by the grammar
        if search.rounds < req.params.min_new_tokens:
            banned = self._banned_early(req)
            pairs = [(t, lp) for t, lp in pairs if t not in banned]
        return pairs[: search.candidates_per_beam()]

    def _answers(self, req: Req, search: BeamSearch, started: float, cached: int) -> list[dict[str, Any]]:
        """One SGLang-shaped output per hypothesis, best first."""
        return [self._answer(req, i, h, started, cached) for i, h in enumerate(search.results())]

    def _answer(self, req: Req, rank: int, h: Hypothesis, started: float, cached: int) -> dict[str, Any]:
        p = req.params
        text = self.tokenizer.decode(h.tokens, skip_special_tokens=p.skip_special_tokens)
        matched = h.finish.get("matched")
        if isinstance(matched, str) and not p.no_stop_trim:
            found = None if matched in p.stop else find_stop_regex(text, len(text), [matched], search_deadline())
            cut = text.find(matched) if found is None else found[0]
            if cut >= 0:
                text = text[:cut]
        meta: dict[str, Any] = {
            "id": f"{req.rid}-{rank}",
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(h.tokens),
            "cached_tokens": cached,
            "finish_reason": h.finish,
            "beam_score": h.score,
            "cumulative_logprob": sum(h.logprobs),
            "e2e_latency": time.monotonic() - started,
            "priority": req.priority,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [(lp, tid, None) for lp, tid in zip(h.logprobs, h.tokens)]
        return {"text": text, "output_ids": list(h.tokens), "meta_info": meta}

    def beam_search_sync(self, req: Req) -> list[dict[str, Any]]:
        """Run ``req``'s beam search to the end (blocking); its hypotheses, best first."""
        return self.beam_searches_sync([req])[0]

    def beam_searches_sync(self, reqs: list[Req]) -> list[list[dict[str, Any]]]:
        """Run several beam searches to the end, their rounds side by side (blocking)."""
        searches = [self._beam_search_for(req) for req in reqs]
        started, cached = time.monotonic(), [-1] * len(reqs)
        while not all(s.done for s in searches):
            rounds = []  # (search index, queues) of this round
            for i, (req, search) in enumerate(zip(reqs, searches)):
                if search.done:
                    continue
                queues, started_reqs = [], []
                for beam, kwargs in zip(search.beams, self._round_kwargs(req, search)):
                    q: queue.Queue = queue.Queue()
                    r = self.make_request(q.put, **kwargs)
                    self.attach_grammar(r)
                    started_reqs.append(self._start_round(r, beam.tokens))
                    queues.append(q)
                for r in started_reqs:
                    self.submit(r)
                rounds.append((i, queues))
            for i, queues in rounds:
                outs = [wait_final(q, self._loop) for q in queues]
                cached[i] = outs[0].meta_info["cached_tokens"] if cached[i] < 0 else cached[i]
                searches[i].advance([self._proposals(out, searches[i], reqs[i]) for out in outs])
        return [self._answers(req, search, started, max(c, 0)) for req, search, c in zip(reqs, searches, cached)]

    async def beam_search_async(self, req: Req, disconnected: Callable[[], Any] | None = None) -> list[dict[str, Any]]:
        """The asyncio form of ``beam_search_sync``; ``disconnected`` (awaitable) ends it early."""
        loop = asyncio.get_running_loop()
        search, started, cached = await asyncio.to_thread(self._beam_search_for, req), time.monotonic(), -1
        while not search.done:
            if disconnected is not None and await disconnected():
                raise BeamAborted("the client disconnected", None)
            queues, reqs = [], []
            for beam, kwargs in zip(search.beams, self._round_kwargs(req, search)):
                q: asyncio.Queue = asyncio.Queue()
                r = await asyncio.to_thread(self.make_request, async_sink(loop, q), **kwargs)
                await self.attach_grammar_async(r)
                reqs.append(await asyncio.to_thread(self._start_round, r, beam.tokens))
                queues.append(q)
            for r in reqs:
                self.submit(r)
            outs = [await await_final(q) for q in queues]
            cached = outs[0].meta_info["cached_tokens"] if cached < 0 else cached
            proposals = [self._proposals(out, search, req) for out in outs]
            await asyncio.to_thread(search.advance, proposals)  # stop checks detokenize and walk grammars
        return self._answers(req, search, started, max(cached, 0))


class BeamAborted(RuntimeError):
    """A beam search ended before its hypotheses: a round was aborted or the client left."""

    def __init__(self, message: str, status: int | None) -> None:
        super().__init__(message)
        self.status = status

