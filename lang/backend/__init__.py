"""Backends that run prompt programs: an HTTP endpoint, a child server, or an in-process engine."""

from typing import Any

from radixlm.lang.backend.base import Backend, BackendError
from radixlm.lang.backend.endpoint import RuntimeEndpoint
from radixlm.lang.backend.runtime import Runtime

# Loaded on first use: they import torch (EngineBackend) or the openai client (OpenAI).
_LAZY = {"EngineBackend": "radixlm.lang.backend.engine", "OpenAI": "radixlm.lang.backend.openai"}

__all__ = ["Backend", "BackendError", "EngineBackend", "OpenAI", "Runtime", "RuntimeEndpoint"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
