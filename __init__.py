"""radixlm: a structured-generation runtime for LLM programs."""

from typing import Any

from radixlm.lang import (
    Backend,
    BackendError,
    Function,
    ProgramError,
    ProgramState,
    Runtime,
    RuntimeEndpoint,
    Tool,
    assistant,
    assistant_begin,
    assistant_end,
    call_tool,
    describe_tools,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    global_config,
    greedy_token_selection,
    run_agent,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    tool,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
)
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.server_args import ServerArgs

__version__ = "0.1.0"

# Loaded on first use, so that a program talking to a server never imports torch or transformers.
_LAZY = {
    "Engine": "radixlm.runtime.engine",
    "EngineBackend": "radixlm.lang.backend.engine",
    "OpenAI": "radixlm.lang.backend.openai",
}

__all__ = [
    "Backend", "BackendError", "Engine", "EngineBackend", "Function", "OpenAI", "ProgramError", "ProgramState",
    "Runtime", "RuntimeEndpoint", "SamplingParams", "ServerArgs", "Tool", "__version__", "assistant",
    "assistant_begin", "assistant_end", "call_tool", "describe_tools", "flush_cache", "function", "gen", "gen_int",
    "gen_string", "get_default_backend", "global_config", "greedy_token_selection", "run_agent", "select",
    "set_default_backend", "system", "system_begin", "system_end", "token_length_normalized", "tool",
    "unconditional_likelihood_normalized", "user", "user_begin", "user_end",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'radixlm' has no attribute {name!r}")
