"""Anthropic's Messages API: ``POST /v1/messages`` (blocking and streamed) and
``POST /v1/messages/count_tokens``, over the chat route's planning and the engine.

The key comes as ``x-api-key`` (Anthropic's clients) or ``Authorization: Bearer`` (the guard
takes both); the ``anthropic-version`` and ``anthropic-beta`` headers are accepted and unused.
Errors on these paths are in Anthropic's shape (``errors.AnthropicErrors``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixlm.runtime.entrypoints.anthropic import answers
from radixlm.runtime.entrypoints.anthropic.errors import AnthropicErrors
from radixlm.runtime.entrypoints.anthropic.plan import MessagesPlan, plan_messages, renamed
from radixlm.runtime.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    parse_request,
)
from radixlm.runtime.entrypoints.anthropic.streaming import MessageStream, message_events
from radixlm.runtime.entrypoints.http.body import off_loop, request_schema
from radixlm.runtime.entrypoints.http.common import ServerState, Ticket, wait_final
from radixlm.runtime.entrypoints.http.errors import APIError
from radixlm.runtime.entrypoints.openai.routes import start_plan


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Register the Messages routes on ``app``, and the middleware that shapes their errors."""
    app.add_middleware(AnthropicErrors)

    @app.post("/v1/messages", openapi_extra=request_schema(MessagesRequest))
    async def messages(request: Request) -> Response:
        body = await _read(request, MessagesRequest)
        return await _run(state, request, await asyncio.to_thread(plan_messages, state, body))

    @app.post("/v1/messages/count_tokens", openapi_extra=request_schema(CountTokensRequest))
    async def count_tokens(request: Request) -> Response:
        body = await _read(request, CountTokensRequest)
        plan = await asyncio.to_thread(plan_messages, state, body)
        return JSONResponse({"input_tokens": len(plan.plan.prompts[0])})


async def _read(request: Request, model: type) -> Any:
    """The body validated as ``model`` (parsed off the event loop when large)."""
    raw = await request.body()
    return await off_loop(parse_request, len(raw), raw, model)


async def _run(state: ServerState, request: Request, mplan: MessagesPlan) -> Response:
    """Run the plan's one request: the message once it is done, or its event stream."""
    plan = mplan.plan
    ticket = Ticket(state, 1, [], "messages", plan.cache_salt)
    handed_off = False
    try:
        try:
            started = await start_plan(ticket, plan)
        except APIError as err:
            raise renamed(err) from None
        if plan.stream:
            response = MessageStream(message_events(ticket, mplan, started[0][2]), ticket.close)
            handed_off = True
            return response
        outs = await wait_final(ticket, request)
    finally:
        if not handed_off:
            ticket.close()
    return JSONResponse(answers.message(mplan, outs[0]))
