"""What the generating routes share: admission, waiting for outputs, and server-sent events.

A handler reserves room with a ``Ticket`` (admission slots, the client's rids, the requests it
starts); closing the ticket gives everything back and aborts only what this handler started and
has not finished, so a failure anywhere between admission and the response never leaks a slot.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from radixlm.runtime.constrained.compiler import GrammarBusy
from radixlm.runtime.engine import Engine, EngineError
from radixlm.runtime.entrypoints.dashboard.token import DashboardTokens
from radixlm.runtime.entrypoints.http.errors import APIError, bad_request, error_body, field_of
from radixlm.runtime.entrypoints.http.metrics import ServerMetrics
from radixlm.runtime.entrypoints.http.origin import OriginPolicy
from radixlm.runtime.request import ReqOutput


@dataclass
class ServerState:
    """What the routes share: the engine, metrics and admission bookkeeping."""

    engine: Engine
    metrics: ServerMetrics
    model_name: str
    api_key: str | None
    max_in_flight: int
    admin_key: str | None = None
    origins: OriginPolicy = field(default_factory=OriginPolicy)
    tokens: DashboardTokens = field(default_factory=DashboardTokens)
    in_flight: int = 0
    shutting_down: bool = False
    rids: set[tuple[str | None, str]] = field(default_factory=set)  # (cache_salt, client-given rid) in flight
    drain_expired: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def open_server(self) -> bool:
        """True when the server has no key at all (every caller may do everything but read others' text)."""
        return self.api_key is None and self.admin_key is None

    def check_fits(self, count: int, param: str = "n") -> None:
        """Raise 400 when ``count`` generations could never be admitted at once: checked before
        anything is built for them (``n`` = 2**63 must cost nothing)."""
        if count > self.max_in_flight:
            raise APIError(400, f"{param}: this asks for {count} generations; the server runs at most {self.max_in_flight} at once", param=param)

    def admit(self, count: int = 1, param: str = "n") -> None:
        """Reserve room for ``count`` requests or raise 400 (never fits), 429 (full) or 503."""
        if self.shutting_down:
            raise APIError(503, "the server is shutting down")
        if not self.engine.is_alive():
            raise APIError(503, "the engine is not running")
        self.check_fits(count, param)
        if self.in_flight + count > self.max_in_flight:
            raise APIError(429, f"too many requests in flight ({self.in_flight}); retry later")
        self.in_flight += count

    def release(self, count: int = 1) -> None:
        """Give back what ``admit`` reserved."""
        self.in_flight -= count


class Ticket:
    """One handler's reservation: admission slots, its client-given rids and the requests it started."""

    def __init__(self, state: ServerState, count: int, rids: list[str], param: str, cache_salt: str | None = None) -> None:
        state.admit(count, param)
        self.state, self.count = state, count
        self.started: list[tuple[Any, asyncio.Queue]] = []
        self.finished: set[str] = set()
        self.rids: list[tuple[str | None, str]] = []
        self._closed = False
        try:
            taken = set()
            for rid in rids:  # rids are scoped by tenant (cache_salt): another tenant cannot take yours
                if (cache_salt, rid) in state.rids or (cache_salt, rid) in taken:
                    raise APIError(400, f"rid {rid!r} is already in flight", param="rid")
                taken.add((cache_salt, rid))
        except BaseException:
            self.close()
            raise
        state.rids |= taken
        self.rids = list(taken)

    async def start(self, default_param: str, **kwargs: Any) -> tuple[Any, asyncio.Queue]:
        """Start one request; errors become 400 naming the field (503 when the engine is gone)."""
        try:
            pair = await self.state.engine.start_request(**kwargs)
        except APIError:
            raise
        except EngineError as exc:
            raise APIError(503, str(exc)) from None
        except GrammarBusy as exc:  # the spec may be fine: the compilers are full
            raise APIError(429, str(exc)) from None
        except Exception as exc:  # a bad value found late (the tokenizer, a grammar compiler)
            raise bad_request(exc, default_param) from None
        self.started.append(pair)
        return pair

    def mark_finished(self, out: ReqOutput) -> None:
        """Record a final output (its request needs no abort)."""
        self.finished.add(out.rid)

    def settle_stream(self, out: ReqOutput) -> dict[str, Any] | None:
        """Record a streamed request's final output (and its metrics); the stream's last event
        when the request failed inside the server, else None."""
        self.mark_finished(out)
        self.state.metrics.observe_finished(out.meta_info)
        err = failure([out])
        return error_event(err) if err is not None else None

    def close(self) -> None:
        """Abort what this handler started and did not see finish; release its slots and rids."""
        if self._closed:
            return
        self._closed = True
        for req, _ in self.started:
            if req.rid not in self.finished:
                self.state.engine.abort_nowait(req.rid, req.cache_salt)
        self.state.release(self.count)
        self.state.rids.difference_update(self.rids)


class ClientGone(Exception):
    """The client went away before its answer was ready (its requests are aborted; nobody reads a reply)."""


def failure(outs: list[ReqOutput]) -> APIError | None:
    """The error of the first output that failed inside the server (finish_reason with a status)."""
    for out in outs:
        fr = out.meta_info.get("finish_reason") or {}
        status = fr.get("status")
        if status:
            message = fr.get("message") or "the request failed"
            return APIError(int(status), message, param=field_of(message) if 400 <= int(status) < 500 else None)
    return None


def drained_error() -> APIError:
    """What a request still running when the drain timeout passes gets."""
    return APIError(503, "the server shut down before this request finished (drain timeout)")


async def wait_final(ticket: Ticket, request: Request) -> list[ReqOutput]:
    """Wait for every started request's final output; a client disconnect aborts them all; a
    failed request raises its APIError."""
    state = ticket.state

    async def final(q: asyncio.Queue) -> ReqOutput:
        while True:
            out = await q.get()
            if out.finished:
                ticket.mark_finished(out)
                return out

    waiter = asyncio.ensure_future(asyncio.gather(*(final(q) for _, q in ticket.started)))
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=0.25)
            if done:
                outs = waiter.result()
                for out in outs:
                    state.metrics.observe_finished(out.meta_info)
                err = failure(outs)
                if err is not None:
                    raise err
                return outs
            if state.drain_expired.is_set():
                raise drained_error()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not waiter.done():
            waiter.cancel()
            # the gather ends with the cancellation as its exception: read it, or asyncio logs
            # "exception was never retrieved" with a traceback for every client that left
            waiter.add_done_callback(lambda f: f.cancelled() or f.exception())
        ticket.close()


async def next_output(state: ServerState, q: asyncio.Queue) -> ReqOutput | None:
    """The next output on ``q``, or None once the drain timeout has passed."""
    if not q.empty():
        return q.get_nowait()
    if state.drain_expired.is_set():
        return None
    get = asyncio.ensure_future(q.get())
    stop = asyncio.ensure_future(state.drain_expired.wait())
    try:
        await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not get.done():
            get.cancel()
    return get.result() if get.done() and not get.cancelled() else None


def error_event(err: APIError) -> dict[str, Any]:
    """The final SSE event of a stream that failed."""
    return {"error": error_body(err.status, err.message, err.param, err.code)}


# Characters that str.splitlines() (and so httpx's aiter_lines) takes for line ends, although
# JSON may leave them raw: escaped, so that every SSE event stays one line for every client.
_LINE_BREAKS = {c: f"\\u{c:04x}" for c in (0x0B, 0x0C, 0x1C, 0x1D, 0x1E, 0x85, 0x2028, 0x2029)}


def sse_line(event: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: {json}`` and a blank line."""
    data = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False).translate(_LINE_BREAKS)
    return f"data: {data}\n\n"


async def sse(events: AsyncIterator[dict[str, Any] | str]) -> AsyncIterator[str]:
    """Server-sent events: ``data: {json}`` lines then ``data: [DONE]``."""
    async for event in events:
        yield sse_line(event)
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """A text/event-stream response whose ``on_close`` runs exactly once however it ends: done,
    client gone (even a reader that stalled, then reset), or never sent."""

    def __init__(self, events: AsyncIterator[dict[str, Any] | str], on_close: Callable[[], None]) -> None:
        self._events, self._on_close = events, on_close
        super().__init__(sse(events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            for gen in (self.body_iterator, self._events):
                try:
                    await gen.aclose()  # type: ignore[attr-defined]
                except Exception:  # a generator still running elsewhere ends with its task
                    pass


def stream_response(events: AsyncIterator[dict[str, Any] | str], on_close: Callable[[], None]) -> StreamingResponse:
    """A text/event-stream response over ``events``; ``on_close`` must be idempotent."""
    return EventStream(events, on_close)
