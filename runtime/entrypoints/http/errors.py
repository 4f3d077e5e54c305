"""OpenAI-shaped HTTP errors: ``{"object": "error", "message", "type", "param", "code"}``, and the
mapping from validation failures to a 400 that names the field."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixlm.runtime.entrypoints.openai.protocol import ErrorResponse
from radixlm.runtime.sampling_params import accepted_keys

_FIELD = re.compile(r"^([a-z_]+)\b")
_KNOWN_FIELDS = accepted_keys() | {
    "prompt", "text", "input_ids", "messages", "top_logprobs_num", "logprob_start_len", "return_logprob", "rid", "n",
    "max_tokens", "max_completion_tokens", "cache_salt", "tools", "tool_choice", "response_format", "logit_bias", "best_of", "suffix",
}
_KINDS = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError", 429: "RateLimitError", 503: "ServiceUnavailableError"}


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


def field_of(message: str) -> str | None:
    """The request field a message starts with (``"stop_regex ..."`` -> ``stop_regex``), if known."""
    m = _FIELD.match(message)
    return m.group(1) if m and m.group(1) in _KNOWN_FIELDS else None


def bad_request(exc: Exception, default_param: str | None = None) -> APIError:
    """A 400 for an error found while validating, naming the field when the message starts with one."""
    message = str(exc) or type(exc).__name__
    param = field_of(message) or default_param
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


def add_fallback_handlers(app: FastAPI, logger: logging.Logger) -> None:
    """Unknown routes, wrong methods and unexpected errors answer with the OpenAI error shape."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
