"""Anthropic's error shape on ``/v1/messages*``: ``{"type": "error", "error": {"type", "message"}}``.

The app's handlers and its guard answer every failure with the OpenAI shape; ``AnthropicErrors``,
an ASGI middleware outside them all, rewrites those answers on this API's paths only (the 401 of
a missing key, 413, 404 and 405, validation errors alike), and answers an unexpected exception
with a 500 in this shape (Starlette's catch-all runs outside every middleware). Other routes keep
their shape.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

PREFIX = "/v1/messages"
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    return _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """The error body."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def from_openai(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """The Anthropic body of an OpenAI-shaped error body (``error_body``): its ``param``, which
    Anthropic's shape lacks, leads the message when the message does not name it already."""
    message, param = str(body.get("message", "error")), body.get("param")
    if isinstance(param, str) and param and not message.startswith(param):
        message = f"{param}: {message}"
    return anthropic_error(status, message)


def _on_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


class AnthropicErrors:
    """Rewrites JSON error answers (status >= 400) on ``/v1/messages*`` into Anthropic's shape."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not _on_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] | None = None
        chunks: list[bytes] = []
        started = False

        async def rewrite(message: dict[str, Any]) -> None:
            nonlocal start, started
            if message["type"] == "http.response.start":
                started = True
                content_type = next((v for k, v in message.get("headers", ()) if k.lower() == b"content-type"), b"")
                if message["status"] >= 400 and content_type.startswith(b"application/json"):
                    start = message  # held until the whole (small) body is here
                    return
                await send(message)
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            try:
                value = json.loads(body)
                if isinstance(value, dict) and value.get("object") == "error":
                    body = json.dumps(from_openai(start["status"], value), ensure_ascii=False).encode()
            except ValueError:
                pass
            headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        try:
            await self.app(scope, receive, rewrite)
        except Exception as exc:  # what the app's catch-all would answer, outside this middleware
            if started:
                raise
            logger.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            body = json.dumps(anthropic_error(500, f"internal error: {type(exc).__name__}: {exc}")).encode()
            await send({"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
