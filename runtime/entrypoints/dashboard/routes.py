"""``GET /dashboard`` (a self-contained page) and ``GET /dashboard/state`` (the JSON it polls).

The state is one consistent read taken on the engine's loop thread (``Engine.dashboard_state``):
a bounded snapshot of the radix tree, the queues and the pool counters, plus the server-side
history (one sample per second, 10 minutes) from ``dashboard_history``. Node ages are seconds,
derived from the tree's LRU clock; edge previews are decoded here, off the loop thread.

The dashboard spans tenants: with ``--admin-api-key`` set, both routes need that key (its
header, or the token cookie that ``/dashboard?key=`` sets); without one, the state is served to
any caller with the API key but redacted: sizes, ages and counts, no token text and no rids.
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from radixlm.runtime.entrypoints.dashboard.history import CounterHistory, HistorySampler
from radixlm.runtime.entrypoints.http.common import ServerState
from radixlm.runtime.entrypoints.http.errors import APIError
from radixlm.runtime.entrypoints.http.tenancy import is_admin, redact_dashboard

MAX_NODES_LIMIT = 5000


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise APIError(400, f"{name} must be an integer, got {raw!r}", param=name) from None
    if not low <= value <= high:
        raise APIError(400, f"{name} must be between {low} and {high}, got {value}", param=name)
    return value


def _float_param(request: Request, name: str, default: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise APIError(400, f"{name} must be a number, got {raw!r}", param=name) from None
    if value != value or value in (float("inf"), float("-inf")):
        raise APIError(400, f"{name} must be a finite number", param=name)
    return value


def _decorate(state: dict[str, Any], history: CounterHistory, tokenizer: Any) -> dict[str, Any]:
    """Ages in seconds and text previews for the tree's nodes (runs off the loop thread)."""
    nodes = state["tree"]["nodes"]
    now = time.time()
    for node, age in zip(nodes, history.ages([n["tick"] for n in nodes], now)):
        node["age_s"] = age
        head = node.pop("head", None)
        if head:
            try:
                node["text"] = tokenizer.decode(head)
            except Exception:  # an id the tokenizer cannot decode: show the ids
                node["text"] = " ".join(map(str, head))
    return state


def page_html() -> str:
    """The dashboard page, a package file."""
    return (resources.files("radixlm.runtime.entrypoints.dashboard") / "static" / "dashboard.html").read_text(encoding="utf-8")


def add_routes(app: FastAPI, state: ServerState) -> HistorySampler:
    """Add the dashboard's routes and start its history sampler; returns the sampler."""
    engine = state.engine
    history = CounterHistory()
    sampler = HistorySampler(engine, history).start()
    started = time.time()

    def check_access(request: Request) -> bool:
        """True when the caller may read token text; 403 when an admin key is set and not sent."""
        if state.admin_key is not None and not is_admin(request):
            raise APIError(403, "the dashboard shows every tenant's requests: it needs the admin key (open /dashboard?key=<admin key> once, or send it as the Bearer token)")
        return is_admin(request)

    @app.get("/dashboard")
    async def dashboard(request: Request) -> HTMLResponse:
        check_access(request)
        return HTMLResponse(page_html())

    @app.get("/dashboard/state")
    async def dashboard_state(request: Request) -> dict[str, Any]:
        full = check_access(request)
        max_nodes = _int_param(request, "max_nodes", 400, 1, MAX_NODES_LIMIT)
        since = _float_param(request, "since", 0.0)
        if not engine.is_alive():
            raise APIError(503, "the engine is not running")
        snap = await asyncio.to_thread(engine.dashboard_state, max_nodes)
        history.record(snap["counters"])
        if not full:
            snap = redact_dashboard(snap)  # before decorating: no edge is decoded to text
        snap = await asyncio.to_thread(_decorate, snap, history, engine.tokenizer)
        snap.update(
            model=state.model_name,
            now=round(time.time(), 3),
            uptime_s=round(time.time() - started, 1),
            in_flight=state.in_flight,
            history=history.since(since),
        )
        return snap

    return sampler
