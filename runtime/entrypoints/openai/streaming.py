"""Streamed OpenAI answers: chunks of every choice, interleaved as their tokens arrive."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from radixlm.runtime.entrypoints.http.common import ServerState, Ticket, drained_error, error_event
from radixlm.runtime.entrypoints.openai import harmony, reasoning
from radixlm.runtime.entrypoints.openai.answers import (
    answer_usage,
    finish_reason,
    token_entries,
    with_final_info,
)
from radixlm.runtime.entrypoints.openai.chat import chat_logprobs, harmony_pieces, tool_pieces
from radixlm.runtime.entrypoints.openai.completions import completion_logprobs
from radixlm.runtime.entrypoints.openai.plan import Plan
from radixlm.runtime.entrypoints.openai.protocol import now
from radixlm.runtime.entrypoints.openai.tool_call_stream import ToolCallStreamer
from radixlm.runtime.request import ReqOutput


async def stream_events(ticket: Ticket, plan: Plan, started: list[tuple[int, Any, Any]]) -> AsyncIterator[dict[str, Any]]:
    """OpenAI chunks, choices interleaved as their tokens arrive; a failure ends with an error event."""
    state = ticket.state
    kind = "chat.completion.chunk" if plan.chat else "text_completion"
    created = now()

    def chunk(choices: list[dict[str, Any]], usage: dict | None = None) -> dict[str, Any]:
        body = {"id": plan.id, "object": kind, "created": created, "model": plan.model, "choices": choices}
        if plan.include_usage:
            body["usage"] = usage
        return body

    sent = {idx: 0 for idx, _, _ in started}
    sent_lp = {idx: 0 for idx, _, _ in started}
    thought_sent = {idx: "" for idx, _, _ in started}  # reasoning_content streamed so far
    tools = {idx: ToolCallStreamer(plan.tool_mode, plan.tool_name, plan.tool_format) for idx, _, _ in started} if plan.chat and plan.tool_mode and not plan.harmony else None
    channels = {idx: harmony.HarmonyStreamer() for idx, _, _ in started} if plan.harmony else None
    if plan.chat:
        first = None if plan.tool_mode in ("named", "required") else ""  # these answer with calls, not content
        yield chunk([{"index": idx, "delta": {"role": "assistant", "content": first}, "logprobs": None, "finish_reason": None} for idx, _, _ in started])
    elif plan.echo:
        yield chunk([{"index": idx, "text": plan.prompt_texts[idx // plan.n], "logprobs": None, "finish_reason": None} for idx, _, _ in started])
    pending = {asyncio.ensure_future(q.get()): (idx, q) for idx, _, q in started}
    stop = asyncio.ensure_future(state.drain_expired.wait())
    finals: list[ReqOutput] = []
    try:
        while pending:
            done, _ = await asyncio.wait({*pending, stop}, return_when=asyncio.FIRST_COMPLETED)
            if stop in done:
                yield error_event(drained_error())
                return
            for fut in done:
                idx, q = pending.pop(fut)
                out: ReqOutput = fut.result()
                if out.finished:
                    if (event := ticket.settle_stream(out)) is not None:
                        yield event
                        return
                    finals.append(out)
                else:
                    pending[asyncio.ensure_future(q.get())] = (idx, q)
                if plan.reasoning is not None:  # the reasoning goes first, apart; the rest sees the answer
                    thought, answer = reasoning.split(plan.reasoning, out.text, final=out.finished)
                    if thought and thought != thought_sent[idx] and thought.startswith(thought_sent[idx]):
                        yield chunk([{"index": idx, "delta": {"reasoning_content": thought[len(thought_sent[idx]) :]}, "logprobs": None, "finish_reason": None}])
                        thought_sent[idx] = thought
                    out = dataclasses.replace(out, text=answer)
                if channels:
                    pieces = harmony_pieces(plan, idx, out, channels[idx])
                    if plan.logprobs is not None and (logprobs := _new_logprobs(plan, idx, out, sent_lp))["content"]:
                        pieces = pieces or [{"index": idx, "delta": {}, "logprobs": None, "finish_reason": None}]
                        pieces[-1]["logprobs"] = logprobs  # the new tokens' (markers included), on the output's last chunk
                else:
                    pieces = tool_pieces(plan, idx, out, tools[idx]) if tools else [_stream_piece(state, plan, idx, out, sent, sent_lp)]
                pieces = [p for p in pieces if p is not None]
                for i, piece in enumerate(pieces):
                    yield chunk([with_final_info(plan, out, piece) if i == len(pieces) - 1 else piece])
    finally:
        stop.cancel()
        for fut in pending:
            fut.cancel()
    if plan.include_usage:
        yield {"id": plan.id, "object": kind, "created": created, "model": plan.model, "choices": [], "usage": answer_usage(plan, finals)}


def _new_logprobs(plan: Plan, idx: int, out: ReqOutput, sent_lp: dict) -> dict[str, Any]:
    """The ``logprobs`` object of choice ``idx``'s output tokens not sent yet (and mark them sent)."""
    entries, tops = token_entries(out, False)
    # entries[0] is output token ``first``: 0 when outputs carry cumulative entries, the
    # number already sent when a streamed output carries only the new ones
    first = getattr(out, "output_logprob_offset", 0)
    skip = max(sent_lp[idx] - first, 0)
    new = ReqOutput(out.rid, "", [], {"output_token_logprobs": entries[skip:], "output_top_logprobs": tops[skip:]}, False)
    sent_lp[idx] = first + len(entries)
    return chat_logprobs(new) if plan.chat else completion_logprobs(Plan(**{**plan.__dict__, "echo": False}), new)


def _stream_piece(state: ServerState, plan: Plan, idx: int, out: ReqOutput, sent: dict, sent_lp: dict) -> dict[str, Any] | None:
    """The chunk choice for a new output of choice ``idx`` (None when there is nothing to send)."""
    delta_text = out.text[sent[idx] :]
    sent[idx] = len(out.text)
    logprobs = _new_logprobs(plan, idx, out, sent_lp) if plan.logprobs is not None else None
    if not plan.chat:
        if not delta_text and not out.finished:
            return None
        return {"index": idx, "text": delta_text, "logprobs": logprobs, "finish_reason": finish_reason(plan, out, False) if out.finished else None}
    if not delta_text and not out.finished:
        return None
    return {"index": idx, "delta": {"content": delta_text} if delta_text else {}, "logprobs": logprobs, "finish_reason": finish_reason(plan, out, False) if out.finished else None}

