"""The router's API key check: a pure ASGI middleware (so routes still see a client go away)."""

from __future__ import annotations

import hmac
import json
from typing import Any

from radixlm.runtime.http_errors import error_body

_OPEN_PATHS = ("/health",)


class RequireKey:
    """Refuse (401) every request but /health without ``Authorization: Bearer <key>``."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in _OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), b"")
        if hmac.compare_digest(given, f"Bearer {self.key}".encode()):
            return await self.app(scope, receive, send)
        body = json.dumps(error_body(401, "invalid or missing API key (Authorization: Bearer KEY)")).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
