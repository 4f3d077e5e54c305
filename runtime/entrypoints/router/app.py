"""The router's HTTP app: generation routes forwarded to a chosen worker (or a prefill/decode
pair), the others answered from the workers or broadcast to them, and its own health, info and
metrics. It imports neither torch nor the engine, so it starts in a moment.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from radixlm.runtime.entrypoints.http.body import MAX_BODY_BYTES
from radixlm.runtime.entrypoints.http.errors import add_fallback_handlers, error_response
from radixlm.runtime.entrypoints.http.origin import OriginPolicy
from radixlm.runtime.entrypoints.router.auth import RequireKey
from radixlm.runtime.entrypoints.router.config import RouterConfig
from radixlm.runtime.entrypoints.router.metrics import RouterMetrics, relabel
from radixlm.runtime.entrypoints.router.pd import pd_forward
from radixlm.runtime.entrypoints.router.policy import make_policy
from radixlm.runtime.entrypoints.router.proxy import forward
from radixlm.runtime.entrypoints.router.state import RouterState
from radixlm.runtime.entrypoints.router.upstream import passthrough, read_raw, request_headers
from radixlm.runtime.entrypoints.router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)
GENERATE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens")
POOLING_PATHS = ("/v1/embeddings", "/v1/rerank", "/v1/score")  # one worker each; a prefill/decode pair does not pool
_INFO_TIMEOUT = 10.0  # seconds for a worker's info, models or metrics


class BadInput(Exception):
    """A request the router cannot forward (its message says why)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def create_router_app(config: RouterConfig) -> FastAPI:
    """The FastAPI app of a router configured by ``config``."""
    config.validate()
    urls = [config.prefill_url, config.decode_url] if config.pd_disaggregation else config.worker_urls
    own_headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=config.connect_timeout), limits=httpx.Limits(max_connections=None, max_keepalive_connections=64), headers=own_headers)
    registry = WorkerRegistry([u for u in urls if u], client, config.health_check_interval)
    state = RouterState(config, registry, make_policy(config.policy, config.cache_aware_settings()), client, RouterMetrics())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await registry.check_all()
        checker = asyncio.ensure_future(registry.run())
        try:
            yield
        finally:
            checker.cancel()
            await client.aclose()

    app = FastAPI(title="radixlm router", lifespan=lifespan)
    app.state.router = state
    origins = OriginPolicy.from_options(config.allowed_hosts, config.allowed_origins)
    app.add_middleware(RequireKey, keys=(config.api_key, config.admin_api_key), origins=origins)
    if origins.allowed_origins:  # outermost: preflights are answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=sorted(origins.allowed_origins), allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type", "X-Cache-Salt"])
    _add_error_handlers(app)
    _add_generate_routes(app, state)
    _add_worker_routes(app, state)
    _add_own_routes(app, state)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BadInput)
    async def bad_input(_: Request, exc: BadInput) -> JSONResponse:
        return error_response(exc.status, str(exc))

    add_fallback_handlers(app, logger)


async def read_body(request: Request) -> tuple[bytes, dict[str, Any]]:
    """The raw body and its JSON object; BadInput (400, 413) naming what is wrong."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadInput(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadInput(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadInput(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return raw, body


def _add_generate_routes(app: FastAPI, state: RouterState) -> None:
    async def generate(request: Request) -> Response:
        if state.shutting_down:
            return error_response(503, "the router is shutting down")
        raw, body = await read_body(request)
        path = request.url.path
        if state.config.pd_disaggregation and path != "/v1/messages/count_tokens":
            return await pd_forward(state, request, path, body)
        return await forward(state, request, path, raw, body)

    async def pool(request: Request) -> Response:
        if state.shutting_down:
            return error_response(503, "the router is shutting down")
        if state.config.pd_disaggregation:
            return error_response(400, f"{request.url.path} is not served by a prefill/decode pair: serve a model for pooling on its own")
        raw, body = await read_body(request)
        return await forward(state, request, request.url.path, raw, body)

    for path in GENERATE_PATHS:
        app.add_api_route(path, generate, methods=["POST"])
    for path in POOLING_PATHS:
        app.add_api_route(path, pool, methods=["POST"])


async def _each(state: RouterState, method: str, path: str, workers: list[Worker], **kwargs: Any) -> list[httpx.Response | Exception]:
    """The same call to each of ``workers``, concurrently: responses (read) or the errors."""

    async def one(w: Worker) -> httpx.Response | Exception:
        try:
            resp = await state.client.request(method, w.url + path, timeout=_INFO_TIMEOUT, **kwargs)
        except httpx.HTTPError as exc:
            return exc
        return resp

    return list(await asyncio.gather(*(one(w) for w in workers)))


def _json(resp: httpx.Response) -> dict[str, Any]:
    """A worker's JSON object body ({} if it is not one)."""
    try:
        body = resp.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _add_worker_routes(app: FastAPI, state: RouterState) -> None:
    """Routes answered by one healthy worker, or broadcast to every healthy worker."""

    async def from_a_worker(request: Request) -> Response:
        for w in state.registry.healthy():
            try:
                async with state.client.stream("GET", w.url + request.url.path, headers=request_headers(request), timeout=_INFO_TIMEOUT) as resp:
                    if resp.status_code < 500:
                        return passthrough(resp, await read_raw(resp))
            except httpx.HTTPError:
                continue
        return error_response(503, "no healthy worker answered")

    for path in ("/v1/models", "/get_model_info"):
        app.add_api_route(path, from_a_worker, methods=["GET"])

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        workers = state.registry.healthy()
        if not workers:
            return error_response(503, "no healthy worker")
        results = await _each(state, "POST", "/flush_cache", workers, headers=request_headers(request))
        for w, r in zip(workers, results):
            if isinstance(r, httpx.Response) and r.status_code == 200:
                state.policy.forget(w)
        for w, r in zip(workers, results):
            if isinstance(r, Exception):
                return error_response(503, f"worker {w.url} did not answer: {type(r).__name__}: {r}")
            if r.status_code != 200:
                return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return Response("cache flushed", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        raw, body = await read_body(request)
        workers = state.registry.healthy()
        results = await _each(state, "POST", "/abort_request", workers, content=raw, headers=request_headers(request))
        answered = [r for r in results if isinstance(r, httpx.Response)]
        for r in answered:
            if r.status_code != 200:
                return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        aborted = any(_json(r).get("aborted") is True for r in answered)
        return JSONResponse({"rid": body.get("rid"), "aborted": aborted})


def _add_own_routes(app: FastAPI, state: RouterState) -> None:
    """The router's own health, info and metrics."""

    @app.get("/health")
    async def health() -> Response:
        if state.shutting_down:
            return error_response(503, "the router is shutting down")
        needed = state.registry.workers if state.config.pd_disaggregation else state.registry.healthy()
        if not needed or not all(w.healthy for w in needed):
            return error_response(503, "no healthy worker" if not state.config.pd_disaggregation else "the prefill or decode worker is unhealthy")
        return Response(status_code=200)

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        workers = state.registry.workers
        results = await _each(state, "GET", "/get_server_info", workers)
        rows = []
        for w, r in zip(workers, results):
            row: dict[str, Any] = {"url": w.url, "healthy": w.healthy, "in_flight": w.in_flight, "tree_chars": state.policy.tree_chars(w), "last_error": w.last_error}
            if isinstance(r, httpx.Response) and r.status_code == 200:
                row["info"] = _json(r)
            else:
                row["info_error"] = f"{type(r).__name__}: {r}" if isinstance(r, Exception) else f"status {r.status_code}"
            rows.append(row)
        policy = "pd_disaggregation" if state.config.pd_disaggregation else state.policy.name
        config = {**dataclasses.asdict(state.config), "api_key": "(set)" if state.config.api_key else None, "admin_api_key": "(set)" if state.config.admin_api_key else None}  # never echo a key
        return {"role": "router", "policy": policy, "shutting_down": state.shutting_down, "config": config, "workers": rows}

    @app.get("/metrics")
    async def metrics() -> Response:
        m = state.metrics
        m.healthy.set(len(state.registry.healthy()))
        for w in state.registry.workers:
            m.in_flight.labels(worker=w.url).set(w.in_flight)
            m.tree_chars.labels(worker=w.url).set(state.policy.tree_chars(w))
        workers = state.registry.healthy()
        results = await _each(state, "GET", "/metrics", workers)
        texts = {w.url: r.text for w, r in zip(workers, results) if isinstance(r, httpx.Response) and r.status_code == 200}
        return Response(m.render() + relabel(texts), media_type="text/plain; version=0.0.4")
