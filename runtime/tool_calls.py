"""Tool calls: prompting for them, constraining them, and parsing them out of generated text.

The call format is the one many chat templates use: ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``. For a template that renders ``tools`` itself, tools go to the template;
otherwise a system message describes them and the format.

- ``tool_choice="required"``: the whole output is constrained to a JSON array of calls (one at
  most when ``parallel_tool_calls`` is false), each valid against its tool's parameters.
- a named function: the output is constrained to that function's arguments object.
- ``"auto"``: free text, but once the model opens ``<tool_call>`` the rest is constrained to a
  valid call and ``</tool_call>`` (a Lark grammar with a ``stop`` lexeme; llguidance backend).

Arguments are generated strictly: only the properties a tool's parameters declare, unless the
tool sets ``strict: false`` or its schema allows others explicitly.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from radixlm.runtime.constrained.schema_strict import close_objects
from radixlm.runtime.protocol import ChatMessage, Tool
from radixlm.runtime.tool_markers import CLOSE, OPEN


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """The schema generated arguments of ``tool`` follow: its parameters, closed to the declared
    properties unless the tool says ``strict: false`` (schema_strict.close_objects)."""
    params = tool.function.parameters
    return params if tool.function.strict is False else close_objects(params)


def call_schema(tool: Tool) -> dict[str, Any]:
    """JSON schema of one call of ``tool``: its name and valid arguments."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": arguments_schema(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _any_call(tools: list[Tool]) -> dict[str, Any]:
    return call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [call_schema(t) for t in tools]}


def required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """Schema of the output for ``tool_choice="required"``: a non-empty array of calls."""
    schema: dict[str, Any] = {"type": "array", "items": _any_call(tools), "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def auto_grammar(tools: list[Tool], start: str = "start") -> str:
    """Lark grammar for ``tool_choice="auto"``: free text, or text then one constrained call
    (``start``: the name of its start rule, for embedding it in a larger grammar)."""
    return "\n".join(
        [
            f'{start}: TEXT | pre call "</tool_call>"',
            "TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/",
            'pre[stop="<tool_call>"]: /(?s:.*)/',
            f"call: %json {json.dumps(_any_call(tools))}",
        ]
    )


def template_renders_tools(tokenizer) -> bool:
    """True when the model's chat template uses a ``tools`` variable."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def tools_system_prompt(tools: list[Tool]) -> str:
    """A system message that lists the tools and the call format, for templates without tools."""
    specs = [{"name": t.function.name, "description": t.function.description or "", "parameters": t.function.parameters} for t in tools]
    return (
        "You can call functions. The available functions are:\n"
        + "\n".join(json.dumps(s, ensure_ascii=False) for s in specs)
        + f'\nTo call a function, reply with {OPEN}{{"name": <function name>, "arguments": <arguments object>}}{CLOSE}.'
    )


def template_messages(messages: list[ChatMessage], tools: list[Tool] | None, renders_tools: bool) -> list[dict[str, Any]]:
    """Messages as chat-template dicts; tool calls become text where the template lacks tools."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": m.text()}
        if m.tool_calls:
            if renders_tools:
                msg["tool_calls"] = [
                    {"type": "function", "id": c.id, "function": {"name": c.function.name, "arguments": _loads_or_str(c.function.arguments)}}
                    for c in m.tool_calls
                ]
            else:
                msg["content"] += "".join(f'{OPEN}{{"name": {json.dumps(c.function.name)}, "arguments": {c.function.arguments}}}{CLOSE}' for c in m.tool_calls)
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    if tools and not renders_tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _loads_or_str(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def new_call_id() -> str:
    """A fresh tool call id (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI ``tool_calls`` entry."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


# Calls keep their arguments as the model wrote them (the raw JSON text, whitespace and escapes
# included), as the named mode does: a streamed call's argument pieces add up to the same text.
_decoder = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


def _raw_call(text: str, pos: int) -> tuple[dict[str, Any], int]:
    """The call object at ``text[pos:]`` (whitespace first allowed) and where it ends."""
    pos = _WS.match(text, pos).end()
    body, end = _decoder.raw_decode(text, pos)
    name, _ = body["name"], body["arguments"]  # KeyError/TypeError: not a call
    spans: dict[str, tuple[int, int]] = {}
    i = _WS.match(text, pos + 1).end()  # the object is valid JSON: walk its members
    while text[i] != "}":
        key, i = _decoder.raw_decode(text, i)
        i = _WS.match(text, _WS.match(text, i).end() + 1).end()  # past ':'
        value_end = _decoder.raw_decode(text, i)[1]
        spans[key] = (i, value_end)  # the last of duplicate keys wins, as in json.loads
        i = _WS.match(text, value_end).end()
        if text[i] == ",":
            i = _WS.match(text, i + 1).end()
    start, stop = spans["arguments"]
    return make_call(name, text[start:stop]), end


def parse_required(text: str) -> list[dict[str, Any]]:
    """Calls from a ``required``-mode output (a JSON array of {name, arguments})."""
    if not isinstance(json.loads(text), list):
        raise TypeError("not an array of calls")
    calls = []
    i = _WS.match(text, _WS.match(text).end() + 1).end()  # past '['
    while text[i] != "]":
        call, i = _raw_call(text, i)
        calls.append(call)
        i = _WS.match(text, i).end()
        if text[i] == ",":
            i += 1
        i = _WS.match(text, i).end()
    return calls


def parse_output(mode: str, text: str, name: str | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """Content and calls of a finished output in tool mode ``mode`` (``name``: the named function).

    A ``named`` or ``required`` output cut by max_tokens holds no whole call: no calls and no
    content (the partial JSON is not passed off as an answer; finish_reason says "length")."""
    try:
        if mode == "named":
            json.loads(text)
            return None, [make_call(name or "", text)]
        if mode == "required":
            return None, parse_required(text)
    except (json.JSONDecodeError, KeyError, TypeError):
        return None, []
    return parse_auto(text)


def parse_auto(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split ``auto``-mode output into the text before the call and the calls it contains.

    The text before a call keeps its leading whitespace and drops its trailing whitespace (a
    stream can send it as it comes); an output with no call is all content.
    """
    start = text.find(OPEN)
    if start < 0:
        return text, []
    content = text[:start].rstrip() or None
    calls = []
    pos = start
    while text.startswith(OPEN, pos):
        try:
            call, end = _raw_call(text, pos + len(OPEN))
        except json.JSONDecodeError:
            if text.find(CLOSE, pos) < 0:
                break  # cut by max_tokens inside the call
            return text, []
        except (KeyError, TypeError):
            return text, []
        end = _WS.match(text, end).end()
        if not text.startswith(CLOSE, end):
            break
        calls.append(call)
        pos = _WS.match(text, end + len(CLOSE)).end()
    return content, calls
