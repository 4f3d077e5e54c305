"""The public DSL: ``function``, ``gen``, ``select``, roles and backends (SGLang's names and arguments)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from radixlm.lang import ir
from radixlm.lang.choices import ChoicesMethod, token_length_normalized
from radixlm.lang.program import Function, _resolve
from radixlm.lang.tools import as_tools
from radixlm.runtime.sampling_params import SamplingParams

# The regexes ``dtype`` stands for.
DTYPE_REGEX = {int: ir.REGEX_INT, float: ir.REGEX_FLOAT, bool: ir.REGEX_BOOL, str: ir.REGEX_STR}
_DTYPE_NAMES = {"int": int, "float": float, "bool": bool, "str": str}


def function(func: Callable[..., Any] | None = None, *, num_api_spec_tokens: int | None = None) -> Any:
    """Make a prompt program of ``func`` (its first parameter is the state ``s``); ``@function()`` works too.

    ``num_api_spec_tokens`` turns on API speculative execution (SGLang's meaning) on the
    ``OpenAI`` backend: one request generates at least that many tokens and the program's
    following ``gen`` calls are served from it while the program's text still matches, so fewer
    requests and prompt tokens are sent; on a chat model the ``gen`` calls of one assistant
    message are written by one request at the message's end. The local backends
    (``EngineBackend``, ``Runtime``, ``RuntimeEndpoint``) take it as a hint and ignore it: their
    radix cache already makes the repeated prompt free.
    """
    if num_api_spec_tokens is not None and (not isinstance(num_api_spec_tokens, int) or isinstance(num_api_spec_tokens, bool) or num_api_spec_tokens < 1):
        raise ValueError(f"num_api_spec_tokens must be a positive integer, got {num_api_spec_tokens!r}")
    if func is not None:
        return Function(func, num_api_spec_tokens=num_api_spec_tokens)
    return lambda f: Function(f, num_api_spec_tokens=num_api_spec_tokens)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesMethod | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    tools: list[Any] | None = None,
    return_cache_info: bool | None = None,
    lora: str | None = None,
) -> ir.Expr:
    """Generate text into variable ``name``; constrain it with ``regex``, ``json_schema``, ``dtype`` or ``tools``.

    ``json_schema`` is a dict, a JSON string or a pydantic model class (whose objects then admit
    only their declared fields, unless the model allows extras). ``choices`` makes this a
    ``select``. ``tools`` (``@tool`` functions) makes the output one valid call, stored as
    ``{"name", "arguments"}``. ``n=k`` draws k samples that share the prompt's KV: the variable
    is the list of the k texts (its meta info the list of their meta infos) and the program's
    text goes on with the first. ``stop_regex`` stops at the first match of a pattern in the
    generated text (trimmed from the output, like ``stop``). ``lora`` names the LoRA adapter this
    call generates with (the run's ``lora`` otherwise; see docs/lora.md).
    """
    label = ir.describe_call("gen", name, max_tokens=max_tokens, stop=stop, temperature=temperature, dtype=dtype, regex=regex, json_schema=json_schema, choices=choices, tools=[getattr(t, "name", getattr(t, "__name__", t)) for t in tools] if tools else None, lora=lora)
    if n is not None and n != 1 and (tools is not None or choices is not None):
        raise ValueError(f"{label}: n > 1 cannot be combined with tools or choices")
    lora = ir.check_lora(lora, label)
    if choices is not None:
        return select(name, choices, 0.0 if temperature is None else temperature, choices_method or token_length_normalized, lora=lora)
    constraints = [k for k, v in (("regex", regex), ("json_schema", json_schema), ("dtype", dtype), ("tools", tools)) if v is not None]
    if len(constraints) > 1:
        raise ValueError(f"{label}: give at most one of regex, json_schema, dtype, tools (got {', '.join(constraints)})")
    if dtype is not None:
        regex = _dtype_regex(dtype, label)
    if regex is not None:
        try:
            re.compile(regex)
        except (re.error, TypeError) as exc:
            raise ValueError(f"{label}: invalid regex {regex!r}: {exc}") from None
    schema = _schema_text(json_schema, label) if json_schema is not None else None
    params = {
        "max_new_tokens": max_tokens, "min_new_tokens": min_tokens, "n": n, "stop": stop, "stop_token_ids": stop_token_ids,
        "stop_regex": stop_regex,
        "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
        "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty, "ignore_eos": ignore_eos,
    }
    params = {k: v for k, v in params.items() if v is not None}
    check = dict(params)
    check.setdefault("max_new_tokens", max(min_tokens or 0, 1))  # the run's default applies later
    try:
        SamplingParams.from_dict(check)
    except ValueError as exc:
        raise ValueError(f"{label}: {exc}") from None
    try:
        tool_list = as_tools(tools) if tools is not None else None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{label}: {exc}") from None
    if return_cache_info is not None and not isinstance(return_cache_info, bool):
        raise ValueError(f"{label}: return_cache_info must be a boolean")
    return ir.Gen(name, params, regex, schema, tool_list, return_logprob, logprob_start_len, top_logprobs_num, return_text_in_logprobs, label, return_cache_info, lora)


def gen_int(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> ir.Expr:
    """Generate an integer (as text, like SGLang)."""
    return gen(name, max_tokens, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> ir.Expr:
    """Generate a double-quoted string."""
    return gen(name, max_tokens, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0, choices_method: ChoicesMethod = token_length_normalized, lora: str | None = None) -> ir.Expr:
    """Append the choice the model scores highest (all scored in one batched prefill) as ``name``;
    ``lora``: the LoRA adapter that scores them (the run's ``lora`` otherwise)."""
    label = ir.describe_call("select", name, choices=choices, lora=lora)
    lora = ir.check_lora(lora, label)
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"{label}: choices must be a non-empty list of non-empty strings")
    if not isinstance(choices_method, ChoicesMethod):
        raise ValueError(f"{label}: choices_method must be token_length_normalized, greedy_token_selection or unconditional_likelihood_normalized")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"{label}: temperature must be >= 0")
    if temperature > 0 and not choices_method.supports_temperature:
        raise ValueError(f"{label}: {choices_method!r} cannot sample (use temperature=0)")
    return ir.Select(name, list(choices), float(temperature), choices_method, label, lora)


def _role(role: str, expr: Any = None) -> ir.Expr:
    inner = [] if expr is None else [expr]
    return ir.ExprList([ir.RoleBegin(role), *inner, ir.RoleEnd(role)])


def system(expr: Any = None) -> ir.Expr:
    """A system message around ``expr``."""
    return _role("system", expr)


def user(expr: Any = None) -> ir.Expr:
    """A user message around ``expr``."""
    return _role("user", expr)


def assistant(expr: Any = None) -> ir.Expr:
    """An assistant message around ``expr``."""
    return _role("assistant", expr)


def system_begin() -> ir.Expr:
    """Open a system message."""
    return ir.RoleBegin("system")


def system_end() -> ir.Expr:
    """Close the system message."""
    return ir.RoleEnd("system")


def user_begin() -> ir.Expr:
    """Open a user message."""
    return ir.RoleBegin("user")


def user_end() -> ir.Expr:
    """Close the user message."""
    return ir.RoleEnd("user")


def assistant_begin() -> ir.Expr:
    """Open an assistant message."""
    return ir.RoleBegin("assistant")


def assistant_end() -> ir.Expr:
    """Close the assistant message."""
    return ir.RoleEnd("assistant")


def flush_cache(backend: Any = None) -> bool:
    """Empty the radix cache of ``backend`` (or the default backend)."""
    return _resolve(backend).flush_cache()


def _dtype_regex(dtype: Any, label: str) -> str:
    kind = _DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if kind not in DTYPE_REGEX:
        raise ValueError(f"{label}: dtype must be int, float, bool or str, got {dtype!r}")
    return DTYPE_REGEX[kind]


def _closed(schema: Any) -> Any:
    """A pydantic schema whose objects allow only their declared fields (what the model validates)."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def _schema_text(schema: Any, label: str) -> str:
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        return json.dumps(_closed(schema.model_json_schema()) if schema.model_config.get("extra") != "allow" else schema.model_json_schema())
    if isinstance(schema, dict):
        return json.dumps(schema)
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{label}: json_schema is not valid JSON: {exc}") from None
        if not isinstance(parsed, (dict, bool)):
            raise ValueError(f"{label}: json_schema must be a JSON object")
        return schema
    raise ValueError(f"{label}: json_schema must be a dict, a JSON string or a pydantic model class, not {type(schema).__name__}")
