"""Streaming tool calls: OpenAI ``delta`` objects from a tool-mode output as its text grows.

OpenAI streams a call as a first delta with its id and whole name, then deltas of argument text::

    {"tool_calls": [{"index": 0, "id": "call_...", "type": "function", "function": {"name": "f", "arguments": ""}}]}
    {"tool_calls": [{"index": 0, "function": {"arguments": "{\\"city\\": \\"Par"}}]}
    {"tool_calls": [{"index": 0, "function": {"arguments": "is\\"}"}}]}

The argument pieces are raw slices of the generated text of the ``arguments`` value, so they add
up to the text the non-streamed response returns (``tool_calls.parse_required``/``parse_auto``).
Where that value ends is found by walking the JSON as it arrives (``_JsonScanner``: nesting,
strings and escapes), so neither the call object's ``}`` nor the ``,`` between calls is sent. A
name is sent once, when its JSON string is complete.

Per mode (see ``tool_calls``):

- ``named``: the whole output is the arguments; the call opens with the first text.
- ``required``: a JSON array of ``{"name": ..., "arguments": ...}``; each element is one call.
- ``auto``: text, then calls in the family's format (``tool_formats``): Hermes
  ``<tool_call>{...}</tool_call>`` repeated, Mistral ``[TOOL_CALLS]`` and one array of calls,
  Llama 3 calls from the first character on, separated by ``;``. The text streams as content,
  except a trailing run of whitespace and a trailing partial marker, held until what follows
  shows whether they are content (the content before a call drops its trailing whitespace; a
  Llama 3 answer is content unless its first character, whitespace aside, is ``{``).

A cut output (``max_tokens`` inside a call) parses to no call: the non-streamed response has
finish_reason ``"length"``, no calls, and (named, required) no content, or (auto) the text before
the call as content. A stream that has already opened the call does
not take it back nor fabricate its end: the rest of its arguments (as generated) is sent, no
content is added, and the final chunk's finish_reason is ``"length"`` (the caller computes it from
the finished parse, which has no calls). A stream that opened no call sends the content the
non-streamed response would have. Should the stream and the parse ever disagree otherwise (not
for output the grammar made), what was sent stays and a warning is logged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.entrypoints.openai.tool_calls import new_call_id
from radixlm.runtime.entrypoints.openai.tool_formats import ARGUMENT_KEYS, HERMES, ToolFormat
from radixlm.runtime.stop_regex import partial_stop_len

logger = logging.getLogger(__name__)

_WS = " \t\n\r"  # JSON whitespace (what tool_calls skips between a call and its markers)
Path = tuple  # keys and indexes from the root to a value


def _string(raw: str) -> str | None:
    """The value of a whole JSON string literal (None if it is not a valid one)."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return None


@dataclass
class _Frame:
    """An open object or array: what it expects next, and the key/index of the child being read."""

    kind: str  # "{" or "["
    expect: str  # object: "key", "colon", "value", "comma"; array: "value", "comma"
    child: Any = None


class _JsonScanner:
    """Walks one JSON value of a growing text, reporting where each value starts and ends.

    ``on_start(path, pos)`` fires at a value's first character, ``on_end(path, end)`` just past its
    last. Input is trusted to be (a prefix of) valid JSON; the grammar made it.
    """

    def __init__(self, pos: int, on_start: Callable[[Path, int], None], on_end: Callable[[Path, int], None]) -> None:
        self.pos = pos  # the next character to read
        self.end: int | None = None  # just past the root value, once it ends
        self._on_start, self._on_end = on_start, on_end
        self._stack: list[_Frame] = []
        self._string: int | None = None  # start of the string being read
        self._is_key = False
        self._escape = False
        self._scalar: int | None = None  # start of the number/literal being read

    def _path(self) -> Path:
        return tuple(f.child for f in self._stack)

    def feed(self, text: str) -> None:
        """Read ``text`` (the whole text so far) from where the last call stopped."""
        while self.pos < len(text) and self.end is None:
            self._step(text, self.pos, text[self.pos])
            self.pos += 1

    def _step(self, text: str, i: int, c: str) -> None:
        if self._string is not None:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                start, self._string = self._string, None
                if self._is_key:
                    top = self._stack[-1]
                    top.child, top.expect = _string(text[start : i + 1]), "colon"
                else:
                    self._ended(i + 1)
            return
        if self._scalar is not None:
            if c not in _WS and c not in ",:]}":
                return
            self._scalar = None
            self._ended(i)
            if self.end is not None:
                return
        if c in _WS:
            return
        if not self._stack:
            self._started(i, c)
            return
        top = self._stack[-1]
        if c in "}]" and top.expect in ("key", "value", "comma"):
            self._stack.pop()
            self._ended(i + 1)
        elif top.expect == "key" and c == '"':
            self._string, self._is_key = i, True
        elif top.expect == "colon":
            top.expect = "value"
        elif top.expect == "comma":
            top.expect = "key" if top.kind == "{" else "value"
            if top.kind == "[":
                top.child += 1
        elif top.expect == "value":
            self._started(i, c)

    def _started(self, i: int, c: str) -> None:
        self._on_start(self._path(), i)
        if c in "{[":
            self._stack.append(_Frame(c, "key" if c == "{" else "value", None if c == "{" else 0))
        elif c == '"':
            self._string, self._is_key = i, False
        else:
            self._scalar = i

    def _ended(self, end: int) -> None:
        self._on_end(self._path(), end)
        if self._stack:
            self._stack[-1].expect = "comma"
        else:
            self.end = end


@dataclass
class _Call:
    """One call being read: where its name and arguments lie, and what was sent of it."""

    name_start: int | None = None
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    index: int | None = None  # its index in ``tool_calls``, once its first delta is sent
    id: str = field(default_factory=new_call_id)
    sent: str = ""  # the argument text sent
    done: bool = False  # all its arguments are sent


class ToolCallStreamer:
    """Turns a growing tool-mode output into stream deltas: content and ``tool_calls`` pieces.

    ``feed`` takes the whole output so far each time and returns the new deltas (each a chunk's
    ``delta``); ``finish`` takes the finished output and its non-streamed parse and returns the
    last ones, which make the streamed message equal to the non-streamed one.
    """

    def __init__(self, mode: str, name: str | None = None, fmt: ToolFormat = HERMES) -> None:
        if mode not in ("named", "required", "auto") or (mode == "named") != (name is not None):
            raise ValueError(f"bad tool mode {mode!r} (name {name!r})")
        self.mode, self.fmt = mode, fmt
        self._text = ""  # the output so far
        self._calls: list[_Call] = []  # in output order, the last one being read
        self._opened: list[_Call] = []  # those whose first delta was sent, by index
        self._content = ""  # content sent
        self._searched = 0  # auto: the text before this holds no opening marker
        self._stage = "text"  # auto: "text", "plain" (all content), "call", "close", "open" (the next call), "done"
        self._at = 0  # auto: where the "close"/"open" stage looks
        self._scanner: _JsonScanner | None = None
        self._depth = 1 if mode == "required" else 0  # path length of a call object
        if mode == "required":
            self._scanner = _JsonScanner(0, self._value_started, self._value_ended)
        elif mode == "named":
            self._calls.append(_Call(name=name, args_start=0))

    # ------------------------------------------------------------- reading
    def _value_started(self, path: Path, pos: int) -> None:
        rel = path[self._depth :]
        if len(path) == self._depth:
            self._calls.append(_Call())
        elif rel == ("name",):
            self._calls[-1].name_start = pos
        elif len(rel) == 1 and rel[0] in ARGUMENT_KEYS:
            self._calls[-1].args_start = pos

    def _value_ended(self, path: Path, end: int) -> None:
        rel = path[self._depth :]
        if len(path) <= self._depth:
            return
        call = self._calls[-1]
        if rel == ("name",) and call.name_start is not None:
            call.name = _string(self._text[call.name_start : end])
        elif len(rel) == 1 and rel[0] in ARGUMENT_KEYS:
            call.args_end = end

    def _read(self, text: str) -> list[dict[str, Any]]:
        """Advance the scanner (and, for auto, the text around calls); returns content deltas."""
        self._text = text
        if self.mode == "required":
            self._scanner.feed(text)
            return []
        if self.mode == "named":
            return []
        out: list[dict[str, Any]] = []
        fmt = self.fmt
        while True:
            if self._stage == "text" and not fmt.open:  # Llama 3: the first character decides
                i = len(text) - len(text.lstrip(_WS))
                if i == len(text):
                    return out  # whitespace so far: held
                if text[i] == "{":
                    self._begin_call(i)
                else:
                    self._stage = "plain"
            elif self._stage == "text":
                start = text.find(fmt.open, max(self._searched - len(fmt.open) + 1, 0))
                self._searched = len(text)
                if start < 0:
                    held = partial_stop_len(text, [fmt.open])
                    self._send_content(text[len(self._content) : len(text) - held].rstrip(), out)
                    return out
                self._send_content(text[len(self._content) : start].rstrip(), out)
                self._begin_call(start + len(fmt.open), list_of_calls=fmt.as_list)
            elif self._stage == "plain":
                self._send_content(text[len(self._content) :], out)
                return out
            elif self._stage == "call":
                self._scanner.feed(text)
                if self._scanner.end is None:
                    return out
                self._stage = "done" if fmt.as_list else "close" if fmt.close else "open"
                self._at = self._scanner.end
            else:  # "close" then "open": whitespace, the marker, whitespace, the next call's marker
                if self._stage == "done":
                    return out
                marker = fmt.close if self._stage == "close" else fmt.open if fmt.close else fmt.separator
                i = self._at
                while i < len(text) and text[i] in _WS:
                    i += 1
                got = text[i : i + len(marker)]
                if got == marker:
                    if self._stage == "close":
                        self._stage, self._at = "open", i + len(marker)
                    else:
                        self._begin_call(i + len(marker))
                elif marker.startswith(got):
                    return out  # more text will tell
                else:
                    self._stage = "done"  # the parse reads no further call

    def _begin_call(self, pos: int, list_of_calls: bool = False) -> None:
        """Read a call object (or, ``list_of_calls``, an array of them) from ``pos`` on."""
        self._stage, self._depth = "call", 1 if list_of_calls else 0
        self._scanner = _JsonScanner(pos, self._value_started, self._value_ended)

    def _send_content(self, piece: str, out: list[dict[str, Any]]) -> None:
        if piece:
            self._content += piece
            out.append({"content": piece})

    def _call_deltas(self, text: str) -> list[dict[str, Any]]:
        """Open the calls whose names are complete and send their new argument text."""
        out: list[dict[str, Any]] = []
        for call in self._calls:
            if call.name is None or call.done:
                continue
            if call.index is None:
                call.index = len(self._opened)
                self._opened.append(call)
                out.append(self._opening(call))
            if call.args_start is None:
                continue
            if call.args_end is not None:
                upto = call.args_end
            elif self.mode == "named":
                upto = len(text)
            else:
                upto = self._scanner.pos  # the arguments are the value being read
            self._send_args(call, text[call.args_start + len(call.sent) : upto], out)
            call.done = call.args_end is not None
        return out

    @staticmethod
    def _opening(call: _Call) -> dict[str, Any]:
        return {"tool_calls": [{"index": call.index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]}

    @staticmethod
    def _send_args(call: _Call, piece: str, out: list[dict[str, Any]]) -> None:
        if piece:
            call.sent += piece
            out.append({"tool_calls": [{"index": call.index, "function": {"arguments": piece}}]})

    # ---------------------------------------------------------------- API
    def feed(self, text: str) -> list[dict[str, Any]]:
        """The new deltas for ``text``, the whole output so far (it only grows)."""
        if self.mode == "named" and not text:
            return []
        return self._read(text) + self._call_deltas(text)

    def finish(self, text: str, content: str | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The last deltas, given the finished ``text`` and its non-streamed ``(content, calls)``."""
        out = self.feed(text)
        if calls or not self._opened:
            target = content or ""
            if target.startswith(self._content):
                self._send_content(target[len(self._content) :], out)
            else:
                logger.warning("streamed content %r is not a prefix of the parsed content %r", self._content, target)
        for i, final in enumerate(calls):
            name, args = final["function"]["name"], final["function"]["arguments"]
            if i >= len(self._opened):  # the stream did not see it (the parse is the reference)
                call = _Call(name=name, index=i)
                self._opened.append(call)
                out.append(self._opening(call))
            call = self._opened[i]
            if call.name != name or not args.startswith(call.sent):
                logger.warning("streamed call %d (%s, %r) differs from the parsed call (%s, %r)", i, call.name, call.sent, name, args)
                continue
            self._send_args(call, args[len(call.sent) :], out)
        return out
