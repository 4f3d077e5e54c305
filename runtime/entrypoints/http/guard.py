"""The HTTP front's gate, a pure ASGI middleware: the Host allow-list, the API and admin keys,
cross-site refusals, the shutting-down 503 and the body limit.

Keys come in the ``Authorization: Bearer`` header (or, without one, ``x-api-key``, as Anthropic's
clients send them): the API key lets a caller use the server, the
admin key (``--admin-api-key``) also lets it see and act across tenants (``tenancy``). A browser,
which cannot send that header when it opens a page, opens ``/dashboard?key=<key>`` once and gets
an HttpOnly cookie holding a derived, expiring token valid for the dashboard's routes only
(``dashboard_token``); the key itself is never stored in the browser, and ``key=`` is masked in
the access log. Requests a web page could forge are refused before their body is parsed
(``http_origin``).

It is pure ASGI (not Starlette's ``BaseHTTPMiddleware``) so the routes still see the client go
away (``request.is_disconnected()``). The body is read here, counting as it arrives, and refused
with 413 as soon as it passes the limit, with or without a Content-Length (chunked bodies).
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qs

from radixlm.runtime.entrypoints.http.body import MAX_BODY_BYTES
from radixlm.runtime.entrypoints.http.common import ServerState
from radixlm.runtime.entrypoints.http.errors import error_body
from radixlm.runtime.entrypoints.http.tenancy import ADMIN_SCOPE_KEY

_OPEN_PATHS = ("/health",)
_DASHBOARD = "/dashboard"
TOKEN_COOKIE = "radixlm_dashboard"  # set by GET /dashboard?key=<key>: a derived token, never the key
CACHE_SALT_HEADER = "x-cache-salt"  # names the caller's tenant on routes without a body
API_KEY_HEADER = b"x-api-key"  # the key as Anthropic's clients send it (when there is no Bearer header)
_KEY_IN_QUERY = re.compile(r"([?&]key=)[^&\s\"]*")


class RedactKeyFilter(logging.Filter):
    """Masks ``key=...`` in uvicorn's access log lines (the dashboard's login link carries a key)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_KEY_IN_QUERY.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args)
        return True


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


def _text_header(scope: dict[str, Any], name: bytes) -> str | None:
    value = _header(scope, name)
    return None if value is None else value.decode("latin-1")


def _is_dashboard(path: str) -> bool:
    return path == _DASHBOARD or path.startswith(_DASHBOARD + "/")


def _matches(given: bytes | str, key: str | None) -> bool:
    if key is None:
        return False
    raw = given.encode("utf-8", "replace") if isinstance(given, str) else given
    return hmac.compare_digest(raw, key.encode())


def _bearer_level(scope: dict[str, Any], state: ServerState) -> str | None:
    """``admin`` or ``user`` for a Bearer header, or else an ``x-api-key`` header (Anthropic's
    clients send the key there), carrying a key; else None."""
    given = _header(scope, b"authorization") or b""
    token = given[len(b"Bearer ") :] if given.startswith(b"Bearer ") else _header(scope, API_KEY_HEADER)
    if token is None:
        return None
    if _matches(token, state.admin_key):
        return "admin"
    if _matches(token, state.api_key):
        return "user"
    return None


def _cookie_level(scope: dict[str, Any], state: ServerState) -> str | None:
    """The level of the dashboard token cookie, on the dashboard's routes only."""
    if not _is_dashboard(scope.get("path", "")):
        return None
    cookies = SimpleCookie()
    try:
        cookies.load(_text_header(scope, b"cookie") or "")
    except CookieError:
        return None
    morsel = cookies.get(TOKEN_COOKIE)
    return state.tokens.level(morsel.value) if morsel is not None else None


async def _dashboard_login(scope: dict[str, Any], send: Any, state: ServerState) -> bool:
    """``GET /dashboard?key=K`` with a valid key: set the token cookie and redirect to the bare page."""
    if scope.get("path") != _DASHBOARD or scope.get("method") != "GET" or state.open_server:
        return False
    given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key")
    if not given:
        return False
    level = "admin" if _matches(given[0], state.admin_key) else "user" if _matches(given[0], state.api_key) else None
    if level is None:
        await _answer(send, 401, "invalid key in ?key=")
        return True
    secure = "; Secure" if scope.get("scheme") == "https" else ""
    cookie = f"{TOKEN_COOKIE}={state.tokens.issue(level)}; Path={_DASHBOARD}; Max-Age={state.tokens.ttl_s}; HttpOnly; SameSite=Strict{secure}"
    headers = [(b"location", _DASHBOARD.encode()), (b"set-cookie", cookie.encode()), (b"content-length", b"0"), (b"cache-control", b"no-store")]
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
        host = _text_header(scope, b"host")
        refused = state.origins.check_host(host)
        if refused is not None:  # DNS rebinding: a page under another name reaching this port
            await _answer(send, 403, refused)
            return
        level = _bearer_level(scope, state) or _cookie_level(scope, state)
        if state.api_key is not None and path not in _OPEN_PATHS:
            if await _dashboard_login(scope, send, state):
                return
            if level is None:
                hint = " or open /dashboard?key=<key> once" if _is_dashboard(path) else ""
                await _answer(send, 401, f"missing or invalid API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>'{hint})", [(b"www-authenticate", b"Bearer")])
                return
        elif state.admin_key is not None and await _dashboard_login(scope, send, state):
            return
        scope.setdefault("state", {})[ADMIN_SCOPE_KEY] = level == "admin"
        if state.shutting_down and path not in _OPEN_PATHS:
            await _answer(send, 503, "the server is shutting down")
            return
        method = scope.get("method", "GET")
        content_type, origin = _text_header(scope, b"content-type"), _text_header(scope, b"origin")
        length = _header(scope, b"content-length")
        announced = (length is not None and length.isdigit() and int(length) > 0) or _header(scope, b"transfer-encoding") is not None
        unsafe = state.origins.check_unsafe(method, content_type, origin, host, scope.get("scheme", "http"), has_body=announced)
        if unsafe is not None:  # a cross-site page: refused before the body is read
            await _answer(send, *unsafe)
            return
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
        unsafe = state.origins.check_unsafe(method, content_type, origin, host, scope.get("scheme", "http"), has_body=bool(body))
        if unsafe is not None:  # a body that is not JSON: what a cross-site form or text/plain fetch sends
            await _answer(send, *unsafe)
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed, body
            if not replayed:
                replayed = True
                message, body = {"type": "http.request", "body": body, "more_body": False}, b""
                return message
            return await receive()  # after the body: http.disconnect when the client goes

        await self.app(scope, replay, send)
