"""What every forwarding path shares: waiting on a worker while watching the client, headers
passed each way, the streamed response that closes its upstream however it ends, SSE errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from radixlm.runtime.entrypoints.http.errors import error_body

T = TypeVar("T")
POLL_SECONDS = 0.25  # how often a waiting handler checks that its client is still there
CLIENT_GONE = 499  # nginx's status for a client that closed the connection (never delivered)

_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-authorization", "proxy-connection", "accept-encoding", "trailer"}
_HOP_BACK = {"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"}


class ClientGone(Exception):
    """The client disconnected while the router waited on a worker."""


def _abandoned(task: asyncio.Future) -> None:
    if task.cancelled() or task.exception() is not None:
        return  # (the exception counts as read: no "never retrieved" warning)
    result = task.result()
    if isinstance(result, httpx.Response):  # it came as the router gave up on it: close it
        asyncio.ensure_future(aclose_quietly(result))


def cancel(task: asyncio.Future | None) -> None:
    """Give up on a task whose result will not be used: cancel it if it runs, close the worker
    response it may have produced, read its exception."""
    if task is None:
        return
    if not task.done():
        task.cancel()
    task.add_done_callback(_abandoned)


async def until_disconnect(aw: Coroutine[Any, Any, T] | asyncio.Future[T], request: Request) -> T:
    """Await ``aw``; if the client goes first, give it up and raise ClientGone."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_SECONDS)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    except BaseException:
        cancel(task)
        raise


async def first_done(tasks: set[asyncio.Future], request: Request) -> None:
    """Wait until one of ``tasks`` is done; raise ClientGone if the client goes first."""
    while True:
        done, _ = await asyncio.wait(tasks, timeout=POLL_SECONDS, return_when=asyncio.FIRST_COMPLETED)
        if done:
            return
        if await request.is_disconnected():
            raise ClientGone


def request_headers(request: Request) -> dict[str, str]:
    """The client's headers worth passing to a worker (no hop-by-hop ones, no compression)."""
    return {k: v for k, v in request.headers.items() if k.lower() not in _HOP}


def response_headers(resp: httpx.Response) -> dict[str, str]:
    """A worker's response headers worth passing back."""
    return {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_BACK}


def passthrough(resp: httpx.Response, content: bytes) -> Response:
    """The worker's answer, unchanged: status, headers, body."""
    return Response(content, status_code=resp.status_code, headers=response_headers(resp))


def is_sse(resp: httpx.Response) -> bool:
    """Whether ``resp`` is a server-sent event stream."""
    return resp.headers.get("content-type", "").startswith("text/event-stream")


def sse_error(status: int, message: str, needs_break: bool) -> bytes:
    """The events that end a stream that broke: an error event, then ``[DONE]``."""
    event = json.dumps({"error": error_body(status, message)}, ensure_ascii=False)
    return (b"\n\n" if needs_break else b"") + f"data: {event}\n\ndata: [DONE]\n\n".encode()


async def read_raw(resp: httpx.Response) -> bytes:
    """The whole body as the worker sent it (still encoded, like the headers passed back say)."""
    return b"".join([chunk async for chunk in resp.aiter_raw()])


async def next_chunk(chunks: AsyncIterator[bytes]) -> bytes | None:
    """The next chunk of ``chunks``, None at its end."""
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


async def aclose_quietly(resp: httpx.Response | None) -> None:
    """Close a worker's response (and so its connection, when unread), whatever happens."""
    if resp is None:
        return
    with anyio.CancelScope(shield=True):
        try:
            await resp.aclose()
        except Exception:
            pass


class ProxyStream(StreamingResponse):
    """A streamed response whose ``on_close`` runs exactly once however it ends (done, client
    gone, never sent), shielded from the cancellation that ends it, so the upstream closes."""

    def __init__(self, body: AsyncIterator[bytes], status_code: int, headers: dict[str, str], on_close: Callable[[], Awaitable[None]]) -> None:
        self._on_close = on_close
        super().__init__(body, status_code=status_code, headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self.body_iterator.aclose()  # type: ignore[attr-defined]
                except Exception:
                    pass
                await self._on_close()
