"""The HTTP server: FastAPI app over one Engine, with SGLang's native routes and OpenAI's.

Every failure is an OpenAI-shaped error body ``{"object": "error", "message", "type", "param",
"code"}``: 400 for invalid input (naming the field), 401 without the API key, 413 for a huge
body, 429 when the queue is full, 503 while shutting down or when the engine loop is gone.
A client that goes away (streaming or not) has its request aborted, which frees its KV.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixlm.runtime.engine import Engine
from radixlm.runtime.metrics import ServerMetrics
from radixlm.runtime.protocol import ErrorResponse, GenerateRequest
from radixlm.runtime.request import ReqOutput
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.tokenizer import apply_chat_template

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
_FIELD = re.compile(r"^([a-z_]+)\b")
_KNOWN_FIELDS = {f for f in SamplingParams.__dataclass_fields__} | {
    "prompt", "text", "input_ids", "messages", "top_logprobs_num", "logprob_start_len", "return_logprob", "rid", "n",
    "max_tokens", "max_completion_tokens", "tools", "tool_choice", "response_format", "logit_bias", "best_of", "suffix",
}


class APIError(Exception):
    """An error to answer with its status and an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: int | str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code if code is not None else status


def error_body(status: int, message: str, param: str | None = None, code: int | str | None = None) -> dict[str, Any]:
    """The JSON error body."""
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError", 429: "RateLimitError", 503: "ServiceUnavailableError"}.get(status, "InternalServerError")
    return ErrorResponse(message=message, type=kind, param=param, code=code if code is not None else status).model_dump()


def bad_request(exc: ValueError) -> APIError:
    """A 400 for a ValueError from validation, naming the field when the message starts with one."""
    message = str(exc)
    m = _FIELD.match(message)
    param = m.group(1) if m and m.group(1) in _KNOWN_FIELDS else None
    return APIError(400, message, param=param)


@dataclass
class ServerState:
    """What the routes share: the engine, metrics and admission bookkeeping."""

    engine: Engine
    metrics: ServerMetrics
    model_name: str
    api_key: str | None
    max_in_flight: int
    in_flight: int = 0
    shutting_down: bool = False

    def admit(self, count: int = 1) -> None:
        """Reserve room for ``count`` requests or raise 429/503."""
        if self.shutting_down:
            raise APIError(503, "the server is shutting down")
        if not self.engine.is_alive():
            raise APIError(503, "the engine is not running")
        if self.in_flight + count > self.max_in_flight:
            raise APIError(429, f"too many requests in flight ({self.in_flight}); retry later")
        self.in_flight += count

    def release(self, count: int = 1) -> None:
        """Give back what ``admit`` reserved."""
        self.in_flight -= count


async def json_object(request: Request) -> dict[str, Any]:
    """The request's JSON body; an empty object when it is JSON but not an object (fields then fail
    their own checks); a 400 when it is not JSON."""
    try:
        body = await request.json()
    except ValueError:
        raise APIError(400, "malformed JSON body") from None
    return body if isinstance(body, dict) else {}


async def wait_final(state: ServerState, request: Request, started: list[tuple[Any, asyncio.Queue]]) -> list[ReqOutput]:
    """Wait for every request's final output; a client disconnect aborts them all."""

    async def final(q: asyncio.Queue) -> ReqOutput:
        while True:
            out = await q.get()
            if out.finished:
                return out

    waiter = asyncio.ensure_future(asyncio.gather(*(final(q) for _, q in started)))
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=0.25)
            if done:
                outs = waiter.result()
                for out in outs:
                    state.metrics.observe_finished(out.meta_info)
                return outs
            if await request.is_disconnected():
                raise asyncio.CancelledError
    finally:
        if not waiter.done():
            waiter.cancel()
            for req, _ in started:
                state.engine.abort_nowait(req.rid)


async def sse(events: AsyncIterator[dict[str, Any] | str], on_close: Callable[[], None]) -> AsyncIterator[str]:
    """Server-sent events: ``data: {json}`` lines then ``data: [DONE]``; ``on_close`` always runs."""
    try:
        async for event in events:
            yield f"data: {event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        on_close()


def stream_response(events: AsyncIterator[dict[str, Any] | str], on_close: Callable[[], None]) -> StreamingResponse:
    """A text/event-stream response over ``events``."""
    return StreamingResponse(sse(events, on_close), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(engine: Engine, api_key: str | None = None, max_queued_requests: int = 1024, served_model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``."""
    from radixlm.runtime import openai_api

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.shutting_down = True
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="radixlm", lifespan=lifespan)
    name = served_model_name or engine.model_path.rstrip("/").split("/")[-1]
    state = ServerState(engine, ServerMetrics(), name, api_key, max_queued_requests + engine.args.max_running_requests)
    app.state.radixlm = state

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if state.api_key and request.url.path not in ("/health", "/metrics"):
            auth = request.headers.get("authorization", "")
            if auth != f"Bearer {state.api_key}":
                return JSONResponse(error_body(401, "missing or invalid API key (send 'Authorization: Bearer <key>')"), status_code=401)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            return JSONResponse(error_body(413, f"request body over {MAX_BODY_BYTES} bytes"), status_code=413)
        if state.shutting_down and request.url.path != "/health":
            return JSONResponse(error_body(503, "the server is shutting down"), status_code=503)
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        if err.get("type") == "json_invalid":
            return JSONResponse(error_body(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}"), status_code=400)
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if param is None:
            if err.get("type") in ("model_attributes_type", "dict_type", "missing"):
                return JSONResponse(error_body(400, "the request body must be a JSON object (Content-Type: application/json)"), status_code=400)
            return JSONResponse(error_body(400, str(err.get("msg", "invalid request")).removeprefix("Value error, ")), status_code=400)
        return JSONResponse(error_body(400, f"{param}: {err.get('msg')}", param=param), status_code=400)

    # ------------------------------------------------------------ native
    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive():
            return JSONResponse(error_body(503, "the engine is not running"), status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        state.admit()
        try:
            req, q = await engine.start_request(input_ids=[0], sampling_params={"max_new_tokens": 1})
            while not (await q.get()).finished:
                pass
        finally:
            state.release()
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        cfg = engine.config
        return {"model_path": engine.model_path, "tokenizer_path": engine.args.tokenizer_path or engine.model_path, "is_generation": True, "architecture": cfg.architecture, "context_length": engine.context_len, "vocab_size": cfg.vocab_size}

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        stats = await asyncio.to_thread(engine.get_stats)
        stats["kv_invariant_holds"] = await asyncio.to_thread(engine.kv_invariant_holds)
        return {**vars(engine.args), "served_model_name": state.model_name, "stats": stats}

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        if not await asyncio.to_thread(engine.flush_cache):
            raise APIError(400, "cannot flush the cache while requests are in flight")
        return Response("cache flushed", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        body = await json_object(request)
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise APIError(400, "rid must be a string", param="rid")
        return {"rid": rid, "aborted": await asyncio.to_thread(engine.abort, rid)}

    @app.post("/apply_chat_template")
    async def chat_template(request: Request) -> dict[str, Any]:
        """Render messages with the model's chat template (the frontend language uses this)."""
        body = await json_object(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise APIError(400, "messages must be a list of {role, content} objects", param="messages")
        try:
            text = apply_chat_template(engine.tokenizer, messages, tools=body.get("tools"), add_generation_prompt=bool(body.get("add_generation_prompt", True)))
        except Exception as exc:
            raise APIError(400, f"the chat template could not render these messages: {exc}", param="messages") from None
        return {"text": text}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """SGLang's ``/tokenize``: token ids of one prompt or a list (the frontend's select uses it)."""
        body = await json_object(request)
        prompt = body.get("prompt")
        batch = isinstance(prompt, list)
        if not (isinstance(prompt, str) or (batch and all(isinstance(p, str) for p in prompt))):
            raise APIError(400, "prompt must be a string or a list of strings", param="prompt")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise APIError(400, "add_special_tokens must be a boolean", param="add_special_tokens")
        tokens = [engine.tokenize(p, add_special_tokens=special) for p in (prompt if batch else [prompt])]
        counts = [len(t) for t in tokens]
        return {"tokens": tokens if batch else tokens[0], "count": counts if batch else counts[0], "max_model_len": engine.context_len}

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await asyncio.to_thread(engine.get_stats)
        return Response(state.metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "owned_by": "radixlm", "max_model_len": engine.context_len}]}

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        return await native_generate(state, body, request)

    openai_api.add_routes(app, state)
    return app


async def native_generate(state: ServerState, body: GenerateRequest, request: Request) -> Response:
    """SGLang's ``/generate``: one prompt or a batch, blocking or streamed (cumulative text)."""
    engine = state.engine
    batch = isinstance(body.text, list) or (body.input_ids is not None and bool(body.input_ids) and isinstance(body.input_ids[0], list))
    prompts = (body.text if isinstance(body.text, list) else [body.text]) if body.text is not None else (body.input_ids if batch else [body.input_ids])
    n = len(prompts)
    if batch and n == 0:
        raise APIError(400, "text must not be an empty list", param="text")
    params = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params] * n
    rids = body.rid if isinstance(body.rid, list) else [body.rid] * n
    if len(params) != n or len(rids) != n:
        raise APIError(400, "sampling_params and rid lists need one entry per prompt", param="sampling_params")
    if body.stream and batch:
        raise APIError(400, "stream takes a single prompt", param="stream")
    state.admit(n)
    started: list = []
    try:
        for prompt, sp, rid in zip(prompts, params, rids):
            key = "prompt" if body.text is not None else "input_ids"
            started.append(
                await engine.start_request(
                    **{key: prompt},
                    sampling_params=sp,
                    return_logprob=body.return_logprob,
                    logprob_start_len=body.logprob_start_len,
                    top_logprobs_num=body.top_logprobs_num,
                    return_text_in_logprobs=body.return_text_in_logprobs,
                    stream=body.stream,
                    rid=rid,
                )
            )
    except ValueError as exc:
        for req, _ in started:
            engine.abort_nowait(req.rid)
        state.release(n)
        raise bad_request(exc) from None
    if body.stream:
        req, q = started[0]

        async def events() -> AsyncIterator[dict[str, Any]]:
            while True:
                out = await q.get()
                yield {"text": out.text, "output_ids": out.output_ids, "meta_info": out.meta_info}
                if out.finished:
                    state.metrics.observe_finished(out.meta_info)
                    return

        def close() -> None:
            engine.abort_nowait(req.rid)
            state.release(n)

        return stream_response(events(), close)
    try:
        outs = await wait_final(state, request, started)
    finally:
        state.release(n)
    results = [{"text": o.text, "output_ids": o.output_ids, "meta_info": o.meta_info} for o in outs]
    return JSONResponse(results if batch else results[0])


def run_server(ns) -> int:
    """``radixlm serve``: load the engine, then serve until SIGINT/SIGTERM (graceful drain)."""
    import signal

    import uvicorn

    from radixlm.runtime.server_args import ServerArgs

    args = ServerArgs.from_cli(ns)
    engine = Engine(**vars(args))
    app = create_app(engine, api_key=ns.api_key, max_queued_requests=ns.max_queued_requests, served_model_name=ns.served_model_name)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=args.log_level, timeout_graceful_shutdown=30)
    state: ServerState = app.state.radixlm

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # SIGTERM/SIGINT: refuse new work and drain the rest, then exit 0 (uvicorn would
            # re-raise the signal after its shutdown, ending the process with -SIGTERM).
            state.shutting_down = True
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    server = _Server(config)
    print(f"radixlm serving {engine.model_path} on http://{ns.host}:{ns.port}", flush=True)
    server.run()
    engine.shutdown()
    return 0
