"""OpenAI ``/v1/chat/completions``: planning a chat request (template, tools, reasoning, cache
hints) and shaping its answer (message, tool calls, logprobs, streamed tool pieces)."""

from __future__ import annotations

from typing import Any

from radixlm.runtime.constrained.base import GrammarError
from radixlm.runtime.constrained.llguidance_backend import FORMATS as LLGUIDANCE_FORMATS
from radixlm.runtime.constrained.schema_rewrite import rewrite_schema
from radixlm.runtime.constrained.schema_strict import close_objects
from radixlm.runtime.entrypoints.http.common import ServerState
from radixlm.runtime.entrypoints.http.errors import APIError
from radixlm.runtime.entrypoints.openai import harmony, reasoning, tool_calls, tool_formats
from radixlm.runtime.entrypoints.openai.answers import finish_reason, token_entries, with_final_info
from radixlm.runtime.entrypoints.openai.plan import (
    Plan,
    predicted_text,
    sampling_params,
    tokenize_prompt,
)
from radixlm.runtime.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    NamedToolChoice,
    new_id,
)
from radixlm.runtime.entrypoints.openai.tool_call_stream import ToolCallStreamer
from radixlm.runtime.entrypoints.openai.tool_formats import ToolFormat
from radixlm.runtime.request import ReqOutput
from radixlm.runtime.tokenizer import RESERVED_TEMPLATE_KWARGS, apply_chat_template


def plan_chat(state: ServerState, body: ChatCompletionRequest) -> Plan:
    """The plan of a ``/v1/chat/completions`` request: the templated prompt and its constraints."""
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
    speaks_harmony = harmony.detect(engine.tokenizer, engine.args.reasoning_parser)
    renders = tool_calls.template_renders_tools(engine.tokenizer)
    tool_format = tool_formats.detect(engine.tokenizer) if renders else tool_formats.HERMES  # else our prompt teaches Hermes
    use_tools = tools if choice != "none" else []
    messages = tool_calls.template_messages(body.messages, use_tools, renders)
    reserved = sorted(set(body.chat_template_kwargs or {}) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
    template_kwargs = body.chat_template_kwargs
    if body.reasoning_effort is not None:  # GPT-OSS's template writes it into the system message; chat_template_kwargs wins
        template_kwargs = {"reasoning_effort": body.reasoning_effort, **(template_kwargs or {})}
    try:
        template_tools = [t.model_dump() for t in use_tools] if (renders and use_tools) else None
        text = apply_chat_template(engine.tokenizer, messages, tools=template_tools, template_kwargs=template_kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    except Exception as exc:  # the template itself rejected the conversation
        raise APIError(400, f"the chat template could not render these messages: {exc}", param="messages") from None
    ids = tokenize_prompt(engine, text, "messages", add_special_tokens=False)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sampling = sampling_params(state, body, max_tokens, len(ids))
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
            sampling.setdefault("close_json_within_budget", True)
        else:
            tool_mode = "auto"
            if not speaks_harmony:  # harmony's own turn grammar comes below
                sampling["ebnf"] = _auto_grammar(engine, sampling, tools, body.parallel_tool_calls, tool_format)
    thinking = None if speaks_harmony else reasoning.for_prompt(reasoning.detect(engine.tokenizer, engine.args.reasoning_parser), text)
    if speaks_harmony:
        _harmony_turn(engine, body, sampling, tool_mode, [named] if named is not None else tools)
    elif thinking is not None:
        auto_answer = _auto_grammar(engine, sampling, tools, body.parallel_tool_calls, tool_format, "answer") if tool_mode == "auto" else None
        _think_first(thinking, body, sampling, tool_mode, auto_answer)
    elif body.max_reasoning_tokens is not None:
        raise APIError(400, "max_reasoning_tokens needs a model whose chat template has a reasoning section", param="max_reasoning_tokens")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    return Plan(True, body.model or state.model_name, [ids], [text], sampling, body.n, body.stream, bool(body.stream_options and body.stream_options.include_usage), logprobs, reasoning=thinking, harmony=speaks_harmony, tool_mode=tool_mode, tool_name=named.function.name if named else None, tool_format=tool_format, cache_salt=body.cache_salt, prompt_cache_key=body.prompt_cache_key, return_cache_info=body.return_cache_info, retention=_retention(engine, body, messages, ids, template_tools, template_kwargs), prediction=predicted_text(body), bootstrap_room=body.bootstrap_room, priority=body.priority, id=new_id("chatcmpl"))


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
    elif kinds == ["json_schema"] and (tool_mode or _has_response_format(body)):
        answer = reasoning.json_answer(_answer_schema(sampling, param))
    elif not kinds and body.max_reasoning_tokens is not None:
        answer = ["answer: ANSWER", "ANSWER: /(?s:.*)/"]
    else:
        return  # free text (reasoning unbounded), or the extras regex/ebnf/json_schema: as given
    sampling["ebnf"] = reasoning.grammar(fmt, answer, body.max_reasoning_tokens)


def _has_response_format(body: ChatCompletionRequest) -> bool:
    return body.response_format is not None and body.response_format.type != "text"


def _answer_schema(sampling: dict[str, Any], param: str) -> Any:
    """Take the JSON schema out of ``sampling`` for an answer that follows free reasoning: closed
    unless not strict, and refused here (by ``param``) where llguidance cannot take it."""
    schema = sampling.pop("json_schema")
    sampling.pop("close_json_within_budget", None)  # the output starts with free reasoning, not JSON
    if sampling.pop("json_schema_strict", True):
        schema = close_objects(schema)
    try:  # refused here, by the field's name; the backend rewrites the %json lexeme itself (with warnings)
        rewrite_schema(schema, LLGUIDANCE_FORMATS)
    except GrammarError as exc:
        raise APIError(400, str(exc), param=param) from None
    return schema


def _harmony_turn(engine, body: ChatCompletionRequest, sampling: dict[str, Any], tool_mode: str | None, tools: list) -> None:
    """Shape a harmony model's turn (openai/harmony.py): markers kept in the text, and the
    constraint (tools, ``response_format``, ``max_reasoning_tokens``) applied to the answer
    message after an optional ``analysis`` one (a Lark grammar, as ``_think_first``'s)."""
    sampling["skip_special_tokens"] = False  # the parse reads the channel markers
    ids = harmony.marker_ids(engine.tokenizer)
    kinds = [k for k in ("regex", "ebnf", "json_schema") if k in sampling]
    if tool_mode is not None:
        for key in ("json_schema", "json_schema_strict", "close_json_within_budget"):
            sampling.pop(key, None)  # the call's arguments are the body of a commentary message
        turn = harmony.call_turn(ids, tools, text_too=tool_mode == "auto")
    elif kinds == ["json_schema"] and _has_response_format(body):
        turn = harmony.final_turn(ids, harmony.json_answer(_answer_schema(sampling, "response_format")))
    elif not kinds and body.max_reasoning_tokens is not None:
        turn = harmony.final_turn(ids, harmony.text_answer())
    else:
        return  # free text, or the extras regex/ebnf/json_schema: as given
    sampling["ebnf"] = harmony.grammar(ids, turn, body.max_reasoning_tokens)


def _retention(engine, body: ChatCompletionRequest, messages: list, ids: list[int], tools: list | None, template_kwargs: dict[str, Any] | None) -> list[tuple[int, float]]:
    """(prefix tokens, ttl) for each message with ``cache_control``: the prompt up to its end."""
    hints = []
    for i, message in enumerate(body.messages):
        if message.cache_control is None:
            continue
        if len(messages) != len(body.messages):  # the template merged messages: hint the whole prompt
            hints.append((len(ids), float(message.cache_control.ttl)))
            continue
        try:
            text = apply_chat_template(engine.tokenizer, messages[: i + 1], tools=tools, add_generation_prompt=False, template_kwargs=template_kwargs)
        except Exception as exc:
            raise APIError(400, f"messages[{i}].cache_control: the chat template could not render the prefix up to this message: {exc}", param=f"messages.{i}.cache_control") from None
        prefix = engine.tokenize(text, add_special_tokens=False)
        n = 0
        while n < min(len(prefix), len(ids)) and prefix[n] == ids[n]:
            n += 1
        if n:
            hints.append((n, float(message.cache_control.ttl)))
    return hints


def chat_choice(plan: Plan, index: int, out: ReqOutput) -> dict[str, Any]:
    """The ``choices`` entry of a finished chat output: its message (content, reasoning, tool calls)."""
    thought, content, calls = message_parts(plan, out)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thought is not None:
        message["reasoning_content"] = thought
    if calls:
        message["tool_calls"] = calls
    choice = {"index": index, "message": message, "finish_reason": finish_reason(plan, out, bool(calls))}
    choice["logprobs"] = chat_logprobs(out) if plan.logprobs is not None else None
    return with_final_info(plan, out, choice)


def message_parts(plan: Plan, out: ReqOutput) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """(reasoning, content, tool calls) of a finished chat output."""
    if plan.harmony:
        turn = harmony.read(out.text, cut=is_cut(out))
        return turn.reasoning, turn.content if turn.content or not turn.calls else None, harmony.openai_calls(turn)
    thought, answer = reasoning.split(plan.reasoning, out.text) if plan.reasoning else (None, out.text)
    content, calls = _tool_message(plan, answer)
    return thought, content, calls


def is_cut(out: ReqOutput) -> bool:
    """True when max_tokens stopped the output."""
    return (out.meta_info.get("finish_reason") or {}).get("type") == "length"


def _tool_message(plan: Plan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Content and tool calls of a finished chat output."""
    if plan.tool_mode is None:
        return text, []
    return tool_calls.parse_output(plan.tool_mode, text, plan.tool_name, plan.tool_format)


def chat_logprobs(out: ReqOutput) -> dict[str, Any]:
    """A chat choice's ``logprobs`` object (``content``: one entry per token)."""
    entries, tops = token_entries(out, False)
    content = []
    for (lp, _, tok), top in zip(entries, tops):
        content.append({
            "token": tok,
            "logprob": lp,
            "bytes": list(tok.encode()) if tok is not None else None,
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode()) if t is not None else None} for v, _, t in (top or [])],
        })
    return {"content": content}


def tool_pieces(plan: Plan, idx: int, out: ReqOutput, streamer: ToolCallStreamer) -> list[dict[str, Any]]:
    """The chunk choices for a new output of a tool-mode choice: content and call deltas, one a chunk.

    The last output's choices end the same way the non-streamed message does; its finish_reason
    comes from that message's calls (``"length"`` for a call cut by max_tokens, see tool_call_stream).
    """
    if not out.finished:
        return [{"index": idx, "delta": d, "logprobs": None, "finish_reason": None} for d in streamer.feed(out.text)]
    content, calls = _tool_message(plan, out.text)
    deltas = streamer.finish(out.text, content, calls) or [{}]
    last = len(deltas) - 1
    return [{"index": idx, "delta": d, "logprobs": None, "finish_reason": finish_reason(plan, out, bool(calls)) if i == last else None} for i, d in enumerate(deltas)]


def harmony_pieces(plan: Plan, idx: int, out: ReqOutput, streamer: harmony.HarmonyStreamer) -> list[dict[str, Any]]:
    """The chunk choices for a new output of a harmony choice: reasoning, content and call deltas,
    one a chunk; the last output's last one carries the finish_reason."""
    deltas = streamer.feed(out.text, final=out.finished, cut=is_cut(out))
    if not out.finished:
        return [{"index": idx, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    _, _, calls = message_parts(plan, out)
    deltas = deltas or [{}]
    last = len(deltas) - 1
    return [{"index": idx, "delta": d, "logprobs": None, "finish_reason": finish_reason(plan, out, bool(calls)) if i == last else None} for i, d in enumerate(deltas)]
