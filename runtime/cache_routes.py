"""``GET /cache_explanations``: the cache explanations of the last requests (for ``explain-cache``)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from radixlm.runtime.http_common import ServerState
from radixlm.runtime.http_errors import APIError

MAX_LAST = 1000


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Register the cache-explanation route on ``app`` (behind the API key, like every route)."""

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
        items = await asyncio.to_thread(state.engine.cache_explanations, last)
        return {"object": "list", "data": items}
