"""Forwarding one generation request to the worker the policy chooses.

Until a byte has reached the client, a failed attempt (no connection, a 5xx, a stream that
breaks before its first chunk) goes to another healthy worker, at most ``max_retries`` times.
After that the stream is passed through chunk by chunk; if it breaks, it ends with an SSE error
event and ``[DONE]``. A client that goes away closes the upstream, so the worker aborts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from radixlm.runtime.entrypoints.http.errors import error_response
from radixlm.runtime.entrypoints.router.state import RouterState
from radixlm.runtime.entrypoints.router.text_key import routing_text
from radixlm.runtime.entrypoints.router.upstream import (
    CLIENT_GONE,
    ClientGone,
    ProxyStream,
    aclose_quietly,
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

logger = logging.getLogger(__name__)


@dataclass
class Failed:
    """An attempt that failed before any byte reached the client: the worker's answer, if any."""

    reason: str
    response: Response | None = None


async def forward(state: RouterState, request: Request, path: str, raw: bytes, body: dict[str, Any]) -> Response:
    """Send the request to a chosen healthy worker, retrying elsewhere before the first byte."""
    text = routing_text(path, body)
    stream = body.get("stream") is True
    headers = request_headers(request)
    tried: set[str] = set()
    last: Failed | None = None
    for attempt in range(state.config.max_retries + 1):
        candidates = [w for w in state.registry.healthy() if w.url not in tried]
        if not candidates:
            break
        worker = state.policy.choose(text, candidates)
        tried.add(worker.url)
        if attempt:
            state.metrics.retries.inc()
            logger.info("retrying on %s: %s", worker.url, last.reason if last else "")
        result = await _attempt(state, request, worker, path, raw, headers, stream)
        if not isinstance(result, Failed):
            return result
        last = result
    if last is None:
        return error_response(503, "no healthy worker to take the request")
    return last.response or error_response(503, f"no worker could take the request: {last.reason}")


async def _attempt(state: RouterState, request: Request, worker: Worker, path: str, raw: bytes, headers: dict[str, str], stream: bool) -> Response | Failed:
    """One try on ``worker``: its answer, a committed stream, or Failed (nothing sent yet)."""
    state.started(worker)
    resp: httpx.Response | None = None
    committed = False
    try:
        req = state.client.build_request("POST", worker.url + path, content=raw, headers=headers)
        resp = await until_disconnect(state.client.send(req, stream=True), request)
        if resp.status_code >= 500 or not stream or resp.status_code >= 300:
            content = await until_disconnect(read_raw(resp), request)
            if resp.status_code >= 500:
                reason = f"{worker.url} answered {resp.status_code}"
                state.failed(worker, reason, unhealthy=resp.status_code == 503)
                return Failed(reason, passthrough(resp, content))
            return passthrough(resp, content)
        chunks = resp.aiter_raw()
        first = await until_disconnect(next_chunk(chunks), request)
        committed = True
        return ProxyStream(_relay(state, worker, resp, first, chunks), resp.status_code, response_headers(resp), _closer(state, worker, resp))
    except ClientGone:
        return Response(status_code=CLIENT_GONE)
    except httpx.HTTPError as exc:
        reason = f"{worker.url}: {type(exc).__name__}: {exc}"
        state.failed(worker, reason, unhealthy=True)
        return Failed(reason)
    finally:
        if not committed:
            await aclose_quietly(resp)
            state.finished(worker)


async def _relay(state: RouterState, worker: Worker, resp: httpx.Response, first: bytes | None, chunks: Any):
    """The worker's stream, chunk by chunk; a break ends it with an SSE error event."""
    chunk = first
    tail = b"\n\n"
    try:
        while chunk is not None:
            if chunk:
                tail = (tail + chunk)[-2:]
                yield chunk
            chunk = await next_chunk(chunks)
    except httpx.HTTPError as exc:
        reason = f"the worker {worker.url} failed mid-stream: {type(exc).__name__}: {exc}"
        state.failed(worker, reason, unhealthy=True)
        logger.warning("%s", reason)
        if is_sse(resp):
            yield sse_error(502, reason, needs_break=tail != b"\n\n")


def _closer(state: RouterState, worker: Worker, resp: httpx.Response):
    """Close the upstream and count the request finished, once."""
    done = False

    async def close() -> None:
        nonlocal done
        if not done:
            done = True
            await aclose_quietly(resp)
            state.finished(worker)

    return close
