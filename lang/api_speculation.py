"""API speculative execution (``@function(num_api_spec_tokens=N)``): serve several ``gen`` calls from one request.

Completion models: a ``gen`` asks for at least N tokens with no stop strings; the text it got is
kept as a ``Speculation`` of how the state continues. The following ``gen`` calls, and the
constant text between them, are served from it as long as the state's text still spells the
speculated text: each takes the speculated text up to its own stop string (or its own token
limit), exactly what it would have generated alone at temperature 0 from the same tokens.

Chat models cannot continue a partly written assistant message, so a ``MessagePlan`` collects
the constant texts and ``gen`` calls of one assistant message; at the message's end one request
writes the whole message, and the plan splits it among the calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_SPEC_FREE = ("stop", "max_new_tokens")  # parameters a speculation does not fix


def spec_key(params: dict[str, Any]) -> tuple:
    """The sampling parameters a speculation was made with, less those each ``gen`` applies itself."""
    return tuple(sorted((k, repr(v)) for k, v in params.items() if k not in _SPEC_FREE and v is not None))


def stop_list(stop: Any) -> list[str]:
    """``stop`` (None, a string or a list) as a list of non-empty strings."""
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else list(stop)) if s]


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found, key=lambda f: (f[0], -len(f[1]))) if found else None


@dataclass
class Speculation:
    """Text a completion model wrote after ``origin``, kept to serve the state's next ``gen`` calls.

    ``token_ends`` are where each generated token ends in ``text`` when the server's token texts
    spell the text exactly (then ``gen`` token limits are honoured); ``finished`` is True when the
    model stopped by itself (end of sequence) rather than at ``max_tokens``.
    """

    origin: str
    text: str
    finished: bool
    key: tuple
    max_tokens: int
    token_ends: list[int] | None = None

    def remaining(self, current: str) -> str | None:
        """The speculated text after ``current``, or None when ``current`` left the speculation."""
        if not current.startswith(self.origin):
            return None
        done = current[len(self.origin) :]
        return self.text[len(done) :] if self.text.startswith(done) else None

    def serve(self, current: str, stop: Any, max_tokens: int, fresh: bool = False) -> tuple[str, dict[str, Any]] | None:
        """What a ``gen`` at ``current`` would produce, with its finish reason; None when the speculation cannot tell.

        ``fresh``: the speculation was made for this very ``gen`` (then running out at
        ``max_tokens`` is the gen's own limit when it asked for as many tokens).
        """
        rest = self.remaining(current)
        if rest is None:
            return None
        start = len(self.text) - len(rest)
        ends = None if self.token_ends is None else [e - start for e in self.token_ends if e > start]
        hit = _first_stop(rest, stop_list(stop))
        if hit is not None:
            pos, matched = hit
            if ends is not None:
                needed = next(i for i, e in enumerate(ends) if e >= pos + len(matched)) + 1
                if needed > max_tokens:
                    return rest[: ends[max_tokens - 1]], {"type": "length", "length": max_tokens}
            return rest[:pos], {"type": "stop", "matched": matched}
        if ends is not None and len(ends) >= max_tokens:
            return rest[: ends[max_tokens - 1]], {"type": "length", "length": max_tokens}
        if self.finished:
            return rest, {"type": "stop", "matched": None}
        if fresh and start == 0 and max_tokens >= self.max_tokens:
            return rest, {"type": "length", "length": max_tokens}
        return None


def token_ends(text: str, tokens: list[str] | None) -> list[int] | None:
    """Where each token ends in ``text``, or None when the token texts do not spell ``text`` exactly."""
    if not tokens or "".join(tokens) != text:
        return None
    ends, at = [], 0
    for t in tokens:
        at += len(t)
        ends.append(at)
    return ends


@dataclass
class Term:
    """A piece of a planned assistant message: constant ``text``, or a ``gen`` named ``name``."""

    text: str | None = None
    name: str | None = None
    stops: list[str] = field(default_factory=list)
    is_gen: bool = False


@dataclass
class MessagePlan:
    """The constant texts and ``gen`` calls of one assistant message, in order."""

    terms: list[Term] = field(default_factory=list)
    params: dict[str, Any] | None = None  # the sampling parameters of its gen calls (all the same)
    labels: list[str] = field(default_factory=list)

    @property
    def has_gen(self) -> bool:
        """True when the message holds at least one ``gen``."""
        return any(t.is_gen for t in self.terms)

    def add_text(self, text: str) -> None:
        """Append constant text."""
        self.terms.append(Term(text=text))

    def add_gen(self, name: str | None, params: dict[str, Any], label: str) -> None:
        """Append a ``gen``; its sampling parameters (less stop and max_tokens) must match the others'."""
        if self.params is not None and spec_key(params) != spec_key(self.params):
            raise ValueError(f"{label}: the gen calls of one speculated assistant message must share their sampling parameters (except stop and max_tokens); {self.labels[0]} differs")
        self.params = self.params or params
        self.labels.append(label)
        self.terms.append(Term(name=name, stops=stop_list(params.get("stop")), is_gen=True))

    def match(self, message: str) -> list[str] | None:
        """Each term's text in ``message`` (constants must appear verbatim), or None when it does not fit.

        A ``gen`` ends at its first stop string, else where the next constant text begins;
        the last term, if a ``gen``, takes the rest; text after a last constant is dropped.
        """
        out, pos = [], 0
        for i, term in enumerate(self.terms):
            if not term.is_gen:
                if not message.startswith(term.text, pos):
                    return None
                out.append(term.text)
                pos += len(term.text)
                continue
            if i == len(self.terms) - 1:
                out.append(message[pos:])
                pos = len(message)
                continue
            nxt = self.terms[i + 1]
            stops = term.stops or ([nxt.text] if not nxt.is_gen and nxt.text else [])
            hit = _first_stop(message[pos:], stops)
            if hit is None:
                return None
            out.append(message[pos : pos + hit[0]])
            pos += hit[0]
        return out  # text the model wrote after the last constant is not part of the message
