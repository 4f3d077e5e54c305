"""The text a request is routed by: what its prompt starts with, as the worker will see it."""

from __future__ import annotations

import json
from typing import Any


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "" if content is None else json.dumps(content, sort_keys=True)


def _first(value: Any) -> Any:
    """A batch's first prompt (the batch goes to one worker)."""
    return value[0] if isinstance(value, list) and value and isinstance(value[0], list | str) else value


def _ids_text(ids: Any) -> str:
    ids = _first(ids)
    return ",".join(str(i) for i in ids) + "," if isinstance(ids, list) else ""


def _message_lines(body: dict[str, Any], system: Any = None) -> str:
    """The tools' JSON, the system text (Anthropic's top-level ``system``), then one
    ``role: content`` line per message."""
    lines = [json.dumps(body["tools"], sort_keys=True)] if body.get("tools") else []
    if system is not None:
        lines.append(f"system: {_content_text(system)}")
    for m in body.get("messages") or []:
        if isinstance(m, dict):
            lines.append(f"{m.get('role', '')}: {_content_text(m.get('content'))}")
    return "\n".join(lines)


def routing_text(path: str, body: dict[str, Any]) -> str:
    """``/generate``: text (or input_ids joined); ``/v1/completions``: prompt; chat and Anthropic
    messages: the tools' JSON then one ``role: content`` line per message; embeddings: the (first)
    input; rerank and score: the query, which every pair starts from."""
    if path == "/v1/chat/completions":
        return _message_lines(body)
    if path.startswith("/v1/messages"):
        return _message_lines(body, body.get("system"))
    if path in ("/v1/rerank", "/v1/score"):
        query = body.get("query", body.get("text_1"))
        return _content_text(_first(query)) if query is not None else ""
    key = {"/v1/completions": "prompt", "/v1/embeddings": "input"}.get(path, "text")
    value = _first(body.get(key))
    if isinstance(value, str):
        return value
    return _ids_text(value if value is not None else body.get("input_ids"))
