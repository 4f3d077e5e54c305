"""Request bodies: JSON parsed whatever the Content-Type, checked (nesting, lone surrogates,
non-finite numbers) without recursion, validated against a pydantic model, off the event loop
when large; and the OpenAPI declaration of a body the route parses itself."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from radixlm.runtime.entrypoints.http.errors import APIError, validation_error

MAX_BODY_BYTES = 16 << 20
MAX_JSON_DEPTH = 128  # deeper bodies are refused before anything recurses over them
THREAD_PARSE_BYTES = 64 << 10  # bodies above this are parsed off the event loop
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_json(value: Any) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH, lone surrogates and non-finite numbers,
    naming the field (iteratively: this never recurses)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            m = _SURROGATE.search(item)
            if m:
                name = path or "body"
                raise APIError(400, f"{name}: contains a lone surrogate ({ascii(m.group())}), which is not valid Unicode text", param=path or None)
        elif isinstance(item, float):
            if not math.isfinite(item):
                name = path or "body"
                raise APIError(400, f"{name}: must be a finite number, got {item}", param=path or None)
        elif isinstance(item, dict | list):
            if depth >= MAX_JSON_DEPTH:
                raise APIError(400, f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels", param=path.split(".")[0] or None)
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for k, v in pairs:
                if isinstance(k, str) and _SURROGATE.search(k):
                    raise APIError(400, f"{path or 'body'}: a key contains a lone surrogate, which is not valid Unicode text", param=path or None)
                stack.append((v, f"{path}.{k}" if path else str(k), depth + 1))


def parse_json(raw: bytes) -> Any:
    """Decode and check a JSON body (any Content-Type); APIError 400 when it is not acceptable."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # includes UnicodeDecodeError
        raise APIError(400, f"malformed JSON body: {exc}") from None
    check_json(value)
    return value


def parse_model(raw: bytes, model: type[BaseModel]) -> Any:
    """``parse_json`` then validate against ``model`` (a 400 naming the field)."""
    value = parse_json(raw)
    if not isinstance(value, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None


async def off_loop(fn: Callable[..., Any], size: int, *args: Any) -> Any:
    """Run ``fn(*args)`` here when ``size`` is small, else in a worker thread."""
    if size > THREAD_PARSE_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def json_object(request: Request) -> dict[str, Any]:
    """The request's JSON body; an empty object when it is JSON but not an object (fields then fail
    their own checks); a 400 when it is not JSON."""
    raw = await request.body()
    body = await off_loop(parse_json, len(raw), raw)
    return body if isinstance(body, dict) else {}


async def read_model(request: Request, model: type[BaseModel]) -> Any:
    """The request body validated as ``model``, parsed off the event loop when it is large."""
    raw = await request.body()
    return await off_loop(parse_model, len(raw), raw, model)


def request_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model`` as the JSON request body (its $defs inlined)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}
