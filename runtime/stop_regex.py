"""Stop regexes: validating SGLang's ``stop_regex`` patterns and finding them in growing text.

Patterns are Python regular expressions (SGLang's semantics), matched with the ``regex``
package, which reads ``re``'s syntax and takes a time limit: a search runs on the engine thread,
and a pathological pattern (``(a+)+b`` takes ``re`` seconds on 24 characters) must not stall
everyone's step, so the searches of one request's patterns in one step share SEARCH_TIMEOUT_S
(however many patterns it has), and running over it fails that request only, as the client's
error (``StopRegexTooSlow``, a 400). A request's text only grows, and every earlier text was
already searched, so a new match must reach into the newest characters: each search starts that
pattern's longest possible span (lookarounds included) before them, or at 0 when the pattern's
span is unbounded. Streams hold back the tail that could still become a match (a partial
match), so a stream never shows text a stop trims.
"""

from __future__ import annotations

import functools
import re
import time

try:  # Python 3.11+
    import re._parser as _sre  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre  # type: ignore[no-redef]

import regex

MAX_STOP_REGEX_COUNT = 32  # SGLang's bounds
MAX_STOP_REGEX_BYTES = 256
SEARCH_TIMEOUT_S = 0.05  # all searches of one request's patterns in one step, together


class StopRegexTooSlow(RuntimeError):
    """A request's stop_regex searches ran over their time limit: the client's pattern is at fault."""

    status = 400  # the HTTP status the request fails with


def validate_stop_regex(value: object) -> list[str]:
    """``stop_regex`` (a pattern or a list) as a list; ValueError naming stop_regex when invalid."""
    patterns = [value] if isinstance(value, str) else value
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ValueError("stop_regex must be a string or a list of strings")
    if len(patterns) > MAX_STOP_REGEX_COUNT:
        raise ValueError(f"stop_regex takes at most {MAX_STOP_REGEX_COUNT} patterns, got {len(patterns)}")
    for p in patterns:
        size = len(p.encode("utf-8", "surrogatepass"))
        if size > MAX_STOP_REGEX_BYTES:
            raise ValueError(f"stop_regex pattern is {size} bytes, over the {MAX_STOP_REGEX_BYTES}-byte limit")
        try:
            re.compile(p)  # the syntax SGLang takes
            compiled = _compile(p)
        except (re.error, regex.error, RecursionError, OverflowError) as exc:
            raise ValueError(f"stop_regex {p!r} is not a valid regular expression: {exc}") from None
        if compiled.search("") is not None:
            raise ValueError(f"stop_regex {p!r} matches the empty string, so it would stop at once")
    return list(patterns)


@functools.lru_cache(maxsize=1024)
def _compile(pattern: str) -> regex.Pattern:
    return regex.compile(pattern)


def search_deadline() -> float:
    """The deadline shared by one request's stop_regex searches of one step."""
    return time.monotonic() + SEARCH_TIMEOUT_S


def _search(pattern: str, text: str, start: int, deadline: float | None, partial: bool = False) -> regex.Match | None:
    """Search before ``deadline`` (None: SEARCH_TIMEOUT_S from now); StopRegexTooSlow naming
    stop_regex when it runs past it."""
    left = SEARCH_TIMEOUT_S if deadline is None else deadline - time.monotonic()
    try:
        if left <= 0:
            raise TimeoutError
        return _compile(pattern).search(text, start, partial=partial, timeout=left)
    except TimeoutError:
        raise StopRegexTooSlow(f"stop_regex {pattern!r}: this request's stop_regex searches took over {SEARCH_TIMEOUT_S * 1000:g} ms in one step (catastrophic backtracking?)") from None


@functools.lru_cache(maxsize=1024)
def max_span(pattern: str) -> int | None:
    """The most characters a match of ``pattern`` can cover, lookarounds included; None if unbounded."""
    return _span(_sre.parse(pattern))


_ONE_CHAR = {"LITERAL", "NOT_LITERAL", "IN", "ANY", "CATEGORY", "RANGE", "NEGATE"}
_ZERO_WIDTH = {"AT"}
_REPEATS = {"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"}


def _span(items) -> int | None:
    total = 0
    for op, arg in items:
        name = str(op)
        if name in _ONE_CHAR:
            part: int | None = 1
        elif name in _ZERO_WIDTH:
            part = 0
        elif name == "SUBPATTERN":
            part = _span(arg[-1])
        elif name == "ATOMIC_GROUP":
            part = _span(arg)
        elif name in ("ASSERT", "ASSERT_NOT"):
            part = _span(arg[1])
        elif name == "BRANCH":
            spans = [_span(b) for b in arg[1]]
            part = None if any(s is None for s in spans) else max(spans, default=0)
        elif name in _REPEATS:
            lo, hi, inner = arg
            one = _span(inner)
            part = None if one is None or hi == _sre.MAXREPEAT else hi * one
        else:  # back-references, conditionals: no simple bound
            part = None
        if part is None:
            return None
        total += part
    return total


def _search_from(pattern: str, text_len: int, new_chars: int) -> int:
    span = max_span(pattern)
    if span is None:
        return 0
    return max(0, text_len - new_chars - span)


def find_stop_regex(text: str, new_chars: int, patterns: list[str], deadline: float | None = None) -> tuple[int, int, str] | None:
    """The earliest match ``(start, end, pattern)`` that reaches into the last ``new_chars``
    (every search done before ``deadline``, see ``search_deadline``)."""
    best: tuple[int, int, str] | None = None
    for p in patterns:
        m = _search(p, text, _search_from(p, len(text), new_chars), deadline)
        if m is not None and (best is None or m.start() < best[0]):
            best = (m.start(), m.end(), p)
    return best


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that begins (and is shorter than) some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def partial_stop_regex_len(text: str, patterns: list[str], deadline: float | None = None) -> int:
    """Length of the longest end of ``text`` that could still grow into a match of a pattern."""
    hold = 0
    for p in patterns:
        m = _search(p, text, _search_from(p, len(text), 0), deadline, partial=True)
        if m is not None and m.partial:
            hold = max(hold, len(text) - m.start())
    return hold
