"""OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` (blocking and streamed):
the routes, and running a planned request through the engine."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixlm.runtime.entrypoints.http.beams import run_beams
from radixlm.runtime.entrypoints.http.body import read_model, request_schema
from radixlm.runtime.entrypoints.http.common import ServerState, Ticket, stream_response, wait_final
from radixlm.runtime.entrypoints.http.errors import APIError
from radixlm.runtime.entrypoints.http.lora_routes import lora_of_model
from radixlm.runtime.entrypoints.openai.answers import answer_usage
from radixlm.runtime.entrypoints.openai.chat import chat_choice, plan_chat
from radixlm.runtime.entrypoints.openai.completions import completion_choice, plan_completion
from radixlm.runtime.entrypoints.openai.plan import Plan
from radixlm.runtime.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    now,
)
from radixlm.runtime.entrypoints.openai.streaming import stream_events


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Register the OpenAI routes on ``app``."""

    @app.post("/v1/completions", openapi_extra=request_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = await read_model(request, CompletionRequest)
        return await _run(state, request, await asyncio.to_thread(plan_completion, state, body))

    @app.post("/v1/chat/completions", openapi_extra=request_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        body = await read_model(request, ChatCompletionRequest)
        return await _run(state, request, await asyncio.to_thread(plan_chat, state, body))


async def start_plan(ticket: Ticket, plan: Plan) -> list[tuple[int, Any, Any]]:
    """Queue ``n`` requests per prompt; returns (choice index, req, queue) triples."""
    started: list[tuple[int, Any, Any]] = []
    for p_i, ids in enumerate(plan.prompts):
        for k in range(plan.n):
            sp = dict(plan.sampling)
            if "seed" in sp and plan.n > 1:
                sp["seed"] = sp["seed"] + k
            try:
                req, q = await ticket.start(
                    "messages" if plan.chat else "prompt",
                    input_ids=ids,
                    sampling_params=sp,
                    return_logprob=plan.logprobs is not None,
                    top_logprobs_num=plan.logprobs or 0,
                    logprob_start_len=0 if (plan.echo and plan.logprobs is not None) else -1,
                    return_text_in_logprobs=plan.logprobs is not None,
                    stream=plan.stream,
                    **({"cache_salt": plan.cache_salt} if plan.cache_salt is not None else {}),
                    return_cache_info=plan.return_cache_info,
                    prompt_cache_key=plan.prompt_cache_key,
                    retention=plan.retention,
                    prediction=plan.prediction,
                    bootstrap_room=plan.bootstrap_room,
                    priority=plan.priority,
                    lora=lora_of_model(ticket.state, plan.model),
                )
            except APIError as err:
                raise _field_error(err, plan) from None
            started.append((p_i * plan.n + k, req, q))
    return started


_GRAMMAR_ERROR = re.compile(r"^(?:\w+: )?invalid (?:ebnf|json_schema): (?:at \d+\(\d+\): )?(?:failed to compile JSON schema: )?(.*)$", re.S)
_GRAMMAR_LINES = re.compile(r"\n\s*\d+ \|.*", re.S)  # the compiler's echo of our internal grammar


def _tool_error(err: APIError) -> APIError:
    """A grammar error of a tool call constraint, said of ``tools`` (what the client sent),
    without the internal grammar the tools were compiled into."""
    m = _GRAMMAR_ERROR.match(err.message)
    if m is None and not err.message.startswith(("json_schema: ", "ebnf: ")):
        return err
    detail = m.group(1) if m is not None else err.message.split(": ", 1)[1]
    detail = _GRAMMAR_LINES.sub("", detail).strip()
    return APIError(err.status, f"tools: a function's parameters are not a usable JSON schema: {detail}", param="tools", code=err.code)


def _field_error(err: APIError, plan: Plan) -> APIError:
    """Rename engine-side fields to the OpenAI request's (json_schema -> tools, ...)."""
    if plan.tool_mode and err.param in ("json_schema", "ebnf", "messages"):
        return _tool_error(err)
    elif err.param == "json_schema" and plan.chat:
        err.param = "response_format"
    elif err.param == "max_new_tokens":
        err.param = "max_tokens"
    return err


async def _run(state: ServerState, request: Request, plan: Plan) -> Response:
    """Run a planned request: the JSON answer once every choice is done, or the event stream."""
    if plan.beam:
        return await _run_beams(state, request, plan)
    total = len(plan.prompts) * plan.n
    ticket = Ticket(state, total, [], "n" if plan.n > 1 or len(plan.prompts) == 1 else "prompt")
    handed_off = False
    try:
        started = await start_plan(ticket, plan)
        if plan.stream:
            response = stream_response(stream_events(ticket, plan, started), ticket.close)
            handed_off = True
            return response
        outs = await wait_final(ticket, request)
    finally:
        if not handed_off:
            ticket.close()
    shape = chat_choice if plan.chat else completion_choice
    choices = [shape(plan, idx, out) for (idx, _, _), out in zip(started, outs)]
    body = {"id": plan.id, "object": "chat.completion" if plan.chat else "text_completion", "created": now(), "model": plan.model, "choices": choices, "usage": answer_usage(plan, outs)}
    return JSONResponse(body)


async def _run_beams(state: ServerState, request: Request, plan: Plan) -> Response:
    """A completion with ``use_beam_search``: each prompt's ``n`` best beams as its choices."""
    lora = lora_of_model(state, plan.model)
    calls = [
        dict(
            input_ids=ids,
            sampling_params=plan.sampling,
            **({"cache_salt": plan.cache_salt} if plan.cache_salt is not None else {}),
            prompt_cache_key=plan.prompt_cache_key,
            priority=plan.priority,
            lora=lora,
        )
        for ids in plan.prompts
    ]
    try:
        hyps = await run_beams(state, request, calls, "prompt")
    except APIError as err:
        raise _field_error(err, plan) from None
    outs = [out for prompt_hyps in hyps for out in prompt_hyps]
    choices = [completion_choice(plan, i, out) for i, out in enumerate(outs)]
    body = {"id": plan.id, "object": "text_completion", "created": now(), "model": plan.model, "choices": choices, "usage": answer_usage(plan, outs)}
    return JSONResponse(body)
