"""``/v1/embeddings``, ``/v1/rerank`` and ``/v1/score``: pooling requests through the engine's
scheduler and radix cache (docs/embeddings.md). Each text or (query, document) pair is one
request; a ``Ticket`` holds their admission and aborts them if the client leaves or one fails."""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from radixlm.runtime.engine import EngineError
from radixlm.runtime.engine.pooling import normalize_to, split_inputs
from radixlm.runtime.entrypoints.http.body import read_model, request_schema
from radixlm.runtime.entrypoints.http.common import ServerState, Ticket, wait_final
from radixlm.runtime.entrypoints.http.errors import APIError
from radixlm.runtime.entrypoints.http.guard import CACHE_SALT_HEADER
from radixlm.runtime.entrypoints.pooling.protocol import (
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from radixlm.runtime.request import Req, ReqOutput


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Register the pooling routes on ``app``."""

    @app.post("/v1/embeddings", openapi_extra=request_schema(EmbeddingRequest))
    async def embeddings(request: Request) -> JSONResponse:
        body = await read_model(request, EmbeddingRequest)
        return await _embeddings(state, request, body)

    @app.post("/v1/rerank", openapi_extra=request_schema(RerankRequest))
    async def rerank(request: Request) -> JSONResponse:
        body = await read_model(request, RerankRequest)
        docs = [d if isinstance(d, str) else d.text for d in body.documents]
        outs = await _score_pairs(state, request, body.cache_salt, [(body.query, d) for d in docs], body.instruction, "documents", {"query": "query", "documents": "documents", "instruction": "instruction"})
        ranked = sorted(range(len(docs)), key=lambda i: -outs[i].pooled[0])
        if body.top_n:
            ranked = ranked[: body.top_n]
        results = [{"index": i, "relevance_score": outs[i].pooled[0], **({"document": {"text": docs[i]}} if body.return_documents else {})} for i in ranked]
        tokens = _prompt_tokens(outs)
        return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": body.model or state.model_name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results})

    @app.post("/v1/score", openapi_extra=request_schema(ScoreRequest))
    async def score(request: Request) -> JSONResponse:
        body = await read_model(request, ScoreRequest)
        firsts = body.text_1 if isinstance(body.text_1, list) else [body.text_1]
        seconds = body.text_2 if isinstance(body.text_2, list) else [body.text_2]
        if len(firsts) != 1 and len(firsts) != len(seconds):
            raise APIError(400, f"text_1: give one text, or one per text_2 ({len(seconds)}); got {len(firsts)}", param="text_1")
        pairs = [(firsts[0] if len(firsts) == 1 else firsts[i], t) for i, t in enumerate(seconds)]
        outs = await _score_pairs(state, request, body.cache_salt, pairs, body.instruction, "text_2", {"query": "text_1", "documents": "text_2", "instruction": "instruction"})
        data = [{"index": i, "object": "score", "score": out.pooled[0]} for i, out in enumerate(outs)]
        tokens = _prompt_tokens(outs)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
        return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": body.model or state.model_name, "data": data, "usage": usage})


def _tenant(request: Request, salt: str | None) -> str | None:
    """The caller's tenant: the body's ``cache_salt``, else the x-cache-salt header (400 when both differ)."""
    header = request.headers.get(CACHE_SALT_HEADER) or None
    if salt is not None and header is not None and salt != header:
        raise APIError(400, f"cache_salt differs from the {CACHE_SALT_HEADER} header: send one tenant", param="cache_salt")
    return salt if salt is not None else header


async def _start(ticket: Ticket, build: Callable[[Callable[[ReqOutput], None]], Req], param: str, names: dict[str, str]) -> None:
    """Queue one pooling request under ``ticket``; a bad value is a 400 naming the field (the
    engine's name for it mapped through ``names``, else ``param``)."""
    try:
        pair = await ticket.state.engine.start_pooling(build)
    except EngineError as exc:
        raise APIError(503, str(exc)) from None
    except ValueError as exc:
        message = str(exc)
        for theirs, ours in names.items():
            if message.startswith(theirs + " "):
                raise APIError(400, ours + message[len(theirs) :], param=ours) from None
        raise APIError(400, message if message.startswith(param) else f"{param}: {message}", param=param) from None
    ticket.started.append(pair)


async def _run(state: ServerState, request: Request, builders: list[Callable], param: str, salt: str | None, names: dict[str, str] | None = None) -> list[ReqOutput]:
    """Start every request and wait for all of them (aborting the rest on any failure or disconnect)."""
    ticket = Ticket(state, len(builders), [], param, salt)
    try:
        for build in builders:
            await _start(ticket, build, param, names or {})
        outs = await wait_final(ticket, request)
    finally:
        ticket.close()
    for out in outs:
        if out.pooled is None:  # cannot happen after a success; never answer a vector of nothing
            raise APIError(500, "a pooling request ended without its answer")
    return outs


async def _embeddings(state: ServerState, request: Request, body: EmbeddingRequest) -> JSONResponse:
    engine = state.engine
    try:
        engine.pooling_config.check_dimensions(body.dimensions)
        _, items = split_inputs(body.input)
    except ValueError as exc:
        param = "dimensions" if str(exc).startswith("dimensions") else "input"
        raise APIError(400, str(exc), param=param) from None
    salt = _tenant(request, body.cache_salt)
    state.check_fits(len(items), "input")
    builders = [lambda sink, item=item: engine.embedding_request(sink, item, cache_salt=salt) for item in items]
    outs = await _run(state, request, builders, "input", salt)
    data = [{"object": "embedding", "index": i, "embedding": _encode(normalize_to(out.pooled, body.dimensions), body.encoding_format)} for i, out in enumerate(outs)]
    tokens = _prompt_tokens(outs)
    return JSONResponse({"object": "list", "data": data, "model": body.model or state.model_name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def _score_pairs(state: ServerState, request: Request, salt: str | None, pairs: list[tuple[str, str]], instruction: str | None, param: str, names: dict[str, str]) -> list[ReqOutput]:
    """Score each (query, document) pair; a model without single "yes"/"no" tokens is a 400."""
    engine = state.engine
    try:
        engine.score_ids  # noqa: B018 (checked before anything is queued)
    except ValueError as exc:
        raise APIError(400, str(exc), param="model") from None
    salt = _tenant(request, salt)
    state.check_fits(len(pairs), param)
    builders = [lambda sink, q=q, d=d: engine.score_request(sink, q, d, instruction, cache_salt=salt) for q, d in pairs]
    return await _run(state, request, builders, param, salt, names)


def _prompt_tokens(outs: list[ReqOutput]) -> int:
    return sum(int(out.meta_info.get("prompt_tokens", 0)) for out in outs)


def _encode(vec: list[float], encoding_format: str) -> list[float] | str:
    """The embedding as floats, or base64 of its little-endian float32 bytes (as the openai SDK decodes it)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
    return vec

