"""The HTTP front's gate, a pure ASGI middleware: API key, shutting-down 503 and the body limit.

It is pure ASGI (not Starlette's ``BaseHTTPMiddleware``) so the routes still see the client go
away (``request.is_disconnected()``). The body is read here, counting as it arrives, and refused
with 413 as soon as it passes the limit, with or without a Content-Length (chunked bodies).
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from radixlm.runtime.http_body import MAX_BODY_BYTES
from radixlm.runtime.http_common import ServerState
from radixlm.runtime.http_errors import error_body

_OPEN_PATHS = ("/health",)


async def _answer(send: Any, status: int, message: str, extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra_headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _header(scope: dict[str, Any], name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class Guard:
    """Checks every HTTP request before the app sees it; buffers its body within MAX_BODY_BYTES."""

    def __init__(self, app: Any, state: ServerState, max_body: int = MAX_BODY_BYTES) -> None:
        self.app, self.state, self.max_body = app, state, max_body

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, state = scope.get("path", ""), self.state
        if state.api_key and path not in _OPEN_PATHS:
            given = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, f"Bearer {state.api_key}".encode()):
                await _answer(send, 401, "missing or invalid API key (send 'Authorization: Bearer <key>')", [(b"www-authenticate", b"Bearer")])
                return
        if state.shutting_down and path not in _OPEN_PATHS:
            await _answer(send, 503, "the server is shutting down")
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await _answer(send, 413, f"request body over {self.max_body} bytes")
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await _answer(send, 413, f"request body over {self.max_body} bytes")
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        del chunks
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed, body
            if not replayed:
                replayed = True
                message, body = {"type": "http.request", "body": body, "more_body": False}, b""
                return message
            return await receive()  # after the body: http.disconnect when the client goes

        await self.app(scope, replay, send)
