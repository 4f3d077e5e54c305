"""Models that think first: a reasoning section (``<think>...</think>``) before the answer.

A chat template that writes both markers marks a reasoning model (``--reasoning-parser auto``).
For such a model the chat routes answer with the reasoning apart, in ``reasoning_content``, and
the answer in ``content`` (or its tool calls), streamed or not.

A constraint (``response_format``, tools) then applies to the answer only: the output grammar
is "an optional reasoning section, then the constrained answer" (Lark, llguidance backend),
where the reasoning is free text without ``<`` (so it cannot open a marker or a tag), at most
``max_reasoning_tokens`` tokens when given, after which the closing marker is forced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.constrained.specs import lark_json
from radixlm.runtime.stop_regex import partial_stop_len


@dataclass(frozen=True)
class ReasoningFormat:
    """The markers around a reasoning section, and whether the prompt already opened one."""

    open: str = "<think>"
    close: str = "</think>"
    started: bool = False  # the generation prompt ends with ``open``: the output starts inside it


def detect(tokenizer, parser: str) -> ReasoningFormat | None:
    """The reasoning format of the model's chat template (``parser`` "auto"), or None ("none",
    or a template without both markers)."""
    if parser == "none":
        return None
    template = getattr(tokenizer, "chat_template", None) or ""
    fmt = ReasoningFormat()
    return fmt if fmt.open in template and fmt.close in template else None


def for_prompt(fmt: ReasoningFormat | None, prompt: str) -> ReasoningFormat | None:
    """``fmt`` for one rendered prompt: started when the prompt ends with the opening marker."""
    if fmt is None:
        return None
    return ReasoningFormat(fmt.open, fmt.close, prompt.rstrip().endswith(fmt.open))


def split(fmt: ReasoningFormat, text: str, final: bool = True) -> tuple[str | None, str]:
    """``(reasoning_content, content)`` of an output (None: it has no reasoning section).

    Each part, as an output grows, starts with what it was before (streams send the new end).
    While it grows (``final`` False) a trailing piece that may become a marker is held back; a
    finished output cut inside its reasoning has all its text as reasoning and no content."""
    if fmt.started:
        body = text
    else:
        stripped = text.lstrip()
        if not stripped.startswith(fmt.open):
            if not final and fmt.open.startswith(stripped):
                return None, ""  # may still become the opening marker
            return None, text
        body = stripped[len(fmt.open) :]
    end = body.find(fmt.close)
    if end >= 0:
        return body[:end].strip(), body[end + len(fmt.close) :].lstrip()
    if not final:  # held back: a piece of the closing marker, and trailing space (it may precede it)
        body = body[: len(body) - partial_stop_len(body, [fmt.close])]
    return body.strip(), ""


def grammar(fmt: ReasoningFormat, answer_rules: list[str], max_tokens: int | None = None) -> str:
    """Lark grammar: an optional reasoning section (required once the prompt opened it), then
    the rules ``answer_rules`` whose start symbol is ``answer``."""
    limit = f"[max_tokens={max_tokens}]" if max_tokens is not None else ""
    opening = "" if fmt.started else f"{json.dumps(fmt.open)} "
    return "\n".join(
        [
            "start: think SPACE answer" if fmt.started else "start: (think SPACE)? answer",
            f"think: {opening}thought {json.dumps(fmt.close)}",
            f"thought{limit}: THOUGHT",
            "THOUGHT: /[^<]*/",
            "SPACE: /[ \\t\\r\\n]*/",
            *answer_rules,
        ]
    )


def json_answer(schema: Any) -> list[str]:
    """Answer rules for a JSON value of ``schema``."""
    return [f"answer: {lark_json(schema)}"]
