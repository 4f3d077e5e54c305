"""What to run for one OpenAI request, and the planning both routes share (sampling, tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.entrypoints.http.common import ServerState
from radixlm.runtime.entrypoints.http.errors import APIError
from radixlm.runtime.entrypoints.openai import reasoning
from radixlm.runtime.entrypoints.openai.protocol import new_id
from radixlm.runtime.entrypoints.openai.tool_formats import HERMES, ToolFormat


@dataclass
class Plan:
    """What to run for one OpenAI request and how to shape the answer."""

    chat: bool
    model: str
    prompts: list[list[int]]  # one per prompt (completions may take several)
    prompt_texts: list[str]
    sampling: dict[str, Any]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives wanted (0 = chosen token only); None = no logprobs
    echo: bool = False
    reasoning: reasoning.ReasoningFormat | None = None  # a reasoning model's markers (chat)
    harmony: bool = False  # the model answers in harmony's channels (openai/harmony.py)
    tool_mode: str | None = None  # "required", "named", "auto"
    tool_name: str | None = None
    tool_format: ToolFormat = HERMES  # how the model family writes ``auto`` calls
    cache_salt: str | None = None
    prompt_cache_key: str | None = None
    return_cache_info: bool = False
    retention: list[tuple[int, float]] = field(default_factory=list)  # (prefix tokens, ttl) per cache_control
    prediction: str | None = None  # the expected output (Predicted Outputs)
    bootstrap_room: int | None = None  # pairs the halves of a disaggregated request
    priority: int = 0  # class under --schedule-policy priority
    beam: bool = False  # use_beam_search: the n choices of a prompt are its n best beams
    id: str = field(default_factory=lambda: new_id("cmpl"))


def sampling_params(state: ServerState, body, max_tokens: int | None, prompt_len: int) -> dict[str, Any]:
    """Engine sampling params from OpenAI fields (with context-length checks)."""
    if body.best_of not in (None, body.n):
        raise APIError(400, "best_of must equal n (or be omitted)", param="best_of")
    ctx = state.engine.context_len
    if prompt_len >= ctx:
        raise APIError(400, f"this model's maximum context length is {ctx} tokens; the prompt has {prompt_len}", param="messages" if hasattr(body, "messages") else "prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = ctx - prompt_len
    elif prompt_len + max_tokens > ctx:
        raise APIError(400, f"this model's maximum context length is {ctx} tokens; you asked for {prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to generate)", param="max_tokens", code="context_length_exceeded")
    sp: dict[str, Any] = {"max_new_tokens": max_tokens}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"), ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"), ("repetition_penalty", "repetition_penalty"), ("min_new_tokens", "min_tokens"), ("ignore_eos", "ignore_eos"), ("stop_token_ids", "stop_token_ids"), ("skip_special_tokens", "skip_special_tokens"), ("seed", "seed"), ("close_json_within_budget", "close_json_within_budget")):
        value = getattr(body, theirs)
        if value is not None:
            sp[ours] = value
    if body.stop is not None:
        sp["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    if body.logit_bias:
        sp["logit_bias"] = body.logit_bias  # checked (ids in the vocabulary, finite) with the rest
    if body.n > 1:
        sp["n"] = body.n  # the samples of a prompt share its KV (the scheduler waits for the first)
    given = [k for k in ("regex", "ebnf", "json_schema") if getattr(body, k) is not None]
    if len(given) > 1:
        raise APIError(400, f"give at most one of regex, ebnf, json_schema (got {', '.join(given)})", param=given[1])
    for k in given:
        sp[k] = getattr(body, k)
    return sp


def tokenize_prompt(engine, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a prompt; a text no context can hold is a 400 naming ``param``."""
    try:
        return engine.tokenize(text, add_special_tokens=add_special_tokens)
    except ValueError as exc:
        raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None


def predicted_text(body) -> str | None:
    """The predicted text of a request's ``prediction`` field, if any."""
    return body.prediction.text() if body.prediction is not None else None

