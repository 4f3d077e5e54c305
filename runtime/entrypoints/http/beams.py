"""Beam search over HTTP: ``/generate`` with ``beam_width`` > 1 and ``/v1/completions`` with
``use_beam_search``. Each prompt's search runs on the engine round by round
(``runtime/engine/beam.py``); a client that leaves ends it at the next round."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from radixlm.runtime.engine import EngineError
from radixlm.runtime.engine.beam import BeamAborted
from radixlm.runtime.entrypoints.http.common import ServerState
from radixlm.runtime.entrypoints.http.errors import APIError, bad_request
from radixlm.runtime.request import ReqOutput
from radixlm.runtime.stop_regex import StopRegexTooSlow


def beam_width_of(params: Any) -> int:
    """The ``beam_width`` one prompt's sampling params ask for, read without building anything (1 when absent)."""
    width = params.get("beam_width", 1) if isinstance(params, dict) else 1
    return width if isinstance(width, int) and not isinstance(width, bool) else 1


async def run_beams(state: ServerState, request: Request, calls: list[dict[str, Any]], default_param: str) -> list[list[ReqOutput]]:
    """Validate every call (``make_request`` arguments of one prompt) and run their beam searches
    at once; each call's hypotheses, best first. Errors come back as APIError naming the field."""
    engine = state.engine
    state.check_fits(sum(max(beam_width_of(c.get("sampling_params")), 1) for c in calls), "beam_width")
    reqs = []
    for call in calls:
        try:
            req = await asyncio.to_thread(engine.make_request, lambda out: None, **call)
        except EngineError as exc:
            raise APIError(503, str(exc)) from None
        except Exception as exc:
            raise bad_request(exc, default_param) from None
        if req.params.beam_width == 1:
            raise APIError(400, "a batch mixes beam_width > 1 with plain decoding: send them as separate requests", param="beam_width")
        reqs.append(req)
    try:
        answers = await asyncio.gather(*(engine.beam_search_async(req, request.is_disconnected) for req in reqs))
    except EngineError as exc:
        raise APIError(503, str(exc)) from None
    except BeamAborted as exc:
        raise APIError(exc.status or 500, f"beam search ended early: {exc}") from None
    except StopRegexTooSlow as exc:
        raise APIError(400, str(exc), param="stop_regex") from None
    outs = [[ReqOutput(a["meta_info"]["id"], a["text"], a["output_ids"], a["meta_info"], True) for a in answer] for answer in answers]
    for hyps in outs:
        if hyps:
            state.metrics.observe_finished(hyps[0].meta_info)  # one finished request per prompt
    return outs


def beam_sampling(sampling: dict[str, Any], width: int, length_penalty: float | None, early_stopping: Any) -> dict[str, Any]:
    """An OpenAI completion's sampling params for ``use_beam_search``: ``n`` beams (vLLM's meaning)."""
    out = {**sampling, "beam_width": width, "n": 1}
    if length_penalty is not None:
        out["length_penalty"] = length_penalty
    if early_stopping is not None:
        out["early_stopping"] = early_stopping
    return out
