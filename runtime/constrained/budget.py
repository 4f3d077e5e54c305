"""Closing a JSON output within its token budget: a matcher that steers toward the end in time.

A grammar alone lets a JSON output run to ``max_tokens`` and stop mid-value, which makes a tool
call (or any JSON answer) useless. ``BudgetMatcher`` wraps a request's matcher and follows the
JSON structure of what it accepts (open strings, objects, arrays, and how many tokens each
member of an open container took). When the tokens left become few, it narrows the grammar's
mask to the tokens that close something, provided the grammar allows one of them (in a string:
a token that starts with ``"``, then only brackets; elsewhere: only ``}`` and ``]``, whitespace
aside):

- inside a string or number, when the tokens left barely cover closing every open level;
- after a whole member of an object or array, when another member as long as the longest one so
  far, plus closing every open level, would not fit ("do not start what cannot be finished").
  So a call list is closed rather than a second call started, and optional properties stop.

It never allows a token the grammar refuses: where no closing token is allowed (a required key
is missing, a value must start), the grammar's mask stands, and an output that truly cannot fit
ends with ``length`` as before.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from radixlm.runtime.constrained.base import Matcher, bitmask_width, pack_bitmask
from radixlm.runtime.constrained.vocab import token_bytes

_WS = " \t\n\r"
_UTF8_TAIL = 3  # tokens a character begun in a string may still need before a quote can follow


def _closes_levels(text: str) -> bool:
    core = text.strip(_WS)
    return bool(core) and set(core) <= set("}]")


class CloseVocab:
    """Per-tokenizer tables: each token's text (bytes as latin-1) and the bitmasks of the tokens
    that close a string (``"``, then brackets) and that close objects or arrays (brackets only)."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        pad = [False] * (bitmask_width(len(texts)) * 32 - len(texts))
        string = [t.startswith('"') and (len(t) == 1 or _closes_levels(t[1:])) for t in texts] + pad
        level = [_closes_levels(t) for t in texts] + pad
        self.closing = {"string": pack_bitmask(torch.tensor(string)), "level": pack_bitmask(torch.tensor(level))}

    @classmethod
    def from_tokenizer(cls, hf_tokenizer, vocab_size: int) -> CloseVocab:
        """The tables of ``hf_tokenizer`` padded to ``vocab_size`` (special tokens have no text)."""
        texts = [""] * vocab_size
        for tid, raw in token_bytes(hf_tokenizer).items():
            if tid < vocab_size:
                texts[tid] = raw.decode("latin-1")  # one char per byte: the ASCII structure is exact
        return cls(texts)


@dataclass
class _Level:
    """An open object or array: where its current member began (in tokens) and the longest one."""

    kind: str  # "{" or "["
    since: int  # tokens accepted when the current member began
    longest: int = 0
    after_member: bool = False  # a member just ended: a comma or the close comes next
    expect_key: bool = False  # object: the next string is a key


@dataclass
class JsonShape:
    """The open structure of a JSON text read so far, token by token."""

    tokens: int = 0
    levels: list[_Level] = field(default_factory=list)
    in_string: bool = False
    string_is_key: bool = False
    escape: bool = False
    in_scalar: bool = False
    done: bool = False  # the root value ended

    def feed(self, text: str) -> None:
        """Read one accepted token's text."""
        self.tokens += 1
        for c in text:
            self._char(c)

    def _member_end(self) -> None:
        if not self.levels:
            self.done = True
            return
        top = self.levels[-1]
        top.longest = max(top.longest, self.tokens - top.since)
        top.since, top.after_member = self.tokens, True

    def _char(self, c: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if not self.string_is_key:
                    self._member_end()
            return
        if self.in_scalar:
            if c not in _WS and c not in ",]}":
                return
            self.in_scalar = False
            self._member_end()
        if c in _WS or self.done:
            return
        top = self.levels[-1] if self.levels else None
        if c in "{[":
            self.levels.append(_Level(c, self.tokens, expect_key=c == "{"))
        elif c in "}]":
            if self.levels:
                self.levels.pop()
                self._member_end()
        elif c == '"':
            self.in_string = True
            self.string_is_key = top is not None and top.kind == "{" and top.expect_key
            if self.string_is_key:
                top.expect_key = False
        elif c == ",":
            if top is not None:
                top.after_member = False
                top.expect_key = top.kind == "{"
        elif c != ":":
            self.in_scalar = True

    def tight(self, left: int) -> str | None:
        """What to close now, with ``left`` tokens to go: "string", "level" (an object or array),
        or None (go on)."""
        if self.done:
            return None
        closing = len(self.levels) + (1 if self.in_string else 0)
        if self.in_string and not self.string_is_key:
            return "string" if left <= closing + _UTF8_TAIL + 1 else None
        if self.in_scalar:
            return "level" if left <= closing + 1 else None
        if not self.in_string and self.levels and self.levels[-1].after_member:
            return "level" if left <= self.levels[-1].longest + closing + 1 else None
        return None


class BudgetMatcher(Matcher):
    """A matcher that closes its JSON output before ``budget`` tokens run out (see module doc)."""

    def __init__(self, inner: Matcher, vocab: CloseVocab, budget: int) -> None:
        self.inner, self.vocab, self.budget = inner, vocab, budget
        self.shape = JsonShape()
        self._accepted: list[int] = []

    def accept(self, token: int) -> bool:
        """Advance the grammar and the JSON shape by ``token``."""
        if not self.inner.accept(token):
            return False
        self._accepted.append(token)
        self.shape.feed(self.vocab.texts[token] if token < len(self.vocab.texts) else "")
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """The grammar's mask, narrowed to closing tokens when the budget is tight and it allows one."""
        self.inner.fill_bitmask(bitmask, row)
        kind = self.shape.tight(self.budget - len(self._accepted))
        if kind is None:
            return
        narrowed = bitmask[row] & self.vocab.closing[kind][: bitmask.shape[1]]
        if bool(narrowed.any()):
            bitmask[row] = narrowed

    def mask_needed(self) -> bool:
        """True while the budget is tight: the mask then narrows what the grammar allows."""
        return self.shape.tight(self.budget - len(self._accepted)) is not None or self.inner.mask_needed()

    def is_terminated(self) -> bool:
        """As the wrapped matcher."""
        return self.inner.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last tokens in the grammar, and re-read the shape without them."""
        self.inner.rollback(num_tokens)
        if num_tokens:
            del self._accepted[len(self._accepted) - num_tokens :]
            self.shape = JsonShape()
            for token in self._accepted:
                self.shape.feed(self.vocab.texts[token] if token < len(self.vocab.texts) else "")

    def forced_text(self) -> str:
        """As the wrapped matcher."""
        return self.inner.forced_text()

    def copy(self) -> BudgetMatcher:
        """An independent copy (grammar state and shape)."""
        twin = BudgetMatcher(self.inner.copy(), self.vocab, self.budget)
        twin.shape, twin._accepted = copy.deepcopy(self.shape), list(self._accepted)
        return twin

    def error(self) -> str | None:
        """As the wrapped matcher."""
        return self.inner.error()
