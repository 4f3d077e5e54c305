"""The HTTP server: FastAPI app over one Engine, with SGLang's native routes and OpenAI's.

Every failure is an OpenAI-shaped error body ``{"object": "error", "message", "type", "param",
"code"}``: 400 for invalid input (naming the field), 401 without the API key, 413 for a huge
body, 429 when the queue is full, 503 while shutting down or when the engine loop is gone.
A client that goes away (streaming or not) has its request aborted, which frees its KV.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from radixlm.runtime.engine import Engine
from radixlm.runtime.entrypoints.http import lora_routes
from radixlm.runtime.entrypoints.http.beams import beam_width_of, run_beams
from radixlm.runtime.entrypoints.http.body import json_object, read_model, request_schema
from radixlm.runtime.entrypoints.http.common import (
    ClientGone,
    ServerState,
    Ticket,
    drained_error,
    error_event,
    failure,
    next_output,
    stream_response,
    wait_final,
)
from radixlm.runtime.entrypoints.http.errors import (
    APIError,
    add_fallback_handlers,
    error_response,
    validation_error,
)
from radixlm.runtime.entrypoints.http.guard import CACHE_SALT_HEADER, Guard, RedactKeyFilter
from radixlm.runtime.entrypoints.http.metrics import ServerMetrics
from radixlm.runtime.entrypoints.http.origin import OriginPolicy
from radixlm.runtime.entrypoints.http.tenancy import is_admin, redact_paths, require_admin
from radixlm.runtime.entrypoints.openai.protocol import MAX_MESSAGES, MAX_TOOLS, GenerateRequest
from radixlm.runtime.entrypoints.secrets import command_keys
from radixlm.runtime.request import ANY_SALT
from radixlm.runtime.sampling_params import per_sample_params, requested_n
from radixlm.runtime.tokenizer import apply_chat_template

logger = logging.getLogger(__name__)


def create_app(
    engine: Engine,
    api_key: str | None = None,
    max_queued_requests: int = 1024,
    served_model_name: str | None = None,
    admin_api_key: str | None = None,
    allowed_hosts: list[str] | tuple[str, ...] = (),
    allowed_origins: list[str] | tuple[str, ...] = (),
) -> FastAPI:
    """The FastAPI app serving ``engine`` (docs/security.md says what each key and list opens)."""
    from radixlm.runtime.entrypoints.anthropic import routes as anthropic_routes
    from radixlm.runtime.entrypoints.dashboard import routes as dashboard
    from radixlm.runtime.entrypoints.http import cache_routes
    from radixlm.runtime.entrypoints.openai import routes as openai_routes
    from radixlm.runtime.entrypoints.pooling import routes as pooling_routes
    from radixlm.runtime.entrypoints.responses import routes as responses_routes

    if api_key is not None and admin_api_key is not None and hmac.compare_digest(api_key, admin_api_key):
        raise ValueError("--admin-api-key must differ from --api-key (the admin key opens every tenant's data)")
    origins = OriginPolicy.from_options(allowed_hosts, allowed_origins)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.shutting_down = True
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="radixlm", lifespan=lifespan, redirect_slashes=False)  # "/generate/" is a 404, not a 307
    name = served_model_name or engine.model_path.rstrip("/").split("/")[-1]
    state = ServerState(engine, ServerMetrics(per_priority=engine.args.schedule_policy == "priority"), name, api_key, max_queued_requests + engine.args.max_running_requests, admin_key=admin_api_key, origins=origins)
    app.state.radixlm = state
    app.add_middleware(Guard, state=state)
    if origins.allowed_origins:  # outermost: preflights are answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=sorted(origins.allowed_origins), allow_methods=["GET", "POST", "DELETE"], allow_headers=["Authorization", "Content-Type", CACHE_SALT_HEADER, "x-api-key", "anthropic-version"])
    _add_error_handlers(app)
    _add_native_routes(app, state)
    openai_routes.add_routes(app, state)
    pooling_routes.add_routes(app, state)  # /v1/embeddings, /v1/rerank, /v1/score (docs/embeddings.md)
    responses_routes.add_routes(app, state)  # /v1/responses: OpenAI's Responses API and its store
    anthropic_routes.add_routes(app, state)  # /v1/messages: Anthropic's API, errors in its shape
    cache_routes.add_routes(app, state)
    lora_routes.add_routes(app, state)  # /load_lora_adapter, /unload_lora_adapter (docs/lora.md)
    dashboard.add_routes(app, state)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, expected or not, answers with the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody is there to read it

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(list(exc.errors()))
        return error_response(err.status, err.message, err.param)

    add_fallback_handlers(app, logger)


def _add_native_routes(app: FastAPI, state: ServerState) -> None:
    """SGLang's routes: generate, health, info, cache, abort, template, tokenize, metrics."""
    engine = state.engine

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive():
            return error_response(503, "the engine is not running")
        if state.shutting_down:  # a load balancer must stop sending work here
            return error_response(503, "the server is draining (shutting down)")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        ticket = Ticket(state, 1, [], "n")
        try:
            _, q = await ticket.start("input_ids", input_ids=[0], sampling_params={"max_new_tokens": 1})
            while True:
                out = await next_output(state, q)
                if out is None or out.finished:
                    break
            if out is not None:
                ticket.mark_finished(out)
                err = failure([out])
                if err is not None:
                    raise err
        finally:
            ticket.close()
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info(request: Request) -> dict[str, Any]:
        cfg = engine.config
        admin = is_admin(request)
        paths = {"model_path": engine.model_path, "tokenizer_path": engine.args.tokenizer_path or engine.model_path}
        return {**(paths if admin else redact_paths(paths)), "is_generation": True, "architecture": cfg.architecture, "context_length": engine.context_len, "vocab_size": cfg.vocab_size}

    @app.get("/get_server_info")
    @app.get("/server_info")  # SGLang's newer name: the same body
    async def server_info(request: Request) -> dict[str, Any]:
        stats = await asyncio.to_thread(engine.get_stats)
        # the full KV check walks the whole pool on the loop thread: only while nothing runs
        stats["kv_invariant_holds"] = await asyncio.to_thread(engine.kv_invariant_holds_when_idle)
        stats["in_flight"] = state.in_flight
        args = vars(engine.args) if is_admin(request) else redact_paths(vars(engine.args))
        disk = stats.get("kv_tiers", {}).get("disk")
        if disk and disk["stopped"] and not is_admin(request):  # the reason may name the folder
            disk["stopped"] = "stopped (the admin key shows why)"
        weights = {"weight_bytes": engine.runner.weight_bytes, "weight_formats": sorted(engine.runner.weight_formats)}
        return {**args, "served_model_name": state.model_name, **weights, "stats": stats}

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        require_admin(request, state, "/flush_cache empties every tenant's cache")
        if not await asyncio.to_thread(engine.flush_cache):
            raise APIError(400, "cannot flush the cache while requests are in flight")
        return Response("cache flushed", status_code=200)

    @app.post("/concate_and_append_request")
    async def concate_and_append_request(request: Request) -> dict[str, Any]:
        """SGLang's frontend joins forks this way (``join(mode="concate_and_append")``). Checks
        the body and answers 200; it changes nothing on the server, on purpose.

        The rids are the frontend's program-state ids, which it never sends with /generate, so
        no KV is filed under them here. The client has already appended each branch's text to
        ``dst_rid``'s text; that state's next /generate sends the joined text, and the radix
        cache serves what it holds of it: the text before the fork and the first branch. The
        other branches are computed there, each attending to all text before it (SGLang's
        parallel encoding would instead reuse each branch's KV computed without its siblings).
        """
        body = await json_object(request)
        src, dst = body.get("src_rids"), body.get("dst_rid")
        if not isinstance(src, list) or not src or not all(isinstance(r, str) and r for r in src):
            raise APIError(400, "src_rids must be a non-empty list of non-empty strings", param="src_rids")
        if len(set(src)) != len(src):
            raise APIError(400, "src_rids must not repeat an id", param="src_rids")
        if not isinstance(dst, str) or not dst:
            raise APIError(400, "dst_rid must be a non-empty string", param="dst_rid")
        if dst in src:
            raise APIError(400, "dst_rid must not be one of src_rids", param="dst_rid")
        extra = sorted(set(body) - {"src_rids", "dst_rid"})
        if extra:
            raise APIError(400, f"unknown field {extra[0]!r} (this route takes src_rids and dst_rid)", param=extra[0])
        return {"success": True, "src_rids": src, "dst_rid": dst, "kv_moved_tokens": 0, "message": "nothing to move: the next request with the joined text reuses the cached prefix"}

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        """Abort one of the caller's requests: the rid within its ``cache_salt`` (the admin key: any)."""
        body = await json_object(request)
        rid, salt = body.get("rid"), body.get("cache_salt")
        if not isinstance(rid, str) or not rid:
            raise APIError(400, "rid must be a non-empty string", param="rid")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise APIError(400, "cache_salt must be a non-empty string", param="cache_salt")
        extra = sorted(set(body) - {"rid", "cache_salt"})
        if extra:
            raise APIError(400, f"unknown field {extra[0]!r} (this route takes rid and cache_salt)", param=extra[0])
        scope = ANY_SALT if is_admin(request) and "cache_salt" not in body else salt
        return {"rid": rid, "aborted": await asyncio.to_thread(engine.abort, rid, scope)}

    @app.post("/apply_chat_template")
    async def chat_template(request: Request) -> dict[str, Any]:
        """Render messages with the model's chat template (the frontend language uses this)."""
        body = await json_object(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise APIError(400, "messages must be a list of {role, content} objects", param="messages")
        if len(messages) > MAX_MESSAGES:
            raise APIError(400, f"messages: at most {MAX_MESSAGES} messages, got {len(messages)}", param="messages")
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list) or len(tools) > MAX_TOOLS):
            raise APIError(400, f"tools must be a list of at most {MAX_TOOLS} tools", param="tools")
        try:
            text = await asyncio.to_thread(apply_chat_template, engine.tokenizer, messages, tools=body.get("tools"), add_generation_prompt=bool(body.get("add_generation_prompt", True)))
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
        if batch and len(prompt) > state.max_in_flight:
            raise APIError(400, f"prompt: at most {state.max_in_flight} prompts at once, got {len(prompt)}", param="prompt")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise APIError(400, "add_special_tokens must be a boolean", param="add_special_tokens")
        try:
            tokens = await asyncio.to_thread(lambda: [engine.tokenize(p, add_special_tokens=special) for p in (prompt if batch else [prompt])])
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from None
        counts = [len(t) for t in tokens]
        return {"tokens": tokens if batch else tokens[0], "count": counts if batch else counts[0], "max_model_len": engine.context_len}

    @app.get("/metrics")
    async def metrics() -> Response:
        if not engine.is_alive():
            return error_response(503, "the engine is not running")
        stats = await asyncio.to_thread(engine.get_stats)
        return Response(state.metrics.render(stats), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        base = {"id": state.model_name, "object": "model", "owned_by": "radixlm", "max_model_len": engine.context_len}
        return {"object": "list", "data": [base, *lora_routes.model_cards(state)]}

    @app.post("/generate", openapi_extra=request_schema(GenerateRequest))
    async def generate(request: Request) -> Response:
        return await native_generate(state, await read_model(request, GenerateRequest), request)


async def native_generate(state: ServerState, body: GenerateRequest, request: Request) -> Response:
    """SGLang's ``/generate``: one prompt or a batch, blocking or streamed (cumulative text)."""
    batch = isinstance(body.text, list) or (body.input_ids is not None and bool(body.input_ids) and isinstance(body.input_ids[0], list))
    prompts = (body.text if isinstance(body.text, list) else [body.text]) if body.text is not None else (body.input_ids if batch else [body.input_ids])
    key = "text" if body.text is not None else "input_ids"
    n = len(prompts)
    if batch and n == 0:
        raise APIError(400, f"{key} must not be an empty list", param=key)
    params = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params] * n
    rids = body.rid if isinstance(body.rid, list) else [body.rid] * n
    if len(params) != n or len(rids) != n:
        raise APIError(400, "sampling_params and rid lists need one entry per prompt", param="sampling_params")
    if body.stream and batch:
        raise APIError(400, "stream takes a single prompt", param="stream")
    state.check_fits(n, key)
    state.check_fits(sum(_sample_count(sp) for sp in params), "n")  # before n copies are built
    jobs = _samples(prompts, params, rids, body.stream)
    loras = lora_routes.generate_loras(state, body.lora_path, params)
    if any(beam_width_of(sp) > 1 for sp in params):
        return await _native_beams(state, body, request, key, jobs, loras)
    sampled = len(jobs) > n
    ticket = Ticket(state, len(jobs), [r for _, _, r in jobs if r is not None], "n" if sampled else key, body.cache_salt)
    handed_off = False
    try:
        for (prompt, sp, rid), lora in zip(jobs, loras):
            await ticket.start(
                key,
                **{"prompt" if key == "text" else key: prompt},
                sampling_params=sp,
                return_logprob=body.return_logprob,
                logprob_start_len=body.logprob_start_len,
                top_logprobs_num=body.top_logprobs_num,
                return_text_in_logprobs=body.return_text_in_logprobs,
                stream=body.stream,
                rid=rid,
                **({"cache_salt": body.cache_salt} if body.cache_salt is not None else {}),
                return_cache_info=body.return_cache_info,
                program=body.program,
                prompt_cache_key=body.prompt_cache_key,
                cache_ttl=body.cache_ttl,
                prediction=body.prediction,
                bootstrap_room=body.bootstrap_room,
                priority=body.priority,
                lora=lora,
            )
        if body.stream:
            response = stream_response(_native_events(ticket), ticket.close)
            handed_off = True
            return response
        outs = await wait_final(ticket, request)
    finally:
        if not handed_off:
            ticket.close()
    results = [{"text": o.text, "output_ids": o.output_ids, "meta_info": o.meta_info} for o in outs]
    return JSONResponse(results if batch or sampled else results[0])


async def _native_beams(state: ServerState, body: GenerateRequest, request: Request, key: str, jobs: list, loras: list) -> Response:
    """``/generate`` with ``beam_width`` > 1: each prompt's beams, best first, prompt-major (a list, as for ``n``)."""
    if body.stream:
        raise APIError(400, "beam_width > 1 answers once its beams end: it does not stream", param="stream")
    calls = [
        dict(
            **{"prompt" if key == "text" else key: prompt},
            sampling_params=sp,
            return_logprob=body.return_logprob,
            rid=rid,
            **({"cache_salt": body.cache_salt} if body.cache_salt is not None else {}),
            program=body.program,
            prompt_cache_key=body.prompt_cache_key,
            priority=body.priority,
            lora=lora,
        )
        for (prompt, sp, rid), lora in zip(jobs, loras)
    ]
    outs = await run_beams(state, request, calls, key)
    return JSONResponse([{"text": o.text, "output_ids": o.output_ids, "meta_info": o.meta_info} for hyps in outs for o in hyps])


def _sample_count(params: Any) -> int:
    """How many samples one prompt's params ask for (``n``), read without building anything;
    the capacity check that follows names a count too large (per_sample_params, MAX_N)."""
    n = requested_n(params)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise APIError(400, f"n must be an integer >= 1, got {n!r}", param="n")
    return n


def _samples(prompts: list, params: list, rids: list, stream: bool) -> list[tuple[Any, Any, str | None]]:
    """One (prompt, sampling params, rid) per request: ``n`` per prompt, prompt-major."""
    jobs = []
    for prompt, sp, rid in zip(prompts, params, rids):
        try:
            per_sample = per_sample_params(sp)
        except ValueError as exc:
            raise APIError(400, str(exc), param="n") from None
        if len(per_sample) > 1 and stream:
            raise APIError(400, "n > 1 cannot be streamed: stream takes one sample", param="n")
        if len(per_sample) > 1 and rid is not None:
            raise APIError(400, "rid names one request; with n > 1 leave it out", param="rid")
        jobs += [(prompt, s, rid) for s in per_sample]
    return jobs


async def _native_events(ticket: Ticket) -> AsyncIterator[dict[str, Any]]:
    """The native stream's events: cumulative outputs, or a final error event."""
    state = ticket.state
    _, q = ticket.started[0]
    while True:
        out = await next_output(state, q)
        if out is None:
            yield error_event(drained_error())
            return
        if out.finished and (event := ticket.settle_stream(out)) is not None:
            yield event
            return
        yield {"text": out.text, "output_ids": out.output_ids, "meta_info": out.meta_info}
        if out.finished:
            return


def run_server(ns) -> int:
    """``radixlm serve``: load the engine, then serve until SIGINT/SIGTERM (graceful drain)."""
    import signal

    import uvicorn

    from radixlm.runtime.server_args import ServerArgs

    if ns.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0 seconds, got {ns.drain_timeout}")
    api_key, admin_key = command_keys(ns)
    OriginPolicy.from_options(ns.allowed_hosts, ns.allowed_origins)  # refused before the model loads
    sock = _inherited_socket(ns.listen_fd) if ns.listen_fd is not None else None
    args = ServerArgs.from_cli(ns)
    engine = Engine(**vars(args))
    app = create_app(engine, api_key=api_key, max_queued_requests=ns.max_queued_requests, served_model_name=ns.served_model_name, admin_api_key=admin_key, allowed_hosts=ns.allowed_hosts, allowed_origins=ns.allowed_origins)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=args.log_level, timeout_graceful_shutdown=10)
    logging.getLogger("uvicorn.access").addFilter(RedactKeyFilter())
    state: ServerState = app.state.radixlm

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # SIGTERM/SIGINT: refuse new work and drain the rest, then exit 0 (uvicorn would
            # re-raise the signal after its shutdown, ending the process with -SIGTERM).
            state.shutting_down = True
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

        async def shutdown(self, sockets=None) -> None:
            # Keep listening while draining, so new requests get 503 rather than a refused
            # connection; what still runs after --drain-timeout gets a final error.
            await _drain(state, ns.drain_timeout, lambda: self.force_exit)
            await super().shutdown(sockets)

    server = _Server(config)

    def watch_engine() -> None:
        # an engine that died (a tensor-parallel worker lost, a fatal loop error) ends the server
        # with a non-zero exit, after every waiter got its error, so a supervisor can restart it
        if engine.wait_stopped() and not state.shutting_down:
            logger.critical("the engine stopped: %s; shutting the server down", engine.error)
            died.set()
            server.should_exit = True

    died = threading.Event()
    threading.Thread(target=watch_engine, name="radixlm-engine-watch", daemon=True).start()
    where = "http://{}:{}".format(*sock.getsockname()[:2]) if sock is not None else f"http://{ns.host}:{ns.port}"
    print(f"radixlm serving {engine.model_path} on {where}", flush=True)
    server.run(sockets=[sock] if sock is not None else None)
    engine.shutdown()
    return 1 if died.is_set() else 0


def _inherited_socket(fd: int) -> socket.socket:
    """The listening TCP socket a launcher bound and handed down as ``fd`` (ValueError otherwise)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ValueError(f"--listen-fd {fd} is not an open socket: {exc}") from None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6) or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        raise ValueError(f"--listen-fd {fd} is not a listening TCP socket")
    return sock


async def _drain(state: ServerState, timeout: float, forced: Callable[[], bool]) -> None:
    """Wait until nothing is in flight or ``timeout`` passes; then fail what is left (503)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while state.in_flight > 0 and loop.time() < deadline and not forced():
        await asyncio.sleep(0.05)
    if state.in_flight > 0:
        logger.warning("drain timeout (%.0f s) passed with %d requests in flight: failing them", timeout, state.in_flight)
        state.drain_expired.set()
        grace = loop.time() + 5
        while state.in_flight > 0 and loop.time() < grace and not forced():
            await asyncio.sleep(0.05)
