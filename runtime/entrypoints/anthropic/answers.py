"""The answer of a Messages request: content blocks (thinking, text, tool_use), ``stop_reason``
and ``usage`` (with ``cache_read_input_tokens``: the prompt tokens the radix cache served)."""

from __future__ import annotations

import json
from typing import Any

from radixlm.runtime.entrypoints.anthropic.plan import MessagesPlan
from radixlm.runtime.entrypoints.openai import harmony, reasoning, tool_calls
from radixlm.runtime.entrypoints.openai.chat import is_cut
from radixlm.runtime.entrypoints.openai.protocol import new_id
from radixlm.runtime.request import ReqOutput


def message_id() -> str:
    return "msg_" + new_id("x")[2:]


def tool_use_id(call_id: str) -> str:
    """Anthropic's spelling of a call id (``toolu_`` rather than ``call_``)."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's ``input`` object from its arguments text (an object: the schema is of type object)."""
    value = json.loads(arguments)
    return value if isinstance(value, dict) else {"value": value}


def usage(plan: MessagesPlan, out: ReqOutput | None, output_tokens: int | None = None) -> dict[str, Any]:
    """The ``usage`` object: the prompt split into computed and cache-read tokens."""
    prompt = len(plan.plan.prompts[0])
    cached = min(out.meta_info.get("cached_tokens", 0), prompt) if out is not None else 0
    produced = output_tokens if output_tokens is not None else (out.meta_info["completion_tokens"] if out is not None else 0)
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached, "output_tokens": produced}


def stop_reason(plan: MessagesPlan, out: ReqOutput, has_calls: bool) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a finished output."""
    fr = out.meta_info["finish_reason"] or {}
    if fr.get("type") == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    matched = fr.get("matched")
    if fr.get("type") == "stop" and isinstance(matched, str) and matched in plan.stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def split(plan: MessagesPlan, out: ReqOutput) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """(thinking, text, OpenAI-shaped calls) of a finished output."""
    p, text = plan.plan, out.text
    if p.harmony:
        turn = harmony.read(text, cut=is_cut(out))
        return turn.reasoning, turn.content, harmony.openai_calls(turn)
    thought, answer = reasoning.split(p.reasoning, text) if p.reasoning else (None, text)
    if p.tool_mode is None:
        return thought, answer, []
    content, calls = tool_calls.parse_output(p.tool_mode, answer, p.tool_name, p.tool_format)
    return thought, content, calls


def message(plan: MessagesPlan, out: ReqOutput) -> dict[str, Any]:
    """The ``message`` object of a finished request."""
    thought, text, calls = split(plan, out)
    content: list[dict[str, Any]] = []
    if thought:
        content.append({"type": "thinking", "thinking": "" if plan.omit_thinking else thought, "signature": ""})
    if text:
        content.append({"type": "text", "text": text})
    for c in calls:
        content.append({"type": "tool_use", "id": tool_use_id(c["id"]), "name": c["function"]["name"], "input": tool_input(c["function"]["arguments"])})
    reason, sequence = stop_reason(plan, out, bool(calls))
    return {"id": message_id(), "type": "message", "role": "assistant", "model": plan.model, "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": usage(plan, out)}
