"""radixlm: a structured-generation runtime for LLM programs."""

from radixlm.lang import (
    Backend,
    BackendError,
    EngineBackend,
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
    greedy_token_selection,
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
from radixlm.runtime.engine import Engine
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.server_args import ServerArgs

__version__ = "0.1.0"

__all__ = [
    "Backend", "BackendError", "Engine", "EngineBackend", "Function", "ProgramError", "ProgramState", "Runtime",
    "RuntimeEndpoint", "SamplingParams", "ServerArgs", "Tool", "__version__", "assistant", "assistant_begin",
    "assistant_end", "call_tool", "describe_tools", "flush_cache", "function", "gen", "gen_int", "gen_string",
    "get_default_backend", "greedy_token_selection", "select", "set_default_backend", "system", "system_begin",
    "system_end", "token_length_normalized", "tool", "unconditional_likelihood_normalized", "user", "user_begin",
    "user_end",
]
