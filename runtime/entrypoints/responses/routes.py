"""OpenAI's Responses API: ``POST /v1/responses`` (blocking and streamed), ``GET`` and ``DELETE
/v1/responses/{id}``, over the chat route's planning and the response store.

The tenant of a call is its ``cache_salt`` (the body's, else the ``X-Cache-Salt`` header, the only
way ``GET`` and ``DELETE`` can name one): stored responses, like cached KV, are the tenant's own.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from radixlm.runtime.entrypoints.http.body import off_loop, parse_json, request_schema
from radixlm.runtime.entrypoints.http.common import ServerState, Ticket, wait_final
from radixlm.runtime.entrypoints.http.errors import APIError, validation_error
from radixlm.runtime.entrypoints.http.guard import CACHE_SALT_HEADER
from radixlm.runtime.entrypoints.openai.answers import answer_usage
from radixlm.runtime.entrypoints.openai.chat import chat_choice
from radixlm.runtime.entrypoints.openai.routes import start_plan
from radixlm.runtime.entrypoints.openai.streaming import stream_events
from radixlm.runtime.entrypoints.responses.answer import (
    output_items,
    reasoning_tokens,
    response_body,
    response_usage,
)
from radixlm.runtime.entrypoints.responses.plan import (
    ResponsePlan,
    plan_response,
    responses_error,
)
from radixlm.runtime.entrypoints.responses.protocol import ITEM_TYPES, ResponsesRequest
from radixlm.runtime.entrypoints.responses.store import ResponseStore
from radixlm.runtime.entrypoints.responses.streaming import ResponsesEventStream, response_events


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Register the Responses routes on ``app``, with a store bounded as the environment says."""
    store = ResponseStore.from_env()

    @app.post("/v1/responses", openapi_extra=request_schema(ResponsesRequest))
    async def create_response(request: Request) -> Response:
        raw = await request.body()
        body = await off_loop(_parse, len(raw), raw)
        tenant = _tenant(request, body.cache_salt)
        previous = None
        if body.previous_response_id is not None:
            previous = store.get(tenant, body.previous_response_id)
            if previous is None:
                raise APIError(404, f"previous_response_id: no stored response {body.previous_response_id!r}", param="previous_response_id")
        rp = await asyncio.to_thread(plan_response, state, body, previous, tenant)
        return await _run(state, store, request, rp)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> dict[str, Any]:
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise APIError(400, "stream: a stored response cannot be streamed again", param="stream")
        entry = store.get(_tenant(request, None), response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.body

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(request: Request, response_id: str, after: str | None = None, limit: int = 20, order: str = "desc") -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit: must be between 1 and 100, got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order: must be 'asc' or 'desc', got {order!r}", param="order")
        entry = store.get(_tenant(request, None), response_id)
        if entry is None:
            raise _not_found(response_id)
        items = entry.items if order == "asc" else entry.items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"after: no input item {after!r} in response {response_id!r}", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
        if not store.delete(_tenant(request, None), response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response {response_id!r}", param="response_id")


def _tenant(request: Request, salt: str | None) -> str | None:
    """The caller's tenant: the body's ``cache_salt``, else the ``X-Cache-Salt`` header."""
    header = request.headers.get(CACHE_SALT_HEADER) or None
    if salt is not None and header is not None and salt != header:
        raise APIError(400, f"cache_salt differs from the {CACHE_SALT_HEADER} header: send one tenant", param="cache_salt")
    return salt if salt is not None else header


def _parse(raw: bytes) -> ResponsesRequest:
    """The body validated; an error names the field as the client wrote it (``input.1.call_id``),
    without pydantic's names for the union's members."""
    value = parse_json(raw)
    if not isinstance(value, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return ResponsesRequest.model_validate(value)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        for err in errors:
            err["loc"] = _field_path(list(err.get("loc", ())))
        errors.sort(key=lambda err: -len(err["loc"]))  # of a union's members, the one that got furthest
        raise validation_error(errors) from None


def _field_path(loc: list) -> tuple:
    """A pydantic error location without its names for union members (``str``, ``list[...]``,
    a model's class name, an item's ``type`` tag)."""
    return tuple(p for i, p in enumerate(loc) if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "bool") or p[:1].isupper() or (p in ITEM_TYPES and i and isinstance(loc[i - 1], int)))))


async def _run(state: ServerState, store: ResponseStore, request: Request, rp: ResponsePlan) -> Response:
    """Run a planned response: the JSON answer, or the event stream; store it when asked."""
    body = rp.request

    def keep(answer: dict[str, Any]) -> None:
        if body.store:
            store.put(rp.tenant, answer["id"], answer, rp.items)

    ticket = Ticket(state, 1, [], "input")
    handed_off = False
    created = time.time()
    try:
        try:
            started = await start_plan(ticket, rp.plan)
            if body.stream:
                response = ResponsesEventStream(response_events(rp, stream_events(ticket, rp.plan, started), keep, state.engine), ticket.close)
                handed_off = True
                return response
            outs = await wait_final(ticket, request)
        except APIError as err:
            raise responses_error(err, rp.plan.tool_mode is None and body.text is not None and body.text.format is not None) from None
    finally:
        if not handed_off:
            ticket.close()
    choice = chat_choice(rp.plan, 0, outs[0])
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    output = output_items(choice["message"], choice["finish_reason"])
    answer = response_body(rp, created, status, output, response_usage(answer_usage(rp.plan, outs), reasoning_tokens(state.engine, output)))
    keep(answer)
    return JSONResponse(answer)
