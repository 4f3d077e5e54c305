"""OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` (blocking and streamed)."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixlm.runtime.constrained.base import GrammarError
from radixlm.runtime.constrained.llguidance_backend import FORMATS as LLGUIDANCE_FORMATS
from radixlm.runtime.constrained.schema_rewrite import rewrite_schema
from radixlm.runtime.constrained.schema_strict import close_objects
from radixlm.runtime.entrypoints.http.body import read_model, request_schema
from radixlm.runtime.entrypoints.http.common import (
    ServerState,
    Ticket,
    drained_error,
    error_event,
    stream_response,
    wait_final,
)
from radixlm.runtime.entrypoints.http.errors import APIError
from radixlm.runtime.entrypoints.openai import reasoning, tool_calls, tool_formats
from radixlm.runtime.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    new_id,
    now,
)
from radixlm.runtime.entrypoints.openai.tool_call_stream import ToolCallStreamer
from radixlm.runtime.entrypoints.openai.tool_formats import HERMES, ToolFormat
from radixlm.runtime.request import ReqOutput
from radixlm.runtime.tokenizer import apply_chat_template


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Register the OpenAI routes on ``app``."""

    @app.post("/v1/completions", openapi_extra=request_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = await read_model(request, CompletionRequest)
        return await _run(state, request, await asyncio.to_thread(_plan_completion, state, body))

    @app.post("/v1/chat/completions", openapi_extra=request_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        body = await read_model(request, ChatCompletionRequest)
        return await _run(state, request, await asyncio.to_thread(_plan_chat, state, body))


@dataclass
class _Plan:
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
    tool_mode: str | None = None  # "required", "named", "auto"
    tool_name: str | None = None
    tool_format: ToolFormat = HERMES  # how the model family writes ``auto`` calls
    cache_salt: str | None = None
    prompt_cache_key: str | None = None
    return_cache_info: bool = False
    retention: list[tuple[int, float]] = field(default_factory=list)  # (prefix tokens, ttl) per cache_control
    prediction: str | None = None  # the expected output (Predicted Outputs)
    bootstrap_room: int | None = None  # pairs the halves of a disaggregated request
    id: str = field(default_factory=lambda: new_id("cmpl"))


# ------------------------------------------------------------------ planning
def _sampling(state: ServerState, body, max_tokens: int | None, prompt_len: int) -> dict[str, Any]:
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
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"), ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"), ("repetition_penalty", "repetition_penalty"), ("min_new_tokens", "min_tokens"), ("ignore_eos", "ignore_eos"), ("stop_token_ids", "stop_token_ids"), ("skip_special_tokens", "skip_special_tokens"), ("seed", "seed")):
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


def _tokenize(engine, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a prompt; a text no context can hold is a 400 naming ``param``."""
    try:
        return engine.tokenize(text, add_special_tokens=add_special_tokens)
    except ValueError as exc:
        raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None


def _plan_completion(state: ServerState, body: CompletionRequest) -> _Plan:
    engine = state.engine
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    p = body.prompt
    if isinstance(p, str):
        texts = [p]
    elif p and all(isinstance(x, int) for x in p):
        texts = [None]
        p = [p]
    elif p and all(isinstance(x, str) for x in p):
        texts = list(p)
    elif p and all(isinstance(x, list) for x in p):
        texts = [None] * len(p)
    else:
        raise APIError(400, "prompt must be a non-empty string, list of strings, or token ids", param="prompt")
    state.check_fits(len(texts) * body.n, "n" if body.n > 1 else "prompt")  # before any prompt is tokenized
    prompts = []
    for i, t in enumerate(texts):
        ids = _tokenize(engine, t, "prompt") if t is not None else list(p[i])
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        bad = [x for x in ids if not 0 <= x < engine.config.vocab_size]
        if bad:
            raise APIError(400, f"prompt token {bad[0]} is outside the vocabulary", param="prompt")
        prompts.append(ids)
    texts = [t if t is not None else engine.tokenizer.decode(ids) for t, ids in zip(texts, prompts)]
    sampling = _sampling(state, body, body.max_tokens, max(len(x) for x in prompts))
    return _Plan(False, body.model or state.model_name, prompts, texts, sampling, body.n, body.stream, bool(body.stream_options and body.stream_options.include_usage), body.logprobs, echo=body.echo, cache_salt=body.cache_salt, prompt_cache_key=body.prompt_cache_key, return_cache_info=body.return_cache_info, prediction=_prediction(body), bootstrap_room=body.bootstrap_room)


def _plan_chat(state: ServerState, body: ChatCompletionRequest) -> _Plan:
    engine = state.engine
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    named = None
    if isinstance(choice, NamedToolChoice):
        named = next((t for t in tools if t.function.name == choice.function["name"]), None)
        if named is None:
            raise APIError(400, f"tool_choice names {choice.function['name']!r}, which is not in tools", param="tool_choice")
    renders = tool_calls.template_renders_tools(engine.tokenizer)
    tool_format = tool_formats.detect(engine.tokenizer) if renders else tool_formats.HERMES  # else our prompt teaches Hermes
    use_tools = tools if choice != "none" else []
    messages = tool_calls.template_messages(body.messages, use_tools, renders)
    try:
        template_tools = [t.model_dump() for t in use_tools] if (renders and use_tools) else None
        text = apply_chat_template(engine.tokenizer, messages, tools=template_tools)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    except Exception as exc:  # the template itself rejected the conversation
        raise APIError(400, f"the chat template could not render these messages: {exc}", param="messages") from None
    ids = _tokenize(engine, text, "messages", add_special_tokens=False)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sampling = _sampling(state, body, max_tokens, len(ids))
    constrained = [k for k in ("regex", "ebnf", "json_schema") if k in sampling]
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        if constrained:
            raise APIError(400, "response_format cannot be combined with regex, ebnf or json_schema", param="response_format")
        sampling["json_schema"] = fmt.json_schema.schema_ if fmt.type == "json_schema" else {"type": "object"}
        if fmt.type == "json_schema" and fmt.json_schema.strict is False:
            sampling["json_schema_strict"] = False  # undeclared properties may be generated
        constrained = ["json_schema"]
    tool_mode = None
    if tools and choice != "none":
        if constrained:
            raise APIError(400, "tools cannot be combined with response_format, regex, ebnf or json_schema", param="tools")
        sampling["json_schema_strict"] = False  # each tool's own strict setting applies (tool_calls.arguments_schema)
        if named is not None:
            tool_mode, sampling["json_schema"] = "named", tool_calls.arguments_schema(named)
        elif choice == "required":
            tool_mode, sampling["json_schema"] = "required", tool_calls.required_schema(tools, body.parallel_tool_calls)
        if tool_mode is not None:  # a whole call rather than one cut by max_tokens (constrained/budget.py)
            sampling["close_json_within_budget"] = True
        else:
            tool_mode, sampling["ebnf"] = "auto", _auto_grammar(engine, sampling, tools, body.parallel_tool_calls, tool_format)
    thinking = reasoning.for_prompt(reasoning.detect(engine.tokenizer, engine.args.reasoning_parser), text)
    if thinking is not None:
        auto_answer = _auto_grammar(engine, sampling, tools, body.parallel_tool_calls, tool_format, "answer") if tool_mode == "auto" else None
        _think_first(thinking, body, sampling, tool_mode, auto_answer)
    elif body.max_reasoning_tokens is not None:
        raise APIError(400, "max_reasoning_tokens needs a model whose chat template has a reasoning section", param="max_reasoning_tokens")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    return _Plan(True, body.model or state.model_name, [ids], [text], sampling, body.n, body.stream, bool(body.stream_options and body.stream_options.include_usage), logprobs, reasoning=thinking, tool_mode=tool_mode, tool_name=named.function.name if named else None, tool_format=tool_format, cache_salt=body.cache_salt, prompt_cache_key=body.prompt_cache_key, return_cache_info=body.return_cache_info, retention=_retention(engine, body, messages, ids, template_tools), prediction=_prediction(body), bootstrap_room=body.bootstrap_room, id=new_id("chatcmpl"))


def _auto_grammar(engine, sampling: dict[str, Any], tools: list, parallel: bool, fmt: ToolFormat, start: str = "start") -> str:
    """The ``tool_choice: "auto"`` grammar in the family's format; markers that are tokens of
    their own are named by id, and kept in the text where they are special tokens
    (skip_special_tokens off) so the parse finds them."""
    ids = tool_formats.marker_ids(engine.tokenizer, fmt)
    if set(ids.values()) & set(engine.tokenizer.all_special_ids):
        sampling["skip_special_tokens"] = False
    return tool_calls.auto_grammar(tools, start, fmt, parallel, ids)


def _think_first(fmt: reasoning.ReasoningFormat, body: ChatCompletionRequest, sampling: dict[str, Any], tool_mode: str | None, auto_answer: str | None) -> None:
    """Let a reasoning model think before its constrained answer: the response format's or the
    tools' constraint becomes the answer part of a reasoning grammar (Lark, compiled by
    llguidance whatever the grammar backend: constrained/lark_fallback.py); ``auto_answer``: the
    ``tool_choice: "auto"`` grammar, started at ``answer``."""
    kinds = [k for k in ("regex", "ebnf", "json_schema") if k in sampling]
    param = "tools" if tool_mode else "response_format"
    if auto_answer is not None:
        answer = [auto_answer]
    elif kinds == ["json_schema"] and (tool_mode or (body.response_format is not None and body.response_format.type != "text")):
        schema = sampling.pop("json_schema")
        sampling.pop("close_json_within_budget", None)  # the output starts with free reasoning, not JSON
        if sampling.pop("json_schema_strict", True):
            schema = close_objects(schema)
        try:  # refused here, by the field's name; the backend rewrites the %json lexeme itself (with warnings)
            rewrite_schema(schema, LLGUIDANCE_FORMATS)
        except GrammarError as exc:
            raise APIError(400, str(exc), param=param) from None
        answer = reasoning.json_answer(schema)
    elif not kinds and body.max_reasoning_tokens is not None:
        answer = ["answer: ANSWER", "ANSWER: /(?s:.*)/"]
    else:
        return  # free text (reasoning unbounded), or the extras regex/ebnf/json_schema: as given
    sampling["ebnf"] = reasoning.grammar(fmt, answer, body.max_reasoning_tokens)


def _prediction(body) -> str | None:
    """The predicted text of a request's ``prediction`` field, if any."""
    return body.prediction.text() if body.prediction is not None else None


def _retention(engine, body: ChatCompletionRequest, messages: list, ids: list[int], tools: list | None) -> list[tuple[int, float]]:
    """(prefix tokens, ttl) for each message with ``cache_control``: the prompt up to its end."""
    hints = []
    for i, message in enumerate(body.messages):
        if message.cache_control is None:
            continue
        if len(messages) != len(body.messages):  # the template merged messages: hint the whole prompt
            hints.append((len(ids), float(message.cache_control.ttl)))
            continue
        try:
            text = apply_chat_template(engine.tokenizer, messages[: i + 1], tools=tools, add_generation_prompt=False)
        except Exception as exc:
            raise APIError(400, f"messages[{i}].cache_control: the chat template could not render the prefix up to this message: {exc}", param=f"messages.{i}.cache_control") from None
        prefix = engine.tokenize(text, add_special_tokens=False)
        n = 0
        while n < min(len(prefix), len(ids)) and prefix[n] == ids[n]:
            n += 1
        if n:
            hints.append((n, float(message.cache_control.ttl)))
    return hints


# ------------------------------------------------------------------- running
async def _start(ticket: Ticket, plan: _Plan) -> list[tuple[int, Any, Any]]:
    """Queue ``n`` requests per prompt; returns (choice index, req, queue) triples."""
    started: list[tuple[int, Any, Any]] = []
    for p_i, ids in enumerate(plan.prompts):
        for k in range(plan.n):
            sp = dict(plan.sampling)
            if "seed" in sp and plan.n > 1:
                sp["seed"] = sp["seed"] + k
            try:
                req, q = await ticket.start(
                    "messages" if plan.chat else "prompt",
                    input_ids=ids,
                    sampling_params=sp,
                    return_logprob=plan.logprobs is not None,
                    top_logprobs_num=plan.logprobs or 0,
                    logprob_start_len=0 if (plan.echo and plan.logprobs is not None) else -1,
                    return_text_in_logprobs=plan.logprobs is not None,
                    stream=plan.stream,
                    **({"cache_salt": plan.cache_salt} if plan.cache_salt is not None else {}),
                    return_cache_info=plan.return_cache_info,
                    prompt_cache_key=plan.prompt_cache_key,
                    retention=plan.retention,
                    prediction=plan.prediction,
                    bootstrap_room=plan.bootstrap_room,
                )
            except APIError as err:
                raise _field_error(err, plan) from None
            started.append((p_i * plan.n + k, req, q))
    return started


_GRAMMAR_ERROR = re.compile(r"^(?:\w+: )?invalid (?:ebnf|json_schema): (?:at \d+\(\d+\): )?(?:failed to compile JSON schema: )?(.*)$", re.S)
_GRAMMAR_LINES = re.compile(r"\n\s*\d+ \|.*", re.S)  # the compiler's echo of our internal grammar


def _tool_error(err: APIError) -> APIError:
    """A grammar error of a tool call constraint, said of ``tools`` (what the client sent),
    without the internal grammar the tools were compiled into."""
    m = _GRAMMAR_ERROR.match(err.message)
    if m is None and not err.message.startswith(("json_schema: ", "ebnf: ")):
        return err
    detail = m.group(1) if m is not None else err.message.split(": ", 1)[1]
    detail = _GRAMMAR_LINES.sub("", detail).strip()
    return APIError(err.status, f"tools: a function's parameters are not a usable JSON schema: {detail}", param="tools", code=err.code)


def _field_error(err: APIError, plan: _Plan) -> APIError:
    """Rename engine-side fields to the OpenAI request's (json_schema -> tools, ...)."""
    if plan.tool_mode and err.param in ("json_schema", "ebnf", "messages"):
        return _tool_error(err)
    elif err.param == "json_schema" and plan.chat:
        err.param = "response_format"
    elif err.param == "max_new_tokens":
        err.param = "max_tokens"
    return err


async def _run(state: ServerState, request: Request, plan: _Plan) -> Response:
    total = len(plan.prompts) * plan.n
    ticket = Ticket(state, total, [], "n" if plan.n > 1 or len(plan.prompts) == 1 else "prompt")
    handed_off = False
    try:
        started = await _start(ticket, plan)
        if plan.stream:
            response = stream_response(_stream_events(ticket, plan, started), ticket.close)
            handed_off = True
            return response
        outs = await wait_final(ticket, request)
    finally:
        if not handed_off:
            ticket.close()
    choices = [_choice(state, plan, idx, out) for (idx, _, _), out in zip(started, outs)]
    body = {"id": plan.id, "object": "chat.completion" if plan.chat else "text_completion", "created": now(), "model": plan.model, "choices": choices, "usage": _usage(plan, outs)}
    return JSONResponse(body)


def _usage(plan: _Plan, outs: list[ReqOutput]) -> dict[str, Any]:
    prompt = sum(len(p) for p in plan.prompts)
    completion = sum(o.meta_info["completion_tokens"] for o in outs)
    cached = sum(o.meta_info["cached_tokens"] for o in outs[:: plan.n]) if outs else 0
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}
    if plan.prediction is not None:
        usage["completion_tokens_details"] = {name: sum(o.meta_info.get(name, 0) for o in outs) for name in ("accepted_prediction_tokens", "rejected_prediction_tokens")}
    passes = sum(o.meta_info.get("spec_verify_passes", 0) for o in outs)
    if passes:  # speculation ran (extra fields, as meta_info names them)
        usage["spec_verify_passes"] = passes
        usage["spec_draft_tokens"] = sum(o.meta_info.get("spec_draft_tokens", 0) for o in outs)
        usage["spec_accepted_tokens"] = sum(o.meta_info.get("spec_accepted_tokens", 0) for o in outs)
        usage["spec_accept_length"] = usage["spec_accepted_tokens"] / passes
    return usage


def _finish_reason(plan: _Plan, out: ReqOutput, has_calls: bool) -> str | None:
    fr = out.meta_info["finish_reason"]
    if fr is None:
        return None
    if has_calls and fr["type"] != "length":  # calls then a cut one (auto): "length", the whole ones kept
        return "tool_calls"
    if fr["type"] == "abort":
        return "abort"
    return "length" if fr["type"] == "length" else "stop"


def _tool_message(plan: _Plan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Content and tool calls of a finished chat output."""
    if plan.tool_mode is None:
        return text, []
    return tool_calls.parse_output(plan.tool_mode, text, plan.tool_name, plan.tool_format)


def _choice(state: ServerState, plan: _Plan, index: int, out: ReqOutput) -> dict[str, Any]:
    if plan.chat:
        thought, answer = reasoning.split(plan.reasoning, out.text) if plan.reasoning else (None, out.text)
        content, calls = _tool_message(plan, answer)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thought is not None:
            message["reasoning_content"] = thought
        if calls:
            message["tool_calls"] = calls
        choice = {"index": index, "message": message, "finish_reason": _finish_reason(plan, out, bool(calls))}
        choice["logprobs"] = _chat_logprobs(out) if plan.logprobs is not None else None
        return _with_final_info(plan, out, choice)
    text = out.text
    if plan.echo:
        text = plan.prompt_texts[index // plan.n] + text
    choice = {"index": index, "text": text, "finish_reason": _finish_reason(plan, out, False), "logprobs": _completion_logprobs(plan, out) if plan.logprobs is not None else None}
    return _with_final_info(plan, out, choice)


def _with_final_info(plan: _Plan, out: ReqOutput, choice: dict[str, Any]) -> dict[str, Any]:
    """Add to a finished request's choice its cache explanation (when the client asked for it)
    and what its constraint does not enforce (``constraint_warnings``, e.g. an ignored format)."""
    if plan.return_cache_info and out.finished and "cache_info" in out.meta_info:
        choice["cache_info"] = out.meta_info["cache_info"]
    if out.finished and out.meta_info.get("constraint_warnings"):
        choice["constraint_warnings"] = out.meta_info["constraint_warnings"]
    return choice


def _token_entries(out: ReqOutput, echo: bool) -> tuple[list, list]:
    meta = out.meta_info
    entries = list(meta.get("output_token_logprobs", []))
    tops = list(meta.get("output_top_logprobs", [None] * len(entries)))
    if echo:
        entries = list(meta.get("input_token_logprobs", [])) + entries
        tops = list(meta.get("input_top_logprobs", [None] * len(meta.get("input_token_logprobs", [])))) + tops
    return entries, tops


def _chat_logprobs(out: ReqOutput) -> dict[str, Any]:
    entries, tops = _token_entries(out, False)
    content = []
    for (lp, _, tok), top in zip(entries, tops):
        content.append({
            "token": tok,
            "logprob": lp,
            "bytes": list(tok.encode()) if tok is not None else None,
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode()) if t is not None else None} for v, _, t in (top or [])],
        })
    return {"content": content}


def _completion_logprobs(plan: _Plan, out: ReqOutput) -> dict[str, Any]:
    entries, tops = _token_entries(out, plan.echo)
    tokens, values, top_maps, offsets = [], [], [], []
    offset = 0
    for (lp, _, tok), top in zip(entries, tops):
        tokens.append(tok)
        values.append(lp)
        top_maps.append({t: v for v, _, t in top} if top else None)
        offsets.append(offset)
        offset += len(tok or "")
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top_maps, "text_offset": offsets}


# ------------------------------------------------------------------ streaming
async def _stream_events(ticket: Ticket, plan: _Plan, started: list[tuple[int, Any, Any]]) -> AsyncIterator[dict[str, Any]]:
    """OpenAI chunks, choices interleaved as their tokens arrive; a failure ends with an error event."""
    state = ticket.state
    kind = "chat.completion.chunk" if plan.chat else "text_completion"
    created = now()

    def chunk(choices: list[dict[str, Any]], usage: dict | None = None) -> dict[str, Any]:
        body = {"id": plan.id, "object": kind, "created": created, "model": plan.model, "choices": choices}
        if plan.include_usage:
            body["usage"] = usage
        return body

    sent = {idx: 0 for idx, _, _ in started}
    sent_lp = {idx: 0 for idx, _, _ in started}
    thought_sent = {idx: "" for idx, _, _ in started}  # reasoning_content streamed so far
    tools = {idx: ToolCallStreamer(plan.tool_mode, plan.tool_name, plan.tool_format) for idx, _, _ in started} if plan.chat and plan.tool_mode else None
    if plan.chat:
        first = None if plan.tool_mode in ("named", "required") else ""  # these answer with calls, not content
        yield chunk([{"index": idx, "delta": {"role": "assistant", "content": first}, "logprobs": None, "finish_reason": None} for idx, _, _ in started])
    elif plan.echo:
        yield chunk([{"index": idx, "text": plan.prompt_texts[idx // plan.n], "logprobs": None, "finish_reason": None} for idx, _, _ in started])
    pending = {asyncio.ensure_future(q.get()): (idx, q) for idx, _, q in started}
    stop = asyncio.ensure_future(state.drain_expired.wait())
    finals: list[ReqOutput] = []
    try:
        while pending:
            done, _ = await asyncio.wait({*pending, stop}, return_when=asyncio.FIRST_COMPLETED)
            if stop in done:
                yield error_event(drained_error())
                return
            for fut in done:
                idx, q = pending.pop(fut)
                out: ReqOutput = fut.result()
                if out.finished:
                    if (event := ticket.settle_stream(out)) is not None:
                        yield event
                        return
                    finals.append(out)
                else:
                    pending[asyncio.ensure_future(q.get())] = (idx, q)
                if plan.reasoning is not None:  # the reasoning goes first, apart; the rest sees the answer
                    thought, answer = reasoning.split(plan.reasoning, out.text, final=out.finished)
                    if thought and thought != thought_sent[idx] and thought.startswith(thought_sent[idx]):
                        yield chunk([{"index": idx, "delta": {"reasoning_content": thought[len(thought_sent[idx]) :]}, "logprobs": None, "finish_reason": None}])
                        thought_sent[idx] = thought
                    out = dataclasses.replace(out, text=answer)
                pieces = _tool_pieces(plan, idx, out, tools[idx]) if tools else [_stream_piece(state, plan, idx, out, sent, sent_lp)]
                pieces = [p for p in pieces if p is not None]
                for i, piece in enumerate(pieces):
                    yield chunk([_with_final_info(plan, out, piece) if i == len(pieces) - 1 else piece])
    finally:
        stop.cancel()
        for fut in pending:
            fut.cancel()
    if plan.include_usage:
        yield {"id": plan.id, "object": kind, "created": created, "model": plan.model, "choices": [], "usage": _usage(plan, finals)}


def _stream_piece(state: ServerState, plan: _Plan, idx: int, out: ReqOutput, sent: dict, sent_lp: dict) -> dict[str, Any] | None:
    """The chunk choice for a new output of choice ``idx`` (None when there is nothing to send)."""
    delta_text = out.text[sent[idx] :]
    sent[idx] = len(out.text)
    logprobs = None
    if plan.logprobs is not None:
        entries, tops = _token_entries(out, False)
        # entries[0] is output token ``first``: 0 when outputs carry cumulative entries, the
        # number already sent when a streamed output carries only the new ones
        first = getattr(out, "output_logprob_offset", 0)
        skip = max(sent_lp[idx] - first, 0)
        new = ReqOutput(out.rid, "", [], {"output_token_logprobs": entries[skip:], "output_top_logprobs": tops[skip:]}, False)
        sent_lp[idx] = first + len(entries)
        logprobs = _chat_logprobs(new) if plan.chat else _completion_logprobs(_Plan(**{**plan.__dict__, "echo": False}), new)
    if not plan.chat:
        if not delta_text and not out.finished:
            return None
        return {"index": idx, "text": delta_text, "logprobs": logprobs, "finish_reason": _finish_reason(plan, out, False) if out.finished else None}
    if not delta_text and not out.finished:
        return None
    return {"index": idx, "delta": {"content": delta_text} if delta_text else {}, "logprobs": logprobs, "finish_reason": _finish_reason(plan, out, False) if out.finished else None}


def _tool_pieces(plan: _Plan, idx: int, out: ReqOutput, streamer: ToolCallStreamer) -> list[dict[str, Any]]:
    """The chunk choices for a new output of a tool-mode choice: content and call deltas, one a chunk.

    The last output's choices end the same way the non-streamed message does; its finish_reason
    comes from that message's calls (``"length"`` for a call cut by max_tokens, see tool_call_stream).
    """
    if not out.finished:
        return [{"index": idx, "delta": d, "logprobs": None, "finish_reason": None} for d in streamer.feed(out.text)]
    content, calls = _tool_message(plan, out.text)
    deltas = streamer.finish(out.text, content, calls) or [{}]
    last = len(deltas) - 1
    return [{"index": idx, "delta": d, "logprobs": None, "finish_reason": _finish_reason(plan, out, bool(calls)) if i == last else None} for i, d in enumerate(deltas)]
