"""``GET /cache_explanations``: the cache explanations of the last requests (for ``explain-cache``)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from radixlm.runtime.entrypoints.http.common import ServerState
from radixlm.runtime.entrypoints.http.errors import APIError
from radixlm.runtime.entrypoints.http.guard import CACHE_SALT_HEADER
from radixlm.runtime.entrypoints.http.tenancy import is_admin, visible_explanations
from radixlm.runtime.request import ANY_SALT

MAX_LAST = 1000


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Register the cache-explanation route on ``app``: the admin reads every tenant's explanations;
    any other caller its own tenant's (``X-Cache-Salt``), as counts without rids, labels or text."""

    @app.get("/cache_explanations")
    async def cache_explanations(request: Request) -> dict[str, Any]:
        raw = request.query_params.get("last", "20")
        try:
            last = int(raw)
        except ValueError:
            raise APIError(400, f"last must be an integer, got {raw!r}", param="last") from None
        if not 0 <= last <= MAX_LAST:
            raise APIError(400, f"last must be between 0 and {MAX_LAST}, got {last}", param="last")
        if state.engine.args.disable_cache_explain:
            raise APIError(400, "cache explanations are off on this server (--disable-cache-explain)", param="last")
        admin = is_admin(request)
        salt = request.headers.get(CACHE_SALT_HEADER) or None  # the caller's tenant (a header: never in access logs)
        items = await asyncio.to_thread(state.engine.cache_explanations, last, ANY_SALT if admin else salt)
        return {"object": "list", "data": visible_explanations(items, admin), "redacted": not admin}
