"""A streamed Messages answer, in Anthropic's event sequence::

    message_start, ping,
    (content_block_start, content_block_delta*, content_block_stop)*   blocks 0, 1, ... in order
    message_delta (stop_reason, stop_sequence, usage), message_stop

each as ``event: <type>`` and ``data: {"type": <type>, ...}``. ``message_start`` waits for the
first output, so its usage already holds the prompt's cache-read tokens. Blocks: ``thinking``
(``thinking_delta`` pieces, then an empty ``signature_delta``), ``text`` (``text_delta``) and
``tool_use`` (``input_json_delta`` pieces: raw slices of the arguments the grammar made, from the
chat route's tool call streamer). A failure ends the stream with an ``error`` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from radixlm.runtime.entrypoints.anthropic.answers import (
    message_id,
    split,
    stop_reason,
    tool_use_id,
    usage,
)
from radixlm.runtime.entrypoints.anthropic.errors import anthropic_error
from radixlm.runtime.entrypoints.anthropic.plan import MessagesPlan
from radixlm.runtime.entrypoints.http.common import (
    EventStream,
    Ticket,
    drained_error,
    failure,
    next_output,
)
from radixlm.runtime.entrypoints.openai import reasoning
from radixlm.runtime.entrypoints.openai.chat import is_cut
from radixlm.runtime.entrypoints.openai.harmony import HarmonyStreamer
from radixlm.runtime.entrypoints.openai.tool_call_stream import ToolCallStreamer

_LINE_BREAKS = {c: f"\\u{c:04x}" for c in (0x0B, 0x0C, 0x1C, 0x1D, 0x1E, 0x85, 0x2028, 0x2029)}  # as http.common.sse_line


def sse_event(event: dict[str, Any]) -> str:
    """One server-sent event named by its ``type``."""
    data = json.dumps(event, ensure_ascii=False).translate(_LINE_BREAKS)
    return f"event: {event['type']}\ndata: {data}\n\n"


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async for event in events:
        yield sse_event(event)


class MessageStream(EventStream):
    """The text/event-stream of Anthropic's events (no ``[DONE]``); ``on_close`` runs once however
    it ends (done, or the client gone: its request is aborted and its KV freed)."""

    def __init__(self, events: AsyncIterator[dict[str, Any]], on_close: Callable[[], None]) -> None:
        self._events, self._on_close = events, on_close
        StreamingResponse.__init__(self, _sse(events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _Blocks:
    """The content blocks opened so far: events to open, extend and close them in order."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.calls: dict[int, int] = {}  # the streamer's call index -> block index

    def open(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.index += 1
        self.kind = kind
        return [*events, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def close(self) -> list[dict[str, Any]]:
        if self.kind is None:
            return []
        events = [self.delta({"type": "signature_delta", "signature": ""})] if self.kind == "thinking" else []
        self.kind = None
        return [*events, {"type": "content_block_stop", "index": self.index}]

    def delta(self, delta: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index if index is None else index, "delta": delta}

    def thinking(self, piece: str) -> list[dict[str, Any]]:
        events = self.open("thinking", {"type": "thinking", "thinking": "", "signature": ""}) if self.kind != "thinking" else []
        return [*events, self.delta({"type": "thinking_delta", "thinking": piece})] if piece else events

    def text(self, piece: str) -> list[dict[str, Any]]:
        events = self.open("text", {"type": "text", "text": ""}) if self.kind != "text" else []
        return [*events, self.delta({"type": "text_delta", "text": piece})]

    def chat_delta(self, d: dict[str, Any]) -> list[dict[str, Any]]:
        """Events for one of the chat tool call streamer's deltas (content, a call opening, arguments)."""
        if d.get("content"):
            return self.text(d["content"])
        events = []
        for entry in d.get("tool_calls", []):
            fn = entry.get("function", {})
            if "id" in entry:
                events += self.open("tool_use", {"type": "tool_use", "id": tool_use_id(entry["id"]), "name": fn["name"], "input": {}})
                self.calls[entry["index"]] = self.index
            if fn.get("arguments"):
                events.append(self.delta({"type": "input_json_delta", "partial_json": fn["arguments"]}, self.calls[entry["index"]]))
        return events


async def message_events(ticket: Ticket, mplan: MessagesPlan, queue: Any) -> AsyncIterator[dict[str, Any]]:
    """Anthropic's events for the one request of ``mplan``; a failure ends with an error event."""
    state, plan = ticket.state, mplan.plan
    blocks = _Blocks()
    streamer = ToolCallStreamer(plan.tool_mode, plan.tool_name, plan.tool_format) if plan.tool_mode and not plan.harmony else None
    channels = HarmonyStreamer() if plan.harmony else None
    started = False
    thought_sent, text_sent = "", 0
    while True:
        out = await next_output(state, queue)
        if out is None:
            err = drained_error()
            yield anthropic_error(err.status, err.message)
            return
        if not started:
            started = True
            yield {"type": "message_start", "message": {"id": message_id(), "type": "message", "role": "assistant", "model": mplan.model, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(mplan, out, 0)}}
            yield {"type": "ping"}
        if out.finished and ticket.settle_stream(out) is not None:
            err = failure([out])
            yield anthropic_error(err.status, err.message)
            return
        answer = out.text
        if plan.reasoning is not None:
            thought, answer = reasoning.split(plan.reasoning, out.text, final=out.finished)
            if thought and thought != thought_sent and thought.startswith(thought_sent):
                for event in blocks.thinking("" if mplan.omit_thinking else thought[len(thought_sent) :]):
                    yield event
                thought_sent = thought
        events: list[dict[str, Any]] = []
        if channels is not None:
            for d in channels.feed(out.text, final=out.finished, cut=is_cut(out)):
                events += blocks.thinking("" if mplan.omit_thinking else d["reasoning_content"]) if "reasoning_content" in d else blocks.chat_delta(d)
        elif streamer is not None:
            if out.finished:
                _, content, calls = split(mplan, out)
                deltas = streamer.finish(answer, content, calls)
            else:
                deltas = streamer.feed(answer)
            for d in deltas:
                events += blocks.chat_delta(d)
        elif len(answer) > text_sent:
            events += blocks.text(answer[text_sent:])
            text_sent = len(answer)
        for event in events:
            yield event
        if out.finished:
            for event in blocks.close():
                yield event
            _, _, calls = split(mplan, out)
            reason, sequence = stop_reason(mplan, out, bool(calls))
            yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage(mplan, out)}
            yield {"type": "message_stop"}
            return
