"""The HTTP front's gate, a pure ASGI middleware: API key, shutting-down 503 and the body limit.

The API key comes in the ``Authorization: Bearer`` header; a browser, which cannot send that
header when it opens a page, opens ``/dashboard?key=<key>`` once and gets an HttpOnly cookie
valid for the dashboard's routes only.

It is pure ASGI (not Starlette's ``BaseHTTPMiddleware``) so the routes still see the client go
away (``request.is_disconnected()``). The body is read here, counting as it arrives, and refused
with 413 as soon as it passes the limit, with or without a Content-Length (chunked bodies).
"""

from __future__ import annotations

import hmac
import json
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qs

from radixlm.runtime.http_body import MAX_BODY_BYTES
from radixlm.runtime.http_common import ServerState
from radixlm.runtime.http_errors import error_body

_OPEN_PATHS = ("/health",)
_DASHBOARD = "/dashboard"
KEY_COOKIE = "radixlm_api_key"  # set by GET /dashboard?key=<API key>, so a browser can open the dashboard


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


def _is_dashboard(path: str) -> bool:
    return path == _DASHBOARD or path.startswith(_DASHBOARD + "/")


def _authorized(scope: dict[str, Any], key: str) -> bool:
    """The Bearer header carries the key; on the dashboard's routes its cookie may instead."""
    given = _header(scope, b"authorization") or b""
    if hmac.compare_digest(given, f"Bearer {key}".encode()):
        return True
    if not _is_dashboard(scope.get("path", "")):
        return False
    cookies = SimpleCookie()
    try:
        cookies.load((_header(scope, b"cookie") or b"").decode("latin-1"))
    except CookieError:
        return False
    morsel = cookies.get(KEY_COOKIE)
    return morsel is not None and hmac.compare_digest(morsel.value.encode("utf-8", "replace"), key.encode())


async def _dashboard_login(scope: dict[str, Any], send: Any, key: str) -> bool:
    """``GET /dashboard?key=K`` with the right key: set the cookie and redirect to the bare page."""
    if scope.get("path") != _DASHBOARD or scope.get("method") != "GET":
        return False
    given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key")
    if not given:
        return False
    if not hmac.compare_digest(given[0].encode("utf-8", "replace"), key.encode()):
        await _answer(send, 401, "invalid API key in ?key=")
        return True
    cookie = f"{KEY_COOKIE}={key}; Path={_DASHBOARD}; HttpOnly; SameSite=Strict"
    headers = [(b"location", _DASHBOARD.encode()), (b"set-cookie", cookie.encode()), (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 303, "headers": headers})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    return True


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
            if await _dashboard_login(scope, send, state.api_key):
                return
            if not _authorized(scope, state.api_key):
                hint = " or open /dashboard?key=<key> once" if _is_dashboard(path) else ""
                await _answer(send, 401, f"missing or invalid API key (send 'Authorization: Bearer <key>'{hint})", [(b"www-authenticate", b"Bearer")])
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
