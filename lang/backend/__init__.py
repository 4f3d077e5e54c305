"""Backends that run prompt programs: an HTTP endpoint, a child server, or an in-process engine."""

from radixlm.lang.backend.base import Backend, BackendError
from radixlm.lang.backend.endpoint import RuntimeEndpoint
from radixlm.lang.backend.engine import EngineBackend
from radixlm.lang.backend.runtime import Runtime

__all__ = ["Backend", "BackendError", "EngineBackend", "Runtime", "RuntimeEndpoint"]
