"""Shaping a Responses answer: output items from the chat route's message, usage, and the
``response`` object (what ``POST`` answers, streams start and end with, and ``GET`` returns)."""

from __future__ import annotations

import time
from typing import Any

from radixlm.runtime.engine import Engine
from radixlm.runtime.entrypoints.responses.plan import ResponsePlan, new_item_id


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    """An assistant ``message`` output item holding one ``output_text`` part."""
    return {"id": item_id or new_item_id("msg"), "type": "message", "role": "assistant", "status": status, "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    """An ``output_text`` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    """A ``function_call`` output item."""
    return {"id": item_id or new_item_id("fc"), "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def reasoning_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    """A ``reasoning`` output item holding the model's thinking as one ``reasoning_text`` part."""
    return {"id": item_id or new_item_id("rs"), "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": status}


def output_items(message: dict[str, Any], finish_reason: str | None) -> list[dict[str, Any]]:
    """The output items of a chat choice's message: reasoning, text, then calls (as written)."""
    status = "incomplete" if finish_reason == "length" else "completed"
    items = []
    if message.get("reasoning_content") is not None:
        items.append(reasoning_item(message["reasoning_content"], "completed" if message.get("content") or message.get("tool_calls") else status))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(message.get("content") or "", status if not calls else "completed"))
    for call in calls:
        items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"], "completed"))
    return items


def reasoning_tokens(engine: Engine, output: list[dict[str, Any]]) -> int:
    """How many output tokens the reasoning items hold (their text re-tokenized; 0 when none)."""
    text = "".join(part["text"] for item in output if item["type"] == "reasoning" for part in item.get("content") or [])
    if not text:
        return 0
    try:
        return len(engine.tokenize(text, add_special_tokens=False))
    except ValueError:
        return 0


def response_usage(chat_usage: dict[str, Any] | None, reasoning_tokens: int = 0) -> dict[str, Any] | None:
    """Responses ``usage`` from the chat route's (input/output tokens, cached tokens)."""
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, chat_usage["completion_tokens"])},
        "total_tokens": chat_usage["total_tokens"],
    }


def response_body(rp: ResponsePlan, created_at: float, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``response`` object, echoing the request's settings as OpenAI does."""
    body = rp.request
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text is not None and body.text.format is not None else {"type": "text"}
    choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
    incomplete = status == "incomplete"
    return {
        "id": rp.plan.id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": time.time() if status in ("completed", "incomplete") else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": rp.plan.model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning.model_dump() if body.reasoning is not None else {"effort": None, "summary": None},
        "store": body.store,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "text": {"format": fmt},
        "tool_choice": choice if choice is not None else ("auto" if body.tools else "none"),
        "tools": [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters, "strict": t.strict if t.strict is not None else True} for t in body.tools or []],
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "truncation": "disabled",
        "usage": usage,
        "user": body.user,
        "metadata": body.metadata or {},
    }
