"""OutputBuilder: incremental text, stop strings and the ``meta_info`` a request reports."""

from __future__ import annotations

import time
from typing import Any

from radixlm.runtime.request import Req, ReqOutput
from radixlm.runtime.tokenizer import IncrementalDetokenizer


class OutputBuilder:
    """Detokenizes outputs as they grow, applies stop strings and assembles ReqOutputs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def update_text(self, req: Req, final: bool) -> str | None:
        """Bring ``req.text`` up to date; returns the stop string found in the new text, if any.

        While a request runs, text that might be the start of a stop string is held back so a
        stream never shows what the stop will trim.
        """
        if req.detok is None:
            req.detok = IncrementalDetokenizer(self.tokenizer, req.input_ids, req.params.skip_special_tokens)
        delta = req.detok.update(req.output_ids, final=final)
        full = req.detok.text
        stops = req.params.stop
        if not stops:
            req.text = full
            return None
        longest = max(len(s) for s in stops)
        scan_from = max(0, len(full) - len(delta) - longest + 1)
        best: tuple[int, str] | None = None
        for s in stops:
            i = full.find(s, scan_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            req.text = full[: i + len(s)] if req.params.no_stop_trim else full[:i]
            return s
        hold = 0 if final else _partial_stop_suffix(full, stops)
        req.text = full[: len(full) - hold]
        return None

    def build(self, req: Req, finished: bool) -> ReqOutput:
        """The cumulative output of ``req`` as of now."""
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": max(req.cached_tokens, 0),
            "finish_reason": req.finish.to_dict() if req.finish else None,
            "e2e_latency": time.monotonic() - req.arrival,
        }
        if req.first_token_time is not None:
            meta["ttft"] = req.first_token_time - req.arrival
        if req.return_logprob:
            with_text = req.return_text_in_logprobs
            meta["input_token_logprobs"] = self._triples(req.input_logprobs, req.input_ids[len(req.input_ids) - len(req.input_logprobs) :], with_text)
            meta["output_token_logprobs"] = self._triples(req.output_logprobs, req.output_ids, with_text)
            if req.top_logprobs_num:
                meta["input_top_logprobs"] = [self._tops(t, with_text) for t in req.input_top_logprobs]
                meta["output_top_logprobs"] = [self._tops(t, with_text) for t in req.output_top_logprobs]
        return ReqOutput(req.rid, req.text, list(req.output_ids), meta, finished)

    def _token_text(self, token_id: int, with_text: bool) -> str | None:
        return self.tokenizer.decode([token_id]) if with_text else None

    def _triples(self, logprobs: list, ids: list[int], with_text: bool) -> list[tuple]:
        return [(lp, tid, self._token_text(tid, with_text)) for lp, tid in zip(logprobs, ids)]

    def _tops(self, tops: list | None, with_text: bool) -> list[tuple] | None:
        if tops is None:
            return None
        return [(lp, tid, self._token_text(tid, with_text)) for lp, tid in tops]


def _partial_stop_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that begins some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
