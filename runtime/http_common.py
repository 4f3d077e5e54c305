"""What every HTTP route shares: OpenAI-shaped errors, admission, JSON bodies, waiting and SSE.

Every failure is an OpenAI-shaped body ``{"object": "error", "message", "type", "param", "code"}``.
A handler reserves room with a ``Ticket`` (admission slots, the client's rids, the requests it
starts); closing the ticket gives everything back and aborts only what this handler started and
has not finished, so a failure anywhere between admission and the response never leaks a slot.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from radixlm.runtime.engine import Engine, EngineError
from radixlm.runtime.metrics import ServerMetrics
from radixlm.runtime.protocol import ErrorResponse
from radixlm.runtime.request import ReqOutput
from radixlm.runtime.sampling_params import SamplingParams

MAX_BODY_BYTES = 16 << 20
MAX_JSON_DEPTH = 128  # deeper bodies are refused before anything recurses over them
THREAD_PARSE_BYTES = 64 << 10  # bodies above this are parsed off the event loop
_FIELD = re.compile(r"^([a-z_]+)\b")
_SURROGATE = re.compile("[\ud800-\udfff]")
_KNOWN_FIELDS = {f for f in SamplingParams.__dataclass_fields__} | {
    "prompt", "text", "input_ids", "messages", "top_logprobs_num", "logprob_start_len", "return_logprob", "rid", "n",
    "max_tokens", "max_completion_tokens", "tools", "tool_choice", "response_format", "logit_bias", "best_of", "suffix",
}
_KINDS = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError", 429: "RateLimitError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error to answer with its status and an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: int | str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code if code is not None else status


def error_body(status: int, message: str, param: str | None = None, code: int | str | None = None) -> dict[str, Any]:
    """The JSON error body."""
    kind = _KINDS.get(status, "BadRequestError" if 400 <= status < 500 else "InternalServerError")
    return ErrorResponse(message=message, type=kind, param=param, code=code if code is not None else status).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: int | str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSONResponse carrying ``error_body``."""
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def bad_request(exc: Exception, default_param: str | None = None) -> APIError:
    """A 400 for an error found while validating, naming the field when the message starts with one."""
    message = str(exc) or type(exc).__name__
    m = _FIELD.match(message)
    param = m.group(1) if m and m.group(1) in _KNOWN_FIELDS else default_param
    if param is not None and param == default_param and not message.startswith(param):
        message = f"{param}: {message}"
    return APIError(400, message, param=param)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """A 400 from pydantic's error list (the first error, naming its field)."""
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
    if err.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', msg)}")
    if param is None:
        if err.get("type") in ("model_attributes_type", "model_type", "dict_type", "missing"):
            return APIError(400, "the request body must be a JSON object")
        return APIError(400, msg)
    return APIError(400, f"{param}: {msg}", param=param)


# ------------------------------------------------------------------ bodies
def check_json(value: Any) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH, lone surrogates and non-finite numbers,
    naming the field (iteratively: this never recurses)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            m = _SURROGATE.search(item)
            if m:
                name = path or "body"
                raise APIError(400, f"{name}: contains a lone surrogate ({ascii(m.group())}), which is not valid Unicode text", param=path or None)
        elif isinstance(item, float):
            if not math.isfinite(item):
                name = path or "body"
                raise APIError(400, f"{name}: must be a finite number, got {item}", param=path or None)
        elif isinstance(item, dict | list):
            if depth >= MAX_JSON_DEPTH:
                raise APIError(400, f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels", param=path.split(".")[0] or None)
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for k, v in pairs:
                if isinstance(k, str) and _SURROGATE.search(k):
                    raise APIError(400, f"{path or 'body'}: a key contains a lone surrogate, which is not valid Unicode text", param=path or None)
                stack.append((v, f"{path}.{k}" if path else str(k), depth + 1))


def parse_json(raw: bytes) -> Any:
    """Decode and check a JSON body (any Content-Type); APIError 400 when it is not acceptable."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # includes UnicodeDecodeError
        raise APIError(400, f"malformed JSON body: {exc}") from None
    check_json(value)
    return value


def parse_model(raw: bytes, model: type[BaseModel]) -> Any:
    """``parse_json`` then validate against ``model`` (a 400 naming the field)."""
    value = parse_json(raw)
    if not isinstance(value, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None


async def off_loop(fn: Callable[..., Any], size: int, *args: Any) -> Any:
    """Run ``fn(*args)`` here when ``size`` is small, else in a worker thread."""
    if size > THREAD_PARSE_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def json_object(request: Request) -> dict[str, Any]:
    """The request's JSON body; an empty object when it is JSON but not an object (fields then fail
    their own checks); a 400 when it is not JSON."""
    raw = await request.body()
    body = await off_loop(parse_json, len(raw), raw)
    return body if isinstance(body, dict) else {}


async def read_model(request: Request, model: type[BaseModel]) -> Any:
    """The request body validated as ``model``, parsed off the event loop when it is large."""
    raw = await request.body()
    return await off_loop(parse_model, len(raw), raw, model)


def request_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model`` as the JSON request body (its $defs inlined)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


# ---------------------------------------------------------------- admission
@dataclass
class ServerState:
    """What the routes share: the engine, metrics and admission bookkeeping."""

    engine: Engine
    metrics: ServerMetrics
    model_name: str
    api_key: str | None
    max_in_flight: int
    in_flight: int = 0
    shutting_down: bool = False
    rids: set[str] = field(default_factory=set)  # client-given rids of requests in flight
    drain_expired: asyncio.Event = field(default_factory=asyncio.Event)

    def admit(self, count: int = 1, param: str = "n") -> None:
        """Reserve room for ``count`` requests or raise 400 (never fits), 429 (full) or 503."""
        if self.shutting_down:
            raise APIError(503, "the server is shutting down")
        if not self.engine.is_alive():
            raise APIError(503, "the engine is not running")
        if count > self.max_in_flight:
            raise APIError(400, f"{param}: this asks for {count} generations; the server runs at most {self.max_in_flight} at once", param=param)
        if self.in_flight + count > self.max_in_flight:
            raise APIError(429, f"too many requests in flight ({self.in_flight}); retry later")
        self.in_flight += count

    def release(self, count: int = 1) -> None:
        """Give back what ``admit`` reserved."""
        self.in_flight -= count


class Ticket:
    """One handler's reservation: admission slots, its client-given rids and the requests it started."""

    def __init__(self, state: ServerState, count: int, rids: list[str], param: str) -> None:
        state.admit(count, param)
        self.state, self.count = state, count
        self.started: list[tuple[Any, asyncio.Queue]] = []
        self.finished: set[str] = set()
        self.rids: list[str] = []
        self._closed = False
        try:
            taken = set()
            for rid in rids:
                if rid in state.rids or rid in taken:
                    raise APIError(400, f"rid {rid!r} is already in flight", param="rid")
                taken.add(rid)
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
        except Exception as exc:  # a bad value found late (the tokenizer, a grammar compiler)
            raise bad_request(exc, default_param) from None
        self.started.append(pair)
        return pair

    def mark_finished(self, out: ReqOutput) -> None:
        """Record a final output (its request needs no abort)."""
        self.finished.add(out.rid)

    def close(self) -> None:
        """Abort what this handler started and did not see finish; release its slots and rids."""
        if self._closed:
            return
        self._closed = True
        for req, _ in self.started:
            if req.rid not in self.finished:
                self.state.engine.abort_nowait(req.rid)
        self.state.release(self.count)
        self.state.rids.difference_update(self.rids)


def failure(outs: list[ReqOutput]) -> APIError | None:
    """The error of the first output that failed inside the server (finish_reason with a status)."""
    for out in outs:
        fr = out.meta_info.get("finish_reason") or {}
        status = fr.get("status")
        if status:
            return APIError(int(status), fr.get("message") or "the request failed")
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
                raise asyncio.CancelledError
    finally:
        if not waiter.done():
            waiter.cancel()
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


async def sse(events: AsyncIterator[dict[str, Any] | str]) -> AsyncIterator[str]:
    """Server-sent events: ``data: {json}`` lines then ``data: [DONE]``."""
    async for event in events:
        yield f"data: {event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)}\n\n"
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
