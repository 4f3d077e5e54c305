"""Tool calls: prompting for them, constraining them, and parsing them out of generated text.

The call format of ``auto`` output is the model family's (``tool_formats``: Hermes/Qwen
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, Mistral ``[TOOL_CALLS][...]``,
Llama 3 ``{"name": ..., "parameters": {...}}``). For a template that renders ``tools`` itself,
tools go to the template; otherwise a system message describes them and the Hermes format.

- ``tool_choice="required"``: the whole output is constrained to a JSON array of calls (one at
  most when ``parallel_tool_calls`` is false), each valid against its tool's parameters.
- a named function: the output is constrained to that function's arguments object.
- ``"auto"``: free text, or (after text, where the format has an opening marker) calls in the
  family's format, each constrained to a valid call (a Lark grammar; llguidance backend).

Arguments are generated strictly: only the properties a tool's parameters declare, unless the
tool sets ``strict: false`` or its schema allows others explicitly.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from radixlm.runtime.constrained.schema_strict import close_objects
from radixlm.runtime.constrained.specs import lark_json
from radixlm.runtime.entrypoints.openai.protocol import ChatMessage, Tool
from radixlm.runtime.entrypoints.openai.tool_formats import ARGUMENT_KEYS, HERMES, ToolFormat
from radixlm.runtime.entrypoints.openai.tool_markers import CLOSE, OPEN


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """The schema generated arguments of ``tool`` follow: its parameters, closed to the declared
    properties unless the tool says ``strict: false`` (schema_strict.close_objects)."""
    params = tool.function.parameters
    return params if tool.function.strict is False else close_objects(params)


def call_schema(tool: Tool, args_key: str = "arguments") -> dict[str, Any]:
    """JSON schema of one call of ``tool``: its name and valid arguments (under ``args_key``)."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, args_key: arguments_schema(tool)},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _any_call(tools: list[Tool], args_key: str = "arguments") -> dict[str, Any]:
    return call_schema(tools[0], args_key) if len(tools) == 1 else {"anyOf": [call_schema(t, args_key) for t in tools]}


def required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """Schema of the output for ``tool_choice="required"``: a non-empty array of calls."""
    schema: dict[str, Any] = {"type": "array", "items": _any_call(tools), "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def auto_grammar(tools: list[Tool], start: str = "start", fmt: ToolFormat = HERMES, parallel: bool = True, marker_ids: dict[str, int] | None = None) -> str:
    """Lark grammar for ``tool_choice="auto"``: free text, or calls in ``fmt`` (one unless
    ``parallel``), after text where the format opens with a marker. ``marker_ids``: the markers
    that are tokens of their own, named by id (tool_formats.marker_ids). ``start`` names the
    start rule (to embed the grammar in a larger one)."""
    ids = marker_ids or {}
    lit = lambda text: f"<[{ids[text]}]>" if text in ids else json.dumps(text)  # noqa: E731
    if fmt.as_list:
        calls = [f"calls: {lark_json(required_schema(tools, parallel), ', ', ': ')}"]
    else:
        close = f" {lit(fmt.close)}" if fmt.close else ""
        between = lit(fmt.open) if fmt.close else json.dumps(fmt.separator)  # the next call's marker, or the separator
        more = f" (SP {between} SP call{close})*" if parallel else ""
        calls = [f"calls: call{close}{more}", f"call: {lark_json(_any_call(tools, fmt.args_key), ', ', ': ')}"]  # as the families write calls
    if not fmt.open:  # the answer is either text that does not begin like a call, or the calls
        head = [f"{start}: TEXT | SP calls", "TEXT: /(?s:.*)/ & ~/[ \\t\\r\\n]*[{](?s:.*)/"]
    else:
        no_marker = "TEXT: /(?s:.*)/ & ~/(?s:.*" + re.escape(fmt.open).replace("/", "\\/") + ".*)/"
        if fmt.open in ids:  # a token of its own: text, the token, the calls
            head = [f"{start}: TEXT | TEXT {lit(fmt.open)} SP calls", no_marker]
        else:  # spelled out: the text lexeme stops at the marker
            head = [f"{start}: TEXT | pre SP calls", no_marker, f"pre[stop={json.dumps(fmt.open)}]: /(?s:.*)/"]
    return "\n".join([*head, *calls, "SP: /[ \\t\\r\\n]*/"])


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


def _closed_outside_strings(text: str, pos: int, close: str) -> bool:
    """Whether ``close`` occurs in ``text[pos:]`` outside the JSON strings that begin there."""
    in_string = escaped = False
    for i in range(pos, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif text.startswith(close, i):
            return True
    return False


def _raw_call(text: str, pos: int) -> tuple[dict[str, Any], int]:
    """The call object at ``text[pos:]`` (whitespace first allowed) and where it ends."""
    pos = _WS.match(text, pos).end()
    body, end = _decoder.raw_decode(text, pos)
    name = body["name"]  # KeyError/TypeError: not a call
    args_key = next((k for k in ARGUMENT_KEYS if k in body), None)
    if args_key is None:
        raise KeyError("arguments")
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
    start, stop = spans[args_key]
    return make_call(name, text[start:stop]), end


def parse_required(text: str) -> list[dict[str, Any]]:
    """Calls from a ``required``-mode output (a JSON array of {name, arguments})."""
    if not isinstance(json.loads(text), list):
        raise TypeError("not an array of calls")
    return _array_calls(text, _WS.match(text).end())


def _array_calls(text: str, pos: int) -> list[dict[str, Any]]:
    """The calls of the array that opens at ``text[pos]``; of an array cut short, the whole
    calls before the cut (a call that is not one raises KeyError/TypeError)."""
    if not text.startswith("[", pos):
        raise TypeError("not an array of calls")
    calls = []
    i = _WS.match(text, pos + 1).end()
    while i < len(text) and text[i] != "]":
        try:
            call, i = _raw_call(text, i)
        except json.JSONDecodeError:
            break  # cut inside this call
        calls.append(call)
        i = _WS.match(text, i).end()
        if text.startswith(",", i):
            i += 1
        i = _WS.match(text, i).end()
    return calls


def parse_output(mode: str, text: str, name: str | None = None, fmt: ToolFormat = HERMES) -> tuple[str | None, list[dict[str, Any]]]:
    """Content and calls of a finished output in tool mode ``mode`` (``name``: the named function;
    ``fmt``: the family's format of ``auto`` output).

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
    return parse_auto(text, fmt)


def parse_auto(text: str, fmt: ToolFormat = HERMES) -> tuple[str | None, list[dict[str, Any]]]:
    """Split ``auto``-mode output into the text before the calls and the calls it contains.

    The text before a call keeps its leading whitespace and drops its trailing whitespace (a
    stream can send it as it comes); an output with no call is all content. Calls cut by
    max_tokens are left out (the whole ones before them stay)."""
    if fmt.as_list:
        return _parse_list(text, fmt)
    if not fmt.open:
        return _parse_bare(text, fmt)
    start = text.find(fmt.open)
    if start < 0:
        return text, []
    content = text[:start].rstrip() or None
    calls = []
    pos = start
    while text.startswith(fmt.open, pos):
        try:
            call, end = _raw_call(text, pos + len(fmt.open))
        except json.JSONDecodeError:
            if not _closed_outside_strings(text, pos + len(fmt.open), fmt.close):
                break  # cut by max_tokens inside the call (a marker inside a JSON string does not close it)
            return text, []
        except (KeyError, TypeError):
            return text, []
        end = _WS.match(text, end).end()
        if not text.startswith(fmt.close, end):
            break
        calls.append(call)
        pos = _WS.match(text, end + len(fmt.close)).end()
    return content, calls


def _parse_list(text: str, fmt: ToolFormat) -> tuple[str | None, list[dict[str, Any]]]:
    """Mistral: the text before the marker, and the JSON array of calls after it."""
    start = text.find(fmt.open)
    if start < 0:
        return text, []
    content = text[:start].rstrip() or None
    rest = start + len(fmt.open)
    if _WS.match(text, rest).end() == len(text):
        return content, []  # cut right after the marker
    try:
        return content, _array_calls(text, _WS.match(text, rest).end())
    except (KeyError, TypeError):
        return text, []


def _parse_bare(text: str, fmt: ToolFormat) -> tuple[str | None, list[dict[str, Any]]]:
    """Llama 3: an answer that begins with ``{`` is calls separated by ``fmt.separator``."""
    pos = _WS.match(text).end()
    if not text.startswith("{", pos):
        return text, []
    calls = []
    while True:
        try:
            call, end = _raw_call(text, pos)
        except json.JSONDecodeError:
            break  # cut by max_tokens inside a call
        except (KeyError, TypeError):
            return text, []
        calls.append(call)
        end = _WS.match(text, end).end()
        if not text.startswith(fmt.separator, end):
            break
        pos = _WS.match(text, end + len(fmt.separator)).end()
    return None, calls
