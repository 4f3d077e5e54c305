"""The frontend language: prompt programs (``@function``) that run on a radixlm backend."""

from typing import Any

from radixlm.lang.agent import answer_tool, run_agent
from radixlm.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from radixlm.lang.backend import Backend, BackendError, Runtime, RuntimeEndpoint
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.choices import (
    ChoicesMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.lang.errors import ProgramError
from radixlm.lang.global_config import GlobalConfig, global_config
from radixlm.lang.program import Function, get_default_backend, set_default_backend
from radixlm.lang.state import ProgramState, ProgramStateGroup
from radixlm.lang.tools import Tool, call_tool, describe_tools, tool
from radixlm.lang.tracer import Trace

_LAZY = {"EngineBackend": "radixlm.lang.backend.engine", "OpenAI": "radixlm.lang.backend.openai"}  # they import torch / openai

__all__ = [
    "Backend", "BackendError", "ChatTemplate", "ChoicesMethod", "EngineBackend", "Function", "GlobalConfig", "OpenAI",
    "ProgramError", "answer_tool", "global_config", "run_agent",
    "ProgramState", "ProgramStateGroup", "Runtime", "RuntimeEndpoint", "Tool", "Trace", "assistant",
    "assistant_begin", "assistant_end", "call_tool", "describe_tools", "flush_cache", "function", "gen",
    "gen_int", "gen_string", "get_default_backend", "greedy_token_selection", "select", "set_default_backend",
    "system", "system_begin", "system_end", "token_length_normalized", "tool", "unconditional_likelihood_normalized",
    "user", "user_begin", "user_end",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
