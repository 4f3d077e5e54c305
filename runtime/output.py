"""OutputBuilder: incremental text, stop strings and the ``meta_info`` a request reports."""

from __future__ import annotations

import time
import weakref
from typing import Any

from radixlm.runtime.request import Req, ReqOutput
from radixlm.runtime.stop_regex import find_stop_regex, partial_stop_regex_len, search_deadline
from radixlm.runtime.stop_strings import StopScan
from radixlm.runtime.tokenizer import IncrementalDetokenizer


class OutputBuilder:
    """Detokenizes outputs as they grow, applies stop strings and assembles ReqOutputs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts = _TokenTexts(tokenizer)
        # Per-request logprob entries, built once each; a request that vanishes unfinished
        # (its loop stopped) takes its entry with it.
        self._logs: weakref.WeakKeyDictionary[Req, _LogprobLog] = weakref.WeakKeyDictionary()
        # Per-request place in its stop-string automaton (stop_strings.py), likewise.
        self._scans: weakref.WeakKeyDictionary[Req, StopScan] = weakref.WeakKeyDictionary()

    def update_text(self, req: Req, final: bool) -> str | None:
        """Bring ``req.text`` up to date; returns the stop string (or stop_regex pattern) found
        in the new text, if any. The earliest stop wins; it is trimmed unless ``no_stop_trim``.

        While a request runs, text that might be the start of a stop string or of a stop_regex
        match is held back so a stream never shows what the stop will trim.
        """
        p = req.params
        if req.detok is None:
            req.detok = IncrementalDetokenizer(self.tokenizer, req.input_ids, p.skip_special_tokens, p.spaces_between_special_tokens)
        delta = req.detok.update(req.output_ids, final=final)
        full = req.detok.text
        if not p.stop and not p.stop_regex:
            req.text = full
            return None
        scan = None
        best = None
        if p.stop:
            scan = self._scans.get(req)
            if scan is None:
                scan = self._scans[req] = StopScan(p.stop_strings())
            best = scan.update(full)
        deadline = search_deadline() if p.stop_regex else None
        if p.stop_regex:
            found = find_stop_regex(full, len(delta), p.stop_regex, deadline)
            if found is not None and (best is None or found[0] < best[0]):
                best = found
        if best is not None:
            start, end, matched = best
            req.text = full[:end] if p.no_stop_trim else full[:start]
            return matched
        hold = 0
        if not final:
            hold = max(scan.hold() if scan is not None else 0, partial_stop_regex_len(full, p.stop_regex, deadline))
        req.text = full[: len(full) - hold]
        return None

    def build(self, req: Req, finished: bool) -> ReqOutput:
        """The output of ``req`` as of now: cumulative text and ids; logprobs as described below.

        A non-streamed request's output carries every logprob entry. A streamed request's
        outputs (its final one included) carry only the entries new since its previous output,
        so concatenating the lists of every chunk gives the non-streamed result and each step
        costs time in proportion to its new tokens, not to the output so far.
        """
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": max(req.cached_tokens, 0),
            "finish_reason": req.finish.to_dict() if req.finish else None,
            "e2e_latency": time.monotonic() - req.arrival,
        }
        if req.tier_tokens is not None:  # KV tiers on: where the cached tokens came from
            meta["cached_tokens_details"] = {"device": max(meta["cached_tokens"] - sum(req.tier_tokens.values()), 0), **req.tier_tokens}
        if req.first_token_time is not None:
            meta["ttft"] = req.first_token_time - req.arrival
        if req.admitted_at is not None:
            meta["queue_time"] = req.admitted_at - req.arrival
        meta["priority"] = req.priority
        if req.preemptions:
            meta["preemptions"] = req.preemptions
        if req.spec_verify_passes:
            meta["spec_verify_passes"] = req.spec_verify_passes
            meta["spec_draft_tokens"] = req.spec_draft_tokens
            meta["spec_accepted_tokens"] = req.spec_accepted_tokens
            meta["spec_accept_length"] = req.spec_accepted_tokens / req.spec_verify_passes
        if req.prediction_ids:
            meta["accepted_prediction_tokens"] = req.prediction_accepted_tokens
            meta["rejected_prediction_tokens"] = req.prediction_draft_tokens - req.prediction_accepted_tokens
        if req.return_cache_info and req.cache_info is not None:
            meta["cache_info"] = req.cache_info
        if req.pd_info is not None:
            meta["pd"] = req.pd_info
        if req.constraint_warnings:
            meta["constraint_warnings"] = list(req.constraint_warnings)
        offsets = (0, 0)
        if req.return_logprob:
            log = self._logs.get(req)
            if log is None:
                log = self._logs[req] = _LogprobLog()
            log.catch_up(req, self._texts if req.return_text_in_logprobs else None)
            offsets = log.emit(meta, incremental=req.stream, with_tops=req.top_logprobs_num > 0)
            if finished:
                del self._logs[req]
        pooled = req.pooling.result if req.pooling is not None and finished else None
        return ReqOutput(req.rid, req.text, list(req.output_ids), meta, finished, input_logprob_offset=offsets[0], output_logprob_offset=offsets[1], pooled=pooled)


class _TokenTexts:
    """The text of single tokens, decoded once per token id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


class _LogprobLog:
    """One request's logprob entries built so far, and how many of them were already sent.

    Entries are ``(logprob, token id, text or None)`` triples; the text is filled only when
    ``return_text_in_logprobs`` is on. Prompt entries cover ``input_ids[logprob_start_len:]``.
    """

    def __init__(self) -> None:
        self.input: list[tuple] = []
        self.input_tops: list[list[tuple] | None] = []
        self.output: list[tuple] = []
        self.output_tops: list[list[tuple] | None] = []
        self.sent_input = 0
        self.sent_output = 0

    def catch_up(self, req: Req, text_of: _TokenTexts | None) -> None:
        """Build the entries of the logprobs ``req`` gained since the last call (only those)."""
        start = max(req.logprob_start_len, 0)
        for i in range(len(self.input), len(req.input_logprobs)):
            self.input.append(_triple(req.input_logprobs[i], req.input_ids[start + i], text_of))
            self.input_tops.append(_tops(req.input_top_logprobs[i], text_of))
        for i in range(len(self.output), len(req.output_logprobs)):
            self.output.append(_triple(req.output_logprobs[i], req.output_ids[i], text_of))
            self.output_tops.append(_tops(req.output_top_logprobs[i], text_of))

    def emit(self, meta: dict[str, Any], incremental: bool, with_tops: bool) -> tuple[int, int]:
        """Put the entries to send into ``meta``; returns the (input, output) index of the first one."""
        first_in = self.sent_input if incremental else 0
        first_out = self.sent_output if incremental else 0
        meta["input_token_logprobs"] = self.input[first_in:]
        meta["output_token_logprobs"] = self.output[first_out:]
        if with_tops:
            meta["input_top_logprobs"] = self.input_tops[first_in:]
            meta["output_top_logprobs"] = self.output_tops[first_out:]
        self.sent_input, self.sent_output = len(self.input), len(self.output)
        return first_in, first_out


def _triple(logprob: float | None, token_id: int, text_of: _TokenTexts | None) -> tuple:
    return (logprob, token_id, text_of(token_id) if text_of is not None else None)


def _tops(tops: list | None, text_of: _TokenTexts | None) -> list[tuple] | None:
    if tops is None:
        return None
    return [_triple(lp, tid, text_of) for lp, tid in tops]
