"""A Messages request as the chat route's plan: the conversation becomes chat messages (tool
uses become the assistant's tool calls, tool results ``tool`` messages), the tools and
``tool_choice`` the chat route's (so calls are constrained by its grammar: valid by
construction), ``thinking`` its reasoning budget. The chat planner does the rest (template,
context checks, constraints, retention hints), and its field names are mapped back to these.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from radixlm.runtime.entrypoints.anthropic.protocol import (
    CacheControl,
    CountTokensRequest,
    MessagesRequest,
    OtherBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from radixlm.runtime.entrypoints.http.common import ServerState
from radixlm.runtime.entrypoints.http.errors import APIError, validation_error
from radixlm.runtime.entrypoints.openai import harmony, reasoning
from radixlm.runtime.entrypoints.openai.chat import plan_chat
from radixlm.runtime.entrypoints.openai.plan import Plan
from radixlm.runtime.entrypoints.openai.protocol import ChatCompletionRequest

# the chat request's fields, as this request names them
_FIELDS = {"max_reasoning_tokens": "thinking.budget_tokens", "chat_template_kwargs": "thinking", "stop": "stop_sequences", "response_format": "output_config.format"}


@dataclass
class MessagesPlan:
    """The chat plan of a Messages request, and what the answer's shape needs besides."""

    plan: Plan
    model: str
    stop_sequences: list[str]
    omit_thinking: bool = False  # thinking.display "omitted": thinking blocks without their text


def plan_messages(state: ServerState, body: MessagesRequest | CountTokensRequest) -> MessagesPlan:
    """The plan of a ``/v1/messages`` (or ``count_tokens``) request; a 400 names its field."""
    engine = state.engine
    messages = _chat_messages(body)
    if not any(m["role"] != "system" for m in messages):
        raise APIError(400, "messages: nothing to answer (only thinking blocks, which are dropped)", param="messages")
    if body.cache_control is not None and "cache_control" not in messages[-1]:  # automatic caching: the whole prompt
        messages[-1]["cache_control"] = {"type": "ephemeral", "ttl": body.cache_control.seconds()}
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "cache_salt": body.cache_salt}
    tools = body.tools or []
    names = [t.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise APIError(400, f"tools.{i}.name: tool names must be unique ({name!r} repeats)", param=f"tools.{i}.name")
    for i, t in enumerate(tools):
        if t.input_schema.get("type") != "object":
            raise APIError(400, f"tools.{i}.input_schema: must be a JSON schema of type 'object'", param=f"tools.{i}.input_schema")
    if tools:
        fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema, "strict": t.strict}} for t in tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise APIError(400, "tool_choice.name: a tool choice of type 'tool' needs the tool's name", param="tool_choice.name")
            if choice.name not in names:
                raise APIError(400, f"tool_choice.name: {choice.name!r} is not one of the tools", param="tool_choice.name")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice.name is not None:
            raise APIError(400, f"tool_choice.name: only a tool choice of type 'tool' names a tool (this one is {choice.type!r})", param="tool_choice.name")
        elif choice.type in ("auto", "any") and not tools:
            raise APIError(400, f"tool_choice: {choice.type!r} needs tools", param="tool_choice")
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    thinking = body.thinking
    if thinking is not None:
        has_reasoning = reasoning.detect(engine.tokenizer, engine.args.reasoning_parser) is not None or harmony.detect(engine.tokenizer, engine.args.reasoning_parser)
        if thinking.type == "disabled":
            if thinking.budget_tokens is not None:
                raise APIError(400, "thinking.budget_tokens: only enabled thinking takes a budget", param="thinking.budget_tokens")
            fields["chat_template_kwargs"] = {"enable_thinking": False}  # Qwen3's switch; other templates ignore it
        elif not has_reasoning:
            raise APIError(400, "thinking: the served model has no reasoning section (its chat template has no <think> markers nor harmony channels, or the server runs with --reasoning-parser none)", param="thinking")
        elif thinking.type == "enabled":
            if thinking.budget_tokens is None:
                raise APIError(400, "thinking.budget_tokens: enabled thinking needs a budget", param="thinking.budget_tokens")
            if isinstance(body, MessagesRequest) and thinking.budget_tokens >= body.max_tokens:
                raise APIError(400, f"thinking.budget_tokens: must be less than max_tokens ({body.max_tokens})", param="thinking.budget_tokens")
            fields["max_reasoning_tokens"] = thinking.budget_tokens
        elif thinking.budget_tokens is not None:
            raise APIError(400, f"thinking.budget_tokens: {thinking.type} thinking takes no budget", param="thinking.budget_tokens")
    if body.output_config is not None and body.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": body.output_config.format.schema_}}
    stops: list[str] = []
    if isinstance(body, MessagesRequest):
        stops = list(body.stop_sequences or [])
        fields.update(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, stream=body.stream, bootstrap_room=body.bootstrap_room, priority=body.priority)
        if body.top_k is not None:
            fields["top_k"] = body.top_k if body.top_k > 0 else -1  # 0: no top-k cut (the chat route's -1)
        if stops:
            fields["stop"] = stops
    try:
        request = ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # not expected: the fields were checked as this request's
        raise APIError(400, f"the request could not be translated: {validation_error(exc.errors(include_url=False)).message}") from None
    try:
        plan = plan_chat(state, request)
    except APIError as err:
        raise renamed(err) from None
    return MessagesPlan(plan, body.model, stops, omit_thinking=thinking is not None and thinking.display == "omitted")


def renamed(err: APIError) -> APIError:
    """An error of the chat planner or the engine, naming this request's field."""
    ours = _FIELDS.get(err.param or "")
    if ours is not None:
        message = err.message
        if not message.startswith(ours):
            message = f"{ours}: {message.removeprefix(f'{err.param}: ')}"
        return APIError(err.status, message, param=ours, code=err.code)
    return err


def _cache_control(blocks: list) -> dict[str, Any] | None:
    """The chat message's ``cache_control`` from its blocks' (the prompt up to the message's end)."""
    marks: list[CacheControl] = [b.cache_control for b in blocks if getattr(b, "cache_control", None) is not None]
    return {"type": "ephemeral", "ttl": max(m.seconds() for m in marks)} if marks else None


def _flush_user(out: list[dict[str, Any]], pending: list[TextBlock]) -> None:
    """The user text gathered so far as one user message (emptying ``pending``)."""
    if pending:
        out.append({"role": "user", "content": "".join(b.text for b in pending), "cache_control": _cache_control(pending)})
        pending.clear()


def _text(blocks: list, path: str) -> str:
    """The text of a list of text blocks (a tool result's content)."""
    parts = []
    for j, b in enumerate(blocks):
        if not isinstance(b, TextBlock):
            raise APIError(400, f"{path}.{j}.type: {b.type!r} blocks are not supported in a tool result (this server serves a text model)", param=f"{path}.{j}.type")
        parts.append(b.text)
    return "".join(parts)


def _chat_messages(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages (OpenAI's shape, as the chat planner takes them)."""
    out: list[dict[str, Any]] = []
    if body.system is not None:
        system = [TextBlock(type="text", text=body.system)] if isinstance(body.system, str) else body.system
        if system:
            out.append({"role": "system", "content": "".join(b.text for b in system), "cache_control": _cache_control(system)})
    calls: dict[str, str] = {}  # tool_use id -> tool name, of the calls so far
    last = len(body.messages) - 1
    for i, m in enumerate(body.messages):
        path = f"messages.{i}"
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if i == last and m.role == "assistant":
            raise APIError(400, f"{path}.role: the last message must be the user's (a final assistant message, to prefill the answer, is not supported)", param=f"{path}.role")
        for j, b in enumerate(blocks):
            if isinstance(b, OtherBlock):
                raise APIError(400, f"{path}.content.{j}.type: {b.type!r} blocks are not supported (this server serves a text model and runs no server tools)", param=f"{path}.content.{j}.type")
            if isinstance(b, ToolUseBlock) and m.role != "assistant":
                raise APIError(400, f"{path}.content.{j}: tool_use blocks belong in assistant messages", param=f"{path}.content.{j}")
            if isinstance(b, ToolResultBlock) and m.role != "user":
                raise APIError(400, f"{path}.content.{j}: tool_result blocks belong in user messages", param=f"{path}.content.{j}")
        if m.role == "assistant":
            text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
            uses = [b for b in blocks if isinstance(b, ToolUseBlock)]
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if uses:
                msg["tool_calls"] = [{"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input, ensure_ascii=False)}} for u in uses]
                calls.update((u.id, u.name) for u in uses)
            msg["cache_control"] = _cache_control(blocks)
            out.append(msg)
            continue
        pending: list[TextBlock] = []  # user text, sent as one message between tool results
        for j, b in enumerate(blocks):
            if isinstance(b, TextBlock):
                pending.append(b)
            elif isinstance(b, ToolResultBlock):
                _flush_user(out, pending)
                if b.tool_use_id not in calls:
                    raise APIError(400, f"{path}.content.{j}.tool_use_id: {b.tool_use_id!r} answers no tool_use block of an earlier assistant message", param=f"{path}.content.{j}.tool_use_id")
                result = b.content if isinstance(b.content, str) else _text(b.content, f"{path}.content.{j}.content")
                if b.is_error:
                    result = f"Error: {result}"
                out.append({"role": "tool", "content": result, "tool_call_id": b.tool_use_id, "name": calls[b.tool_use_id], "cache_control": _cache_control([b])})
            elif isinstance(b, ThinkingBlock):
                continue
        _flush_user(out, pending)
    for msg in out:
        if msg.get("cache_control") is None:
            msg.pop("cache_control", None)
    return out
