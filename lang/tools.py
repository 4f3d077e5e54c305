"""Tools: typed Python functions a program lets the model call, with valid-by-construction calls.

``@tool`` reads a function's signature (JSON schema via pydantic) and docstring (description;
a Google-style ``Args:`` section describes the parameters). ``gen(name, tools=[...])``
constrains the model to ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` for one of
the tools; ``call_tool`` runs the call and appends its result as the chat template's tool message.
A ReAct-style loop (TOOLS ends with a ``final_answer(answer: str)`` tool that returns its argument)::

    @radixlm.function
    def agent(s, question):
        s += radixlm.system("Use the tools.\\n" + radixlm.describe_tools(TOOLS))
        s += radixlm.user(question)
        for _ in range(4):
            s += radixlm.assistant(radixlm.gen("call", tools=TOOLS))
            if s["call"]["name"] == "final_answer":
                break
            s += radixlm.call_tool(s["call"], TOOLS)
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from radixlm.lang.ir import Constant, Expr, ExprList, RoleBegin, RoleEnd, SetVar
from radixlm.runtime.entrypoints.openai.tool_markers import CLOSE, OPEN

__all__ = ["CLOSE", "OPEN", "Tool", "as_tools", "call_tool", "calls_schema", "describe_tools", "run_call", "tool"]

# pydantic and the server's protocol models are imported where a tool is made or described, so
# that ``import radixlm`` stays light for programs that never define a tool.


@dataclass(frozen=True)
class Tool:
    """A Python function the model may call: its name, description and parameters' JSON schema."""

    fn: Callable[..., Any]
    name: str
    description: str
    parameters: dict[str, Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def invoke(self, arguments: dict[str, Any]) -> Any:
        """Call the function with ``arguments`` validated (and coerced) against its signature."""
        from pydantic import validate_call

        return validate_call(self.fn)(**arguments)

    def spec(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def call_schema(self) -> dict[str, Any]:
        """JSON schema of one call of this tool: ``{"name": <this name>, "arguments": {...}}``."""
        from radixlm.runtime.entrypoints.openai import tool_calls
        from radixlm.runtime.entrypoints.openai.protocol import Tool as ProtocolTool

        return tool_calls.call_schema(ProtocolTool.model_validate(self.spec()))


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None) -> Any:
    """Turn a typed function into a Tool (use as ``@tool`` or ``@tool(name=..., description=...)``)."""

    def make(f: Callable[..., Any]) -> Tool:
        from pydantic import TypeAdapter

        from radixlm.runtime.entrypoints.openai.protocol import Tool as ProtocolTool

        sig = inspect.signature(f)
        for p in sig.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
                raise TypeError(f"tool {f.__name__}: parameters must be named ({p.name} is {p.kind.description})")
        summary, arg_docs = _parse_docstring(inspect.getdoc(f) or "")
        schema = TypeAdapter(f).json_schema()
        schema.pop("title", None)
        for key, prop in schema.get("properties", {}).items():
            prop.pop("title", None)
            if key in arg_docs and "description" not in prop:
                prop["description"] = arg_docs[key]
        made = Tool(f, name or f.__name__, description if description is not None else summary, schema)
        try:
            ProtocolTool.model_validate(made.spec())
        except ValueError as exc:
            raise ValueError(f"tool {made.name!r} is not a valid OpenAI tool: {exc}") from None
        return made

    return make(fn) if fn is not None else make


def as_tools(tools: Sequence[Any]) -> list[Tool]:
    """Tools from Tool objects or plain typed functions; names must be unique."""
    out = [t if isinstance(t, Tool) else tool(t) for t in tools]
    if not out:
        raise ValueError("tools must not be empty")
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ValueError(f"tool names must be unique, got {names}")
    return out


def calls_schema(tools: Sequence[Tool]) -> dict[str, Any]:
    """JSON schema of a call of any of ``tools`` (``$defs`` lifted to the root so refs resolve)."""
    defs: dict[str, Any] = {}
    variants = []
    for t in tools:
        schema = t.call_schema()
        args = dict(schema["properties"]["arguments"])
        for key, value in args.pop("$defs", {}).items():
            if defs.get(key, value) != value:
                raise ValueError(f"tools define {key!r} differently; rename one of the types")
            defs[key] = value
        schema["properties"] = {**schema["properties"], "arguments": args}
        variants.append(schema)
    root: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**root, "$defs": defs} if defs else root


def describe_tools(tools: Sequence[Any]) -> str:
    """Text for a system message listing the tools and the call format (the server uses the same)."""
    from radixlm.runtime.entrypoints.openai import tool_calls
    from radixlm.runtime.entrypoints.openai.protocol import Tool as ProtocolTool

    return tool_calls.tools_system_prompt([ProtocolTool.model_validate(t.spec()) for t in as_tools(tools)])


def call_tool(call: dict[str, Any], tools: Sequence[Any], name: str | None = None, raise_errors: bool = False) -> Expr:
    """Run ``call`` (a ``gen(..., tools=...)`` result) now and return the tool message to append.

    The result is JSON-encoded (strings as they are) inside the chat template's tool role (the
    user role for templates without one). A tool that raises becomes an ``error: ...`` result the
    model can read, unless ``raise_errors``. With ``name``, the result is also stored as ``s[name]``.
    """
    result, text, error = run_call(call, tools)
    if error is not None and raise_errors:
        raise error
    items: list[Expr] = [RoleBegin("tool"), Constant(text), RoleEnd("tool")]
    if name is not None:
        items.append(SetVar(name, result, {"tool": call["name"], "text": text}))
    return ExprList(items)


def run_call(call: dict[str, Any], tools: Sequence[Any]) -> tuple[Any, str, Exception | None]:
    """Run one call: ``(result, text for the model, the exception the tool raised or None)``.

    A call of a tool not in ``tools`` raises ValueError; a tool that raises gives the text
    ``error: <type>: <message>`` for the model to read.
    """
    by_name = {t.name: t for t in as_tools(tools)}
    if not isinstance(call, dict) or call.get("name") not in by_name:
        raise ValueError(f"call_tool: {call!r} does not call one of {sorted(by_name)}")
    try:
        result = by_name[call["name"]].invoke(call.get("arguments") or {})
        return result, result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str), None
    except Exception as exc:
        return None, f"error: {type(exc).__name__}: {exc}", exc


_ARG_LINE = re.compile(r"^(\s+)(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The summary paragraph and a Google-style ``Args:`` section's parameter descriptions."""
    first = doc.strip().split("\n\n")[0]
    summary = "" if first.strip() in ("Args:", "Arguments:", "Parameters:") else " ".join(first.split())
    lines = doc.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:", "Parameters:")]
    args: dict[str, str] = {}
    if not starts:
        return summary, args
    current, indent = None, None
    for line in lines[starts[0] + 1 :]:
        if line.strip() and not line[0].isspace():
            break  # the next section
        m = _ARG_LINE.match(line)
        if m and (indent is None or len(m.group(1)) <= indent):
            indent, current = len(m.group(1)), m.group(2)
            args[current] = m.group(3).strip()
        elif current is not None and line.strip():
            args[current] = (args[current] + " " + line.strip()).strip()
    return summary, args
