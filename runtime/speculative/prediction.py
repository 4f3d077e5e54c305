"""OpenAI's ``prediction`` (Predicted Outputs): the text a client expects, proposed as drafts."""

from __future__ import annotations

from typing import Any


def prediction_text(value: Any) -> str | None:
    """The predicted text of ``value``: a string, or OpenAI's
    ``{"type": "content", "content": str | [{"type": "text", "text": str}, ...]}``.

    None stays None; any other shape is a ValueError naming the ``prediction`` field.
    """
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"prediction must be a string or an object {{type: 'content', content: ...}}, got {type(value).__name__}")
    extra = sorted(set(value) - {"type", "content"})
    if extra:
        raise ValueError(f"prediction has an unknown field {extra[0]!r} (it takes type and content)")
    if value.get("type") != "content":
        raise ValueError(f"prediction.type must be 'content', got {value.get('type')!r}")
    content = value.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("prediction.content must be a string or a list of text parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise ValueError(f"prediction.content[{i}] must be {{type: 'text', text: str}}")
        texts.append(part["text"])
    return "".join(texts)
