"""Planning a Responses request: its items (and the stored conversation it continues) become a
chat request, which the chat route plans (template, tools and their grammar, reasoning, format).

Items map onto chat messages one to one, except that function calls join the assistant message
before them (as the model wrote them: text, then calls) and reasoning items are dropped (chat
templates drop earlier turns' thinking). ``instructions`` become the first system message of
this request alone: a continuation does not inherit them (OpenAI's rule).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from radixlm.runtime.entrypoints.http.common import ServerState
from radixlm.runtime.entrypoints.http.errors import APIError
from radixlm.runtime.entrypoints.openai.chat import plan_chat
from radixlm.runtime.entrypoints.openai.plan import Plan
from radixlm.runtime.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    FunctionDef,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    Tool,
)
from radixlm.runtime.entrypoints.responses.protocol import FunctionChoice, ResponsesRequest
from radixlm.runtime.entrypoints.responses.store import StoredResponse

# the chat request's field -> the Responses request's, for errors that name one
_PARAMS = {"messages": "input", "response_format": "text.format", "json_schema": "text.format", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens"}


@dataclass
class ResponsePlan:
    """A planned Responses request: the chat plan, the request, and the conversation so far."""

    plan: Plan
    request: ResponsesRequest
    tenant: str | None
    items: list[dict[str, Any]]  # the continued conversation's items and this input's, each with an id (no instructions)


def new_item_id(prefix: str) -> str:
    """A fresh id of a response (``resp``) or an output item (``msg``, ``fc``, ``rs``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_error(err: APIError, formatted: bool = False) -> APIError:
    """``err`` naming the Responses request's field where it names the chat request's;
    ``formatted``: the request has a ``text.format``, which a schema error is about."""
    if formatted and err.param in ("messages", "response_format", "json_schema") and "json_schema" in err.message:
        detail = err.message.split(": ", 1)[1] if err.message.startswith(f"{err.param}: ") else err.message
        return APIError(err.status, f"text.format: {detail}", param="text.format", code=err.code)
    if err.param is None:
        return err
    head, _, rest = err.param.partition(".")
    name = _PARAMS.get(head)
    if name is None:
        return err
    message = name + err.message[len(head) :] if err.message.startswith(head) else err.message
    return APIError(err.status, message, param=name + ("." + rest if rest else ""), code=err.code)


def conversation(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of Responses items (input or output items, as JSON objects)."""
    messages: list[dict[str, Any]] = []
    joins = False  # the last message is an assistant's that calls may join
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item["role"], "content": _text(item["content"])})
            joins = item["role"] == "assistant"
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            if joins:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                joins = True
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
            joins = False
    return messages


_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as ``input_items`` lists it: with an id, and a message's text as content parts."""
    kind = item.get("type", "message")
    out = {"id": item.get("id") or new_item_id(_ITEM_ID_PREFIX[kind]), **{k: v for k, v in item.items() if k != "id"}}
    if kind == "message":
        part = "output_text" if item["role"] == "assistant" else "input_text"
        if isinstance(item["content"], str):
            out["content"] = [{"type": part, "text": item["content"]}]
        out.setdefault("status", "completed")
    return out


def _text(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)


def plan_response(state: ServerState, body: ResponsesRequest, previous: StoredResponse | None, tenant: str | None) -> ResponsePlan:
    """The plan of a ``POST /v1/responses``: the chat plan of the conversation it continues and its input."""
    refused = body.refused()
    if refused is not None:
        raise APIError(400, f"{refused} is not supported by this server", param=refused)
    if not body.input and previous is None:
        raise APIError(400, "input: give at least one input item (or a previous_response_id to continue)", param="input")
    items = (previous.conversation_items() if previous is not None else []) + [input_item(item.model_dump(exclude_none=True)) for item in body.input or []]
    messages = conversation(items)
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    try:
        chat = ChatCompletionRequest(
            model=body.model,
            messages=instructions + messages,
            max_completion_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            top_k=body.top_k,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            ignore_eos=body.ignore_eos,
            max_reasoning_tokens=body.max_reasoning_tokens,
            reasoning_effort=body.reasoning.effort if body.reasoning is not None else None,
            tools=[Tool(function=FunctionDef(name=t.name, description=t.description, strict=t.strict, **({"parameters": t.parameters} if t.parameters is not None else {}))) for t in body.tools] if body.tools else None,
            tool_choice=NamedToolChoice(function={"name": body.tool_choice.name}) if isinstance(body.tool_choice, FunctionChoice) else body.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
            response_format=_response_format(body),
            cache_salt=tenant,
            prompt_cache_key=body.prompt_cache_key,
            priority=body.priority,
            stream=body.stream,
            stream_options=StreamOptions(include_usage=True) if body.stream else None,
        )
    except ValidationError as exc:  # what only the whole conversation breaks (its message count)
        err = exc.errors(include_url=False)[0]
        raise APIError(400, f"input: the conversation cannot be planned: {err.get('msg')}", param="input") from None
    try:
        plan = plan_chat(state, chat)
    except APIError as err:
        raise responses_error(err) from None
    plan.id = new_item_id("resp")
    return ResponsePlan(plan, body, tenant, items)


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    """``text.format`` as the chat route's ``response_format``."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None:
        return None
    if fmt.type != "json_schema":
        return ResponseFormat(type=fmt.type)
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict))
