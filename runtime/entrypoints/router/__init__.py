"""The router: one HTTP front over several engine servers (data-parallel replicas, or a
prefill/decode pair), choosing a worker per request by cache-aware, round-robin or
shortest-queue policy. It imports neither torch nor the engine."""

from radixlm.runtime.entrypoints.router.app import create_router_app
from radixlm.runtime.entrypoints.router.config import RouterConfig

__all__ = ["RouterConfig", "create_router_app"]
