"""Closing a JSON output within its token budget: a matcher that steers toward the end in time.

A grammar alone lets a JSON output run to ``max_tokens`` and stop mid-value, which makes a tool
call or any JSON answer useless. ``BudgetMatcher`` wraps a request's matcher and follows the JSON
structure of what it accepts (open strings, objects and arrays, how many tokens each member of an
open container took). It keeps an estimate of **the fewest tokens that finish the document from
here** (``need``): a walk on a copy of the grammar along the shortest-looking way out, token by
token the best the grammar allows by ``_walk_score`` (what closes, then punctuation that leaves
nothing open, then other text, longest first), so the required properties still missing count,
not only the open brackets. With that estimate it narrows the grammar's mask:

- to the tokens that close the open string or brackets ("closers"), when the tokens left are
  within ``MARGIN`` of the estimate; in a string, when they barely cover the estimate and a
  character's UTF-8 tail; after a member (or inside a number), when another member as long as the
  longest one so far would not fit ("do not start what cannot be finished": a call list ends
  rather than a second call begins, optional properties stop); in an empty container, when its
  first member could not be finished (``member_need``). Where nothing may close (a key or a value
  must come), to the tokens as good as the walk's best (the shortest kind of start);
- to all but the tokens that end the member and start another (``"},``, ``",``: a comma outside
  strings, ``commas``), inside a value string or number when another member as long as the
  longest would not fit: the value goes on, the container then closes;
- to the walk's one token, once the tokens left are down to the estimate, and where an object's
  next key is chosen when another member would not fit (the required property, not an optional
  one).

It never allows a token the grammar refuses. A budget smaller than the shortest document ends
with ``length`` and invalid JSON, as without it. When it narrowed a mask that a token was then
taken from (``cut_short``), the request reports ``finish_reason`` ``length`` although its JSON is
whole, so that a client knows the content was shortened.

Cost: the walk takes one grammar mask and one pass over the vocabulary's scores per token of the
way out, for at most ``MAX_WALK`` tokens and ``WALK_SECONDS``. It stands while the output takes the walk's own tokens; otherwise it is taken again
when the structure changes (a string, key, value or container opens or ends; not inside a long
string or number), every ``REFRESH`` tokens, and at every token within ``SLACK`` of the
estimate; far from the end (more than twice the estimate plus ``2 * SLACK`` tokens left) it
stands for ``4 * REFRESH`` tokens.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from radixlm.runtime.constrained.base import Matcher, bitmask_width, pack_bitmask
from radixlm.runtime.constrained.vocab import token_bytes

_WS = " \t\n\r"
_UTF8_TAIL = 3  # tokens a character begun in a string may still need before a quote can follow
MARGIN = 2  # tokens to spare: narrowing to a class starts this many tokens before the estimate runs out
SLACK = 8  # near the end (within this many tokens of the estimate) it is taken again at every token
REFRESH = 16  # tokens after which the estimate is taken again even if the structure did not change
MAX_WALK = 256  # the longest way out walked (a longer one counts as this long)
WALK_SECONDS = 0.05  # the longest a walk may take: a hostile schema's slow masks must not stall the step (a usual walk takes 1-5 ms)
_EXCLUDED = 1 << 30  # the score of a token the way out never takes (no text: special tokens)
_RANK = 1000  # a rank's score step; within a rank, a longer text scores lower (is preferred)
_PUNCTUATION = '{}[],:"'
_OPENED = 100  # within a rank, each bracket a token leaves open costs this much (so "[]" comes before "[{")


def _closes_levels(text: str) -> bool:
    core = text.strip(_WS)
    return bool(core) and set(core) <= set("}]")


def _starts_member(text: str, in_string: bool) -> bool:
    """Whether ``text``, read from inside a string or not, has a comma outside strings: it ends
    the current member and starts another."""
    escape = False
    for c in text:
        if in_string:
            escape, in_string = (False, True) if escape else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c == ",":
            return True
    return False


def _walk_score(text: str, where: str) -> int:
    """How the way out ranks a token at ``where`` ("out" of strings, in a "key", in a "value"
    string), lower first: what closes (brackets; in a string, its quote then brackets at most),
    then JSON's punctuation alone (in a string: after its closing quote), then any other text, then
    bare whitespace; within a rank, the fewer brackets left open and then the more characters
    besides whitespace the better. A token without text is never taken."""
    if not text:
        return _EXCLUDED
    solid = len(text) - sum(text.count(c) for c in _WS)
    if solid == 0:
        return 3 * _RANK
    if where == "out":
        closes = _closes_levels(text)
        punctuation = set(text) <= set(_PUNCTUATION + _WS)
    else:
        closes = text.startswith('"') and (len(text) == 1 or _closes_levels(text[1:])) and where == "value"
        punctuation = text.startswith('"') and set(text) <= set(_PUNCTUATION + _WS)  # a key's quote, then ':' and more
    rank = 0 if closes else 1 if punctuation else 2
    after = text if where == "out" else text[1:] if text.startswith('"') else ""  # what follows a string's close
    opened = max(0, sum(after.count(c) for c in "[{") - sum(after.count(c) for c in "]}")) + after.count('"') % 2  # a quote left open too
    return rank * _RANK + _OPENED * min(opened, 9) - min(solid, _OPENED - 1)


class CloseVocab:
    """Per-tokenizer tables: each token's text (bytes as latin-1), the bitmasks of the tokens that
    close a string (``"``, then brackets) and that close objects or arrays (brackets only), of
    those that start another member (a comma outside strings, read from a value string or not:
    ``commas``), and each token's rank on the way out outside strings, in keys and in values
    (``scores``)."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        pad = [False] * (bitmask_width(len(texts)) * 32 - len(texts))
        string = [t.startswith('"') and (len(t) == 1 or _closes_levels(t[1:])) for t in texts] + pad
        level = [_closes_levels(t) for t in texts] + pad
        self.closing = {"string": pack_bitmask(torch.tensor(string)), "level": pack_bitmask(torch.tensor(level))}
        self.commas = {where: pack_bitmask(torch.tensor([_starts_member(t, where == "value") for t in texts] + pad)) for where in ("value", "out")}
        self.scores = {where: np.array([_walk_score(t, where) for t in texts], dtype=np.int64) for where in ("out", "key", "value")}

    @classmethod
    def from_tokenizer(cls, hf_tokenizer, vocab_size: int) -> CloseVocab:
        """The tables of ``hf_tokenizer`` padded to ``vocab_size`` (special tokens have no text)."""
        texts = [""] * vocab_size
        for tid, raw in token_bytes(hf_tokenizer).items():
            if tid < vocab_size:
                texts[tid] = raw.decode("latin-1")  # one char per byte: the ASCII structure is exact
        return cls(texts)

    def _scored(self, allowed_row: torch.Tensor, where: str) -> np.ndarray:
        """Each token's score at ``where``, or _EXCLUDED where the int32 bitmask row refuses it."""
        bits = np.unpackbits(allowed_row.numpy().view(np.uint8), bitorder="little")[: len(self.texts)]
        return np.where(bits.astype(bool), self.scores[where], _EXCLUDED)

    def like_best(self, allowed_row: torch.Tensor, where: str) -> torch.Tensor | None:
        """The int32 bitmask row of the allowed tokens as good for the way out as its best one
        (the same rank and brackets left open, any length), or None when none has text."""
        scored = self._scored(allowed_row, where)
        top = int(scored.min())
        if top >= _EXCLUDED:
            return None
        same = (scored // _OPENED) == top // _OPENED
        packed = np.packbits(np.concatenate([same, np.zeros(allowed_row.shape[0] * 32 - same.shape[0], dtype=bool)]), bitorder="little")
        return torch.from_numpy(packed.view(np.int32).copy())

    def best(self, allowed_row: torch.Tensor, where: str) -> int | None:
        """The way out's token at ``where`` ("out", "key" or "value": see ``JsonShape.where``)
        among those the int32 bitmask row allows, or None when it allows none with text."""
        scored = self._scored(allowed_row, where)
        token = int(scored.argmin())
        return None if scored[token] >= _EXCLUDED else token


@dataclass
class _Level:
    """An open object or array: where its current member began (in tokens) and the longest one."""

    kind: str  # "{" or "["
    since: int  # tokens accepted when the current member began
    longest: int = 0
    after_member: bool = False  # a member just ended: a comma or the close comes next
    expect_key: bool = False  # object: the next string is a key
    started: bool = False  # a member (or its key) has begun: the container is not empty


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

    def where(self) -> str:
        """"out" of strings, in a "key" or in a "value" string."""
        return "out" if not self.in_string else "key" if self.string_is_key else "value"

    def empty_container(self) -> bool:
        """True right after ``[`` or ``{`` (whitespace aside): it may close, or its first member start."""
        return not self.in_string and not self.in_scalar and bool(self.levels) and not self.levels[-1].started

    def open_count(self) -> int:
        """The open levels and string: the fewest characters (so tokens) that could close them."""
        return len(self.levels) + (1 if self.in_string else 0)

    def structure(self) -> tuple:
        """What the shortest way out depends on: the same inside one string or number."""
        top = self.levels[-1] if self.levels else None
        return (len(self.levels), self.in_string, self.string_is_key, self.in_scalar, self.done, top and (top.after_member, top.expect_key))

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
        if top is not None and c not in "}]":
            top.started = True
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

    def tight(self, left: int, need: int | None = None) -> bool:
        """Whether to steer toward the end now, with ``left`` tokens to go and ``need`` the fewest
        that finish the document from here (the open levels when not known)."""
        if self.done:
            return False
        need = self.open_count() if need is None else need
        if self.in_string and not self.string_is_key:
            return left <= need + _UTF8_TAIL + 1  # a character begun may need its tail first
        if not self.in_string and not self.in_scalar and self.levels and self.levels[-1].after_member:
            return self.no_room(left, need)
        return left <= need + MARGIN

    def no_room(self, left: int, need: int) -> bool:
        """Whether another member as long as the longest one so far would not fit in ``left``."""
        return bool(self.levels) and left <= self.levels[-1].longest + need + 1

    def choosing_key(self) -> bool:
        """Where an object's next key is begun or due: which property comes is chosen here."""
        if self.in_string:
            return self.string_is_key
        return not self.in_scalar and bool(self.levels) and self.levels[-1].kind == "{" and self.levels[-1].expect_key

    def ending_member(self) -> bool:
        """Inside a value string or a number in a container: its end may come with a comma."""
        return bool(self.levels) and (self.in_scalar or (self.in_string and not self.string_is_key))


class BudgetMatcher(Matcher):
    """A matcher that closes its JSON output before ``budget`` tokens run out (see module doc)."""

    def __init__(self, inner: Matcher, vocab: CloseVocab, budget: int) -> None:
        self.inner, self.vocab, self.budget = inner, vocab, budget
        self.shape = JsonShape()
        self._accepted: list[int] = []
        self._need: int | None = None  # the last estimate of the tokens that finish the document
        self._need_at, self._need_structure = 0, None  # when it was taken, and the structure then
        self._way_out = False  # whether the walk that took it reached the document's end
        self._path: list[int] | None = None  # the rest of that walk's tokens, while the output follows them
        self._path_at = -1  # tokens accepted where the rest of the path begins
        self._acted_at: int | None = None  # tokens accepted when a mask was first narrowed
        self._tight_at, self._tight = -1, None  # _tightness() at that many tokens accepted
        self._member_need_at, self._member_need = -1, 0  # member_need() at that many tokens accepted

    def accept(self, token: int) -> bool:
        """Advance the grammar and the JSON shape by ``token``."""
        if not self.inner.accept(token):
            return False
        self._accepted.append(token)
        self.shape.feed(self._text(token))
        if self._path and self._path_at == len(self._accepted) - 1 and self._path[0] == token:
            self._path.pop(0)  # the output follows the way out: the estimate holds, one token less
            self._path_at, self._need = self._path_at + 1, max(0, (self._need or 0) - 1)
        else:
            self._path = None
        return True

    def _text(self, token: int) -> str:
        return self.vocab.texts[token] if token < len(self.vocab.texts) else ""

    def need(self) -> int:
        """The estimate of the fewest tokens that finish the document from here (see module doc)."""
        n, left = len(self._accepted), self.budget - len(self._accepted)
        floor = self.shape.open_count()
        if self._path is not None and self._path_at == n:
            return max(self._need, floor)  # still on the last walk's way out
        if self._need is not None:
            far = left > 2 * self._need + 2 * SLACK and n - self._need_at < 4 * REFRESH
            same = self.shape.structure() == self._need_structure and left > self._need + SLACK and n - self._need_at < REFRESH
            if far or same:
                return max(self._need, floor)
        cap, path = min(left + SLACK, MAX_WALK), []
        self._need, self._need_at, self._need_structure = self._walk_out(cap, path=path), n, self.shape.structure()
        self._way_out = self._need < cap
        self._path, self._path_at = (path, n) if self._way_out else (None, -1)
        return max(self._need, floor)

    def member_need(self) -> int:
        """In an empty container: the tokens that finish the document if a first member starts
        now (the way out, but not through the container's close); taken once per container."""
        n = len(self._accepted)
        if self._member_need_at != n:
            cap = min(self.budget - n + SLACK, MAX_WALK)
            self._member_need, self._member_need_at = self._walk_out(cap, open_first=True), n
        return self._member_need

    def _walk_out(self, cap: int, open_first: bool = False, path: list[int] | None = None) -> int:
        """Tokens along the way out on a copy of the grammar until the document ends (``cap``
        when it does not end within ``cap`` tokens or ``WALK_SECONDS``). ``open_first``: its first
        token closes nothing; ``path``, when given, receives the tokens."""
        sim, shape = self.inner.copy(), copy.deepcopy(self.shape)
        row = torch.zeros((1, bitmask_width(len(self.vocab.texts))), dtype=torch.int32)
        deadline = time.perf_counter() + WALK_SECONDS
        for steps in range(cap):
            if shape.done or sim.is_terminated():
                return steps
            if time.perf_counter() > deadline:
                return cap  # not found in time: counted as no way out (the closers still apply)
            sim.fill_bitmask(row, 0)
            if open_first and steps == 0:
                row[0] &= ~self.vocab.closing["level"][: row.shape[1]]
            best = self.vocab.best(row[0], shape.where())
            if best is None or not sim.accept(best):
                return steps if best is None else cap  # only an end token is left: the grammar ends here
            shape.feed(self._text(best))
            if path is not None:
                path.append(best)
        return cap

    def _tightness(self) -> str | None:
        """None (go on), "no comma" (leave out the tokens that end the member and start another),
        "closers" (narrow to the tokens that close the string or a level, where the grammar allows
        one) or "token" (to the way out's one token)."""
        n = len(self._accepted)
        if self._tight_at != n:
            left = self.budget - n
            need = None if self.shape.done else self.need()
            self._tight_at = n
            if need is None:
                self._tight = None
            elif self._way_out and (left <= need or (self.shape.choosing_key() and self.shape.no_room(left, need))):
                self._tight = "token"  # the budget is down to the way out (or has no room for an optional property): its one token
            elif self.shape.tight(left, need) or (self.shape.empty_container() and left <= self.member_need() + MARGIN):
                self._tight = "closers"  # (an empty container whose first member could not be finished: close it)
            elif self.shape.ending_member() and self.shape.no_room(left, need):
                self._tight = "no comma"  # the member goes on, but no token may end it and start another
            else:
                self._tight = None
        return self._tight

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """The grammar's mask, narrowed toward the end when the budget is tight."""
        self.inner.fill_bitmask(bitmask, row)
        how = self._tightness()
        if how == "token":
            token = self.vocab.best(bitmask[row], self.shape.where())
            if token is None:
                return
            bit = token % 32
            narrowed = torch.zeros_like(bitmask[row])
            narrowed[token // 32] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # the word's bit, as int32
        elif how == "no comma":
            narrowed = bitmask[row] & ~self.vocab.commas["out" if self.shape.in_scalar else "value"][: bitmask.shape[1]]
            if not bool(narrowed.any()):
                return
        elif how == "closers":
            where = self.shape.where()
            narrowed = bitmask[row] & self.vocab.closing["string" if where == "value" else "level"][: bitmask.shape[1]]
            if where == "key" or not bool(narrowed.any()):  # nothing may close here (a key or a value must start): the shortest kind of start
                narrowed = self.vocab.like_best(bitmask[row], where)
                if narrowed is None:
                    return
        else:
            return
        if not torch.equal(narrowed, bitmask[row]):
            bitmask[row] = narrowed
            if self._acted_at is None:
                self._acted_at = len(self._accepted)

    def mask_needed(self) -> bool:
        """True while the budget is tight: the mask then narrows what the grammar allows."""
        return self._tightness() is not None or self.inner.mask_needed()

    def cut_short(self) -> bool:
        """True when a narrowed mask chose a token of the output: its content was shortened."""
        return self._acted_at is not None and len(self._accepted) > self._acted_at

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
                self.shape.feed(self._text(token))
            self._need, self._tight_at, self._member_need_at, self._path = None, -1, -1, None
            if self._acted_at is not None and self._acted_at >= len(self._accepted):
                self._acted_at = None

    def forced_text(self) -> str:
        """As the wrapped matcher."""
        return self.inner.forced_text()

    def copy(self) -> BudgetMatcher:
        """An independent copy (grammar state, shape and estimate)."""
        twin = BudgetMatcher(self.inner.copy(), self.vocab, self.budget)
        twin.shape, twin._accepted = copy.deepcopy(self.shape), list(self._accepted)
        twin._need, twin._need_at, twin._need_structure, twin._acted_at = self._need, self._need_at, self._need_structure, self._acted_at
        twin._tight_at, twin._tight, twin._way_out = self._tight_at, self._tight, self._way_out
        twin._path, twin._path_at = (list(self._path) if self._path is not None else None), self._path_at
        return twin

    def error(self) -> str | None:
        """As the wrapped matcher."""
        return self.inner.error()
