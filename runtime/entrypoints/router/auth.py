"""The router's gate, a pure ASGI middleware (so routes still see a client go away): the Host
allow-list and the cross-site refusals of the servers behind it (``http_origin``), and the key.

A client may present the API key or the admin key; the router forwards the client's own
Authorization to the workers, so what only the admin may do (``/flush_cache``, aborting another
tenant's request) is still decided by each worker.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from radixlm.runtime.entrypoints.http.errors import error_body
from radixlm.runtime.entrypoints.http.origin import OriginPolicy

_OPEN_PATHS = ("/health",)


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    value = next((v for k, v in scope.get("headers", ()) if k.lower() == name), None)
    return None if value is None else value.decode("latin-1")


async def _refuse(send: Any, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class RequireKey:
    """Refuse a foreign Host (403), a cross-site or non-JSON state-changing request (403/415) and,
    when keys are set, every request but /health without one of ``keys`` (401)."""

    def __init__(self, app: Any, keys: tuple[str, ...] = (), origins: OriginPolicy | None = None) -> None:
        self.app, self.keys, self.origins = app, tuple(k for k in keys if k), origins or OriginPolicy()

    def _has_key(self, scope: dict[str, Any]) -> bool:
        """Whether the Bearer header (or, without one, Anthropic's ``x-api-key``) holds a key."""
        bearer = _header(scope, b"authorization")
        if bearer is not None:
            given, expected = bearer.encode("latin-1"), [f"Bearer {k}".encode() for k in self.keys]
        else:
            given, expected = (_header(scope, b"x-api-key") or "").encode("latin-1"), [k.encode() for k in self.keys]
        return any(hmac.compare_digest(given, e) for e in expected)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = _header(scope, b"host")
        refused = self.origins.check_host(host)
        if refused is not None:
            return await _refuse(send, 403, refused)
        if self.keys and scope.get("path") not in _OPEN_PATHS:
            if not self._has_key(scope):
                return await _refuse(send, 401, "invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)")
        length = _header(scope, b"content-length")
        announced = (length is not None and length.isdigit() and int(length) > 0) or _header(scope, b"transfer-encoding") is not None
        unsafe = self.origins.check_unsafe(scope.get("method", "GET"), _header(scope, b"content-type"), _header(scope, b"origin"), host, scope.get("scheme", "http"), has_body=announced)
        if unsafe is not None:
            return await _refuse(send, *unsafe)
        return await self.app(scope, receive, send)
