"""Prefill/decode dispatch: one request to both workers at once, with a shared bootstrap room.

The prefill worker computes the prompt's KV and hands it to the decode worker, which waits for
it under the same ``bootstrap_room`` and then generates. The prefill call is never streamed:
its answer only says whether the hand-over worked. The client gets the decode worker's answer
(streamed or not, as it asked), unless the prefill fails first::

    prefill fails (non-2xx, no connection) -> close decode, the client gets prefill's error
                                              (an SSE error event if decode's stream has begun)
    decode fails                           -> cancel prefill, the client gets decode's error
    the client goes                        -> cancel both
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from radixlm.runtime.entrypoints.http.errors import error_response
from radixlm.runtime.entrypoints.router.state import RouterState
from radixlm.runtime.entrypoints.router.upstream import (
    CLIENT_GONE,
    ClientGone,
    ProxyStream,
    aclose_quietly,
    cancel,
    first_done,
    is_sse,
    next_chunk,
    passthrough,
    read_raw,
    request_headers,
    response_headers,
    sse_error,
    until_disconnect,
)
from radixlm.runtime.entrypoints.router.workers import Worker


async def _call(client: httpx.AsyncClient, url: str, raw: bytes, headers: dict[str, str]) -> tuple[httpx.Response, bytes]:
    """A non-streamed POST: the response and its raw body."""
    async with client.stream("POST", url, content=raw, headers=headers) as resp:
        return resp, await read_raw(resp)


def _prefill_error(task: asyncio.Future, worker: Worker) -> Response | None:
    """The client's answer for a finished prefill call that failed; None if it succeeded."""
    if task.exception() is not None:
        exc = task.exception()
        return error_response(502, f"the prefill worker {worker.url} failed: {type(exc).__name__}: {exc}")
    resp, content = task.result()
    return None if resp.is_success else passthrough(resp, content)


async def _until(task: asyncio.Future, prefill: asyncio.Future, prefill_w: Worker, request: Request) -> Response | None:
    """Wait for ``task`` (cancelled if the client goes: ClientGone) while watching the prefill
    call: its error response as soon as it fails, else None once ``task`` is done."""
    try:
        while True:
            if prefill.done() and (err := _prefill_error(prefill, prefill_w)) is not None:
                cancel(task)
                return err
            if task.done():
                return None
            await first_done({task} if prefill.done() else {task, prefill}, request)
    except BaseException:
        cancel(task)
        raise


def _message(resp: Response) -> str:
    """The message of an error response's OpenAI-shaped body (or its text)."""
    text = bytes(resp.body).decode("utf-8", "replace")
    try:
        body = json.loads(text)
    except ValueError:
        return text or f"status {resp.status_code}"
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        body = body["error"]
    return str(body.get("message", text)) if isinstance(body, dict) else text


async def pd_forward(state: RouterState, request: Request, path: str, body: dict[str, Any]) -> Response:
    """Dispatch to the prefill and decode workers concurrently; answer with decode's response."""
    prefill_w, decode_w = state.registry.workers
    for w in (prefill_w, decode_w):
        if not w.healthy:
            return error_response(503, f"the {'prefill' if w is prefill_w else 'decode'} worker {w.url} is unhealthy: {w.last_error}")
    body = {**body, "bootstrap_room": secrets.randbits(63)}
    stream = body.get("stream") is True
    headers = request_headers(request)
    for w in (prefill_w, decode_w):
        state.started(w)
    prefill = asyncio.ensure_future(_call(state.client, prefill_w.url + path, json.dumps({**body, "stream": False}).encode(), headers))
    decode_req = state.client.build_request("POST", decode_w.url + path, content=json.dumps(body).encode(), headers=headers)
    decode = asyncio.ensure_future(state.client.send(decode_req, stream=True))
    resp: httpx.Response | None = None
    committed = False
    try:
        if (err := await _until(decode, prefill, prefill_w, request)) is not None:
            return err  # decode's headers have not come: prefill failed first
        if decode.exception() is not None:
            exc = decode.exception()
            state.failed(decode_w, f"{type(exc).__name__}: {exc}", unhealthy=isinstance(exc, httpx.TransportError))
            return error_response(502, f"the decode worker {decode_w.url} failed: {type(exc).__name__}: {exc}")
        resp = decode.result()
        if not resp.is_success:
            return passthrough(resp, await until_disconnect(read_raw(resp), request))
        if not stream:
            reading = asyncio.ensure_future(read_raw(resp))
            if (err := await _until(reading, prefill, prefill_w, request)) is not None:
                return err
            content = reading.result()
            if (err := await _until(prefill, prefill, prefill_w, request)) is not None:
                return err  # decode answered, but the prefill call ended with an error
            return passthrough(resp, content)
        chunks = resp.aiter_raw()
        first = asyncio.ensure_future(next_chunk(chunks))
        if (err := await _until(first, prefill, prefill_w, request)) is not None:
            return err  # nothing reached the client yet: prefill's error is its answer
        committed = True
        return ProxyStream(_relay(resp, first.result(), chunks, prefill, prefill_w), resp.status_code, response_headers(resp), _closer(state, resp, prefill))
    except ClientGone:
        return Response(status_code=CLIENT_GONE)
    except httpx.HTTPError as exc:
        state.failed(decode_w, f"{type(exc).__name__}: {exc}", unhealthy=True)
        return error_response(502, f"the decode worker {decode_w.url} failed: {type(exc).__name__}: {exc}")
    finally:
        if not committed:
            cancel(prefill)
            if resp is None:
                cancel(decode)  # (a response it brought is closed)
            await aclose_quietly(resp)
            for w in (prefill_w, decode_w):
                state.finished(w)


async def _relay(resp: httpx.Response, first: bytes | None, chunks: Any, prefill: asyncio.Future, prefill_w: Worker):
    """Decode's stream; while prefill runs, each chunk races it, and its failure ends the stream."""
    chunk, tail = first, b"\n\n"
    try:
        while chunk is not None:
            if chunk:
                tail = (tail + chunk)[-2:]
                yield chunk
            if prefill.done():
                chunk = await next_chunk(chunks)
                continue
            nxt = asyncio.ensure_future(next_chunk(chunks))
            try:
                # asyncio.wait, never ``await nxt``: an awaiting task passes each cancellation on to
                # the read, and a second one cuts short httpcore's close: decode would run on
                await asyncio.wait({nxt, prefill}, return_when=asyncio.FIRST_COMPLETED)
                err = _prefill_error(prefill, prefill_w) if prefill.done() else None
                if err is None:
                    await asyncio.wait({nxt})
            finally:
                if not nxt.done():
                    cancel(nxt)  # once: the read's own close of the connection then completes
            if err is not None:
                yield sse_error(err.status_code, f"the prefill worker failed: {_message(err)}", needs_break=tail != b"\n\n")
                return
            chunk = nxt.result()
    except httpx.HTTPError as exc:
        if is_sse(resp):
            yield sse_error(502, f"the decode worker failed mid-stream: {type(exc).__name__}: {exc}", needs_break=tail != b"\n\n")


def _closer(state: RouterState, resp: httpx.Response, prefill: asyncio.Future):
    """Cancel prefill (if still running), close decode's stream, count both finished; once."""
    done = False

    async def close() -> None:
        nonlocal done
        if not done:
            done = True
            cancel(prefill)
            await aclose_quietly(resp)
            for w in state.registry.workers:
                state.finished(w)

    return close
