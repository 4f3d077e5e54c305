"""GPT-OSS's ``harmony`` chat format: an assistant turn's channels read into reasoning, content
and tool calls, and the grammars that constrain its answer.

A harmony model answers in messages, each a header and a body::

    <|channel|>analysis<|message|>The user asks for the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the generation prompt already wrote the first message's ``<|start|>assistant``). The header
names the **channel** (``analysis``: the model's reasoning; ``final``: the answer shown to the
user; ``commentary``: tool calls, and preambles before them) and, for a tool call, its
**recipient** (``to=functions.NAME``, in the channel part or right after the role). A body ends at
``<|end|>`` (another message follows), ``<|return|>`` (the turn is over) or ``<|call|>`` (a tool
call waits for its result); the last two end generation, so they are not in the output text.

Read as an OpenAI message:

- ``analysis`` bodies, joined by newlines, are ``reasoning_content``;
- ``final`` bodies, and ``commentary`` bodies addressed to nobody (preambles), are ``content``;
- a body addressed to a recipient is a tool call: ``functions.NAME`` calls ``NAME``, any other
  recipient (a built-in tool such as ``browser.search``) is called by its whole name; the body,
  as written, is the call's ``arguments``. A call cut by ``max_tokens`` is left out.
- text before any header (a constraint that forced plain JSON, say) is content.

The markers are special tokens, so a harmony request decodes with ``skip_special_tokens`` off
(the parse needs them); each arrives whole, never split over two stream pieces.

Constraints (``response_format``, tools, ``max_reasoning_tokens``) apply to the answer, not to
the reasoning: the grammar lets the model think in one ``analysis`` message (at most
``max_reasoning_tokens`` tokens when given), then forces a ``final`` message whose body is the
constrained answer, or a ``commentary`` message addressed to one of the tools whose body is that
tool's arguments. Markers are named by token id (llguidance matches an added token only so).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.constrained.specs import lark_json
from radixlm.runtime.entrypoints.openai.tool_calls import arguments_schema, new_call_id

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
_BODY_END = re.compile("|".join(re.escape(m) for m in (END, RETURN, CALL)))
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_HEADER_START = (START, CHANNEL, CONSTRAIN)


def detect(tokenizer, parser: str) -> bool:
    """True when the model's chat template writes harmony (its channel and message markers) and
    ``parser`` (``--reasoning-parser``) is not ``none``."""
    if parser == "none":
        return False
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):  # a dict of named templates
        template = "".join(str(t) for t in template.values()) if isinstance(template, dict) else str(template)
    return CHANNEL in template and MESSAGE in template


@dataclass
class Message:
    """One message of an assistant turn: its header's channel and recipient, and its body."""

    channel: str | None
    recipient: str | None
    body: str
    ended: bool  # its end marker was read (or the output finished without a cut)


@dataclass
class Turn:
    """An assistant turn read as an OpenAI message: reasoning, content and tool calls ``(name, arguments)``."""

    reasoning: str | None
    content: str
    calls: list[tuple[str, str]] = field(default_factory=list)


def _header(text: str) -> tuple[str | None, str | None]:
    """The channel and recipient a message header names."""
    channel = _CHANNEL_NAME.search(text)
    recipient = _RECIPIENT.search(text)
    return (channel.group(1) if channel else None), (recipient.group(1) if recipient else None)


def messages(text: str, final: bool = True, cut: bool = False) -> list[Message]:
    """The messages of an assistant turn's output ``text`` (markers kept).

    While the output grows (``final`` False) a message whose header is not complete is not
    returned yet, and the last body is open. A finished output's last body counts as ended
    unless ``cut`` (max_tokens stopped it)."""
    out: list[Message] = []
    pos = 0
    while pos < len(text):
        rest = text[pos:]
        if not rest.lstrip().startswith(_HEADER_START) and not rest.lstrip().startswith("to="):
            if not final and not rest.strip() and not out:
                break  # whitespace before a header may still come
            if not final and any(m.startswith(rest) for m in _HEADER_START):
                break  # held: this may become a header
            out.append(Message(None, None, rest, final and not cut))  # plain text: content
            break
        body_at = text.find(MESSAGE, pos)
        if body_at < 0:
            break  # a header not finished: nothing of it yet (a cut one has no body to show)
        channel, recipient = _header(text[pos:body_at])
        start = body_at + len(MESSAGE)
        end = _BODY_END.search(text, start)
        if end is None:
            out.append(Message(channel, recipient, text[start:], final and not cut))
            break
        out.append(Message(channel, recipient, text[start : end.start()], True))
        pos = end.end()
    return out


def read(text: str, final: bool = True, cut: bool = False) -> Turn:
    """The reasoning, content and calls of an output (see the module's docstring); a call
    whose body has not ended (cut, or still growing) is not among the calls."""
    thoughts: list[str] = []
    content = ""
    calls: list[tuple[str, str]] = []
    for m in messages(text, final, cut):
        if m.recipient is not None:
            if m.ended:
                calls.append((m.recipient.removeprefix("functions."), m.body))
        elif m.channel == "analysis":
            thoughts.append(m.body)
        else:
            content += m.body
    return Turn("\n".join(thoughts) if thoughts else None, content, calls)


def openai_calls(turn: Turn) -> list[dict[str, Any]]:
    """The turn's calls as OpenAI ``tool_calls`` entries."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}} for name, args in turn.calls]


class HarmonyStreamer:
    """Stream deltas (``reasoning_content``, ``content``, ``tool_calls`` pieces) of a growing
    harmony output, adding up to what ``read`` gives for the finished one.

    A call opens (its id and name) once its header is complete, and its arguments stream as its
    body grows; a call cut by max_tokens is not taken back (the non-streamed answer leaves it
    out, and both end with finish_reason ``"length"``)."""

    def __init__(self) -> None:
        self._thought = ""
        self._content = ""
        self._calls: list[tuple[str, str]] = []  # (id, arguments sent) per opened call

    def feed(self, text: str, final: bool = False, cut: bool = False) -> list[dict[str, Any]]:
        """The new deltas for ``text``, the whole output so far (``final``: it has finished)."""
        out: list[dict[str, Any]] = []
        thoughts: list[str] = []
        content = ""
        n_call = 0
        for m in messages(text, final, cut):
            if m.recipient is not None:
                if n_call == len(self._calls):
                    self._calls.append((new_call_id(), ""))
                    name = m.recipient.removeprefix("functions.")
                    out.append({"tool_calls": [{"index": n_call, "id": self._calls[n_call][0], "type": "function", "function": {"name": name, "arguments": ""}}]})
                call_id, sent = self._calls[n_call]
                if len(m.body) > len(sent) and m.body.startswith(sent):
                    out.append({"tool_calls": [{"index": n_call, "function": {"arguments": m.body[len(sent) :]}}]})
                    self._calls[n_call] = (call_id, m.body)
                n_call += 1
            elif m.channel == "analysis":
                thoughts.append(m.body)
            else:
                content += m.body
        thought = "\n".join(thoughts)
        if len(thought) > len(self._thought) and thought.startswith(self._thought):
            out.append({"reasoning_content": thought[len(self._thought) :]})
            self._thought = thought
        if len(content) > len(self._content) and content.startswith(self._content):
            out.append({"content": content[len(self._content) :]})
            self._content = content
        return out

    @property
    def opened_calls(self) -> int:
        """How many calls the stream has opened."""
        return len(self._calls)


# ------------------------------------------------------------------ grammars
def marker_ids(tokenizer) -> dict[str, int]:
    """The harmony markers the tokenizer holds as tokens of their own, by text."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    by_text = {getattr(tok, "content", None): int(tid) for tid, tok in added.items()}
    return {m: by_text[m] for m in MARKERS if m in by_text}


def _lit(ids: dict[str, int], text: str) -> str:
    return f"<[{ids[text]}]>" if text in ids else json.dumps(text)


def grammar(ids: dict[str, int], turn: list[str], max_reasoning_tokens: int | None = None) -> str:
    """Lark grammar of an assistant turn: one optional ``analysis`` message (at most
    ``max_reasoning_tokens`` tokens), then the rules ``turn`` (start symbol ``turn``)."""
    limit = f"[max_tokens={max_reasoning_tokens}]" if max_reasoning_tokens is not None else ""
    c, m, e, s = (_lit(ids, x) for x in (CHANNEL, MESSAGE, END, START))
    return "\n".join(
        [
            "start: analysis? turn",
            f'analysis: {c} "analysis" {m} thought {e} {s} "assistant"',
            f"thought{limit}: TEXT",
            "TEXT: /(?s:.*)/",
            *turn,
        ]
    )


def final_turn(ids: dict[str, int], answer: list[str]) -> list[str]:
    """Turn rules: a ``final`` message whose body is the rules ``answer`` (start symbol ``answer``)."""
    return [f'turn: {_lit(ids, CHANNEL)} "final" {_lit(ids, MESSAGE)} answer', *answer]


def text_answer() -> list[str]:
    """Answer rules for free text."""
    return ["answer: TEXT"]


def json_answer(schema: Any) -> list[str]:
    """Answer rules for a JSON value of ``schema``."""
    return [f"answer: {lark_json(schema)}"]


def call_turn(ids: dict[str, int], tools: list, text_too: bool) -> list[str]:
    """Turn rules: a ``commentary`` message to one of ``tools`` (``functions.NAME``, then
    ``<|constrain|>json``) whose body is that tool's arguments; or, ``text_too``, a ``final``
    message of free text instead (``tool_choice: "auto"``)."""
    c, m, k = (_lit(ids, x) for x in (CHANNEL, MESSAGE, CONSTRAIN))
    rules = [f'turn: {"final_text | " if text_too else ""}call', f'call: {c} "commentary to=functions." tool']
    if text_too:
        rules.append(f'final_text: {c} "final" {m} TEXT')
    names = []
    for i, tool in enumerate(tools):
        names.append(f"tool_{i}")
        rules.append(f"tool_{i}: {json.dumps(tool.function.name)} \" \" {k} \"json\" {m} {lark_json(arguments_schema(tool))}")
    rules.append(f"tool: {' | '.join(names)}")
    return rules
