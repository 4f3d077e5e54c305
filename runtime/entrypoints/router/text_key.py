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


def routing_text(path: str, body: dict[str, Any]) -> str:
    """``/generate``: text (or input_ids joined); ``/v1/completions``: prompt; chat: the tools'
    JSON then one ``role: content`` line per message."""
    if path == "/v1/chat/completions":
        lines = [json.dumps(body["tools"], sort_keys=True)] if body.get("tools") else []
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                lines.append(f"{m.get('role', '')}: {_content_text(m.get('content'))}")
        return "\n".join(lines)
    key = "prompt" if path == "/v1/completions" else "text"
    value = _first(body.get(key))
    if isinstance(value, str):
        return value
    return _ids_text(value if value is not None else body.get("input_ids"))
