"""Streamed Responses: the chat route's chunks (``openai.streaming.stream_events``: reasoning,
content and tool-call deltas) retold as Responses events, each with its ``sequence_number``::

    response.created, response.in_progress
    response.output_item.added            (reasoning, message or function_call)
      response.content_part.added         (reasoning_text / output_text)
      response.reasoning_text.delta | response.output_text.delta | response.function_call_arguments.delta ...
      response.reasoning_text.done | response.output_text.done | response.function_call_arguments.done
      response.content_part.done
    response.output_item.done
    ...
    response.completed (or response.incomplete when max_output_tokens cut it)

A failure inside the server ends the stream with an ``error`` event. Events go out as OpenAI
sends them, ``event: TYPE`` then ``data: JSON``, with no ``[DONE]``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from radixlm.runtime.engine import Engine
from radixlm.runtime.entrypoints.http.common import EventStream, sse_line
from radixlm.runtime.entrypoints.responses.answer import (
    call_item,
    message_item,
    output_text,
    reasoning_item,
    reasoning_tokens,
    response_body,
    response_usage,
)
from radixlm.runtime.entrypoints.responses.plan import ResponsePlan, new_item_id


class _Events:
    """Responses events from chat deltas, and the output items they add up to."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: str | None = None  # "reasoning", "message", "function_call"
        self.text = ""  # of the open item (its text, or its arguments)
        self.calls: dict[int, int] = {}  # a chat call index -> its output index

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """One event, numbered."""
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def _opening(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[dict[str, Any]]:
        self.items.append(item)
        self.open, self.text = item["type"], ""
        out = [self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]
        if part is not None:
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1, content_index=0, part=part))
        return out

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """Close the open item (``status``: how it ended)."""
        if self.open is None:
            return []
        index, item, text = len(self.items) - 1, self.items[-1], self.text
        where = {"item_id": item["id"], "output_index": index}
        if self.open == "function_call":
            item.update(arguments=text, status=status)
            out = [self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=text)]
        elif self.open == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item.update(content=[part], status=status)
            out = [self.event("response.reasoning_text.done", **where, content_index=0, text=text), self.event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            part = output_text(text)
            item.update(content=[part], status=status)
            out = [self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]), self.event("response.content_part.done", **where, content_index=0, part=part)]
        self.open = None
        return [*out, self.event("response.output_item.done", output_index=index, item=dict(item))]

    def opening_message(self) -> list[dict[str, Any]]:
        """Open an assistant message item (its text comes in deltas)."""
        return self._opening({**message_item("", "in_progress"), "content": []}, output_text(""))

    def delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta."""
        out: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            if self.open != "reasoning":
                out += self.close() + self._opening({**reasoning_item("", "in_progress"), "content": []}, {"type": "reasoning_text", "text": ""})
            out.append(self._piece("response.reasoning_text.delta", delta["reasoning_content"], content_index=0))
        if delta.get("content"):
            if self.open != "message":
                out += self.close() + self.opening_message()
            out.append(self._piece("response.output_text.delta", delta["content"], content_index=0, logprobs=[]))
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                out += self.close() + self._opening(call_item(call["id"], call["function"]["name"], "", "in_progress", new_item_id("fc")), None)
                self.calls[call["index"]] = len(self.items) - 1
            piece = call["function"].get("arguments")
            if piece:
                out.append(self._piece("response.function_call_arguments.delta", piece))
        return out

    def _piece(self, kind: str, piece: str, **fields: Any) -> dict[str, Any]:
        self.text += piece
        return self.event(kind, item_id=self.items[-1]["id"], output_index=len(self.items) - 1, delta=piece, **fields)


async def response_events(rp: ResponsePlan, chunks: AsyncIterator[dict[str, Any]], on_done: Callable[[dict[str, Any]], None], engine: Engine) -> AsyncIterator[dict[str, Any]]:
    """Responses events from the chat route's chunks; ``on_done`` gets the finished response
    (to store it), never a failed one."""
    ev = _Events()
    created = time.time()
    start = response_body(rp, created, "in_progress", [], None)
    yield ev.event("response.created", response=start)
    yield ev.event("response.in_progress", response=start)
    finish = None
    async for chunk in chunks:
        if "error" in chunk:
            err = chunk["error"]
            yield ev.event("error", code=str(err.get("code")), message=err.get("message"), param=err.get("param"))
            return
        for choice in chunk.get("choices") or []:
            for event in ev.delta(choice.get("delta") or {}):
                yield event
            finish = choice.get("finish_reason") or finish
        if not chunk.get("choices") and chunk.get("usage") is not None:  # the last chunk
            status = "incomplete" if finish == "length" else "completed"
            for event in ev.close(status):
                yield event
            if not ev.items:  # nothing at all was generated: an empty message, as the blocking answer has
                for event in ev.opening_message() + ev.close(status):
                    yield event
            body = response_body(rp, created, status, ev.items, response_usage(chunk["usage"], reasoning_tokens(engine, ev.items)))
            on_done(body)
            yield ev.event(f"response.{status}", response=body)


async def _frames(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async for event in events:
        yield f"event: {event['type']}\n" + sse_line(event)


class ResponsesEventStream(EventStream):
    """An ``EventStream`` framed as OpenAI frames Responses events (``event:`` lines, no ``[DONE]``)."""

    def __init__(self, events: AsyncIterator[dict[str, Any]], on_close: Callable[[], None]) -> None:
        super().__init__(events, on_close)
        self.body_iterator = _frames(events)
