"""Beam search's bookkeeping, with transformers' meanings: live beams, finished hypotheses, scores.

Each round every live beam proposes its top candidates (token, log-probability); the
``max(2, 1 + #eos) * width`` best continuations over all beams are ranked by cumulative
log-probability. Those that end (an end token, a stop condition, or the token budget) and rank
within the first ``width`` become finished hypotheses, scored ``sum of log-probabilities /
generated_length ** length_penalty`` and kept ``width`` at most, best first; the best ``width``
that do not end are the next round's beams. ``early_stopping`` decides when the search ends:

- ``True``: as soon as ``width`` hypotheses are finished;
- ``False``: once the best live beam, scored at its current length, cannot beat the worst
  finished hypothesis (transformers' heuristic);
- ``"never"``: the same test with the best length a beam could still reach (with a positive
  length penalty: the budget).

This module holds no model and no KV: the engine (``runtime/engine/beam.py``) runs each round's
beams as requests, and the radix cache shares their common prefixes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

NEG_INF = -1.0e9  # transformers' "never chosen" score


@dataclass
class Beam:
    """One live beam: its output tokens so far and their log-probabilities."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    score: float = 0.0  # cumulative log-probability


@dataclass
class Hypothesis:
    """A finished beam: its tokens (the end token included), log-probabilities and score."""

    tokens: list[int]
    logprobs: list[float]
    score: float  # cumulative log-probability / len(tokens) ** length_penalty
    finish: dict[str, Any]  # SGLang's finish_reason: {"type": "stop"|"length", "matched": ...}


@dataclass
class Candidate:
    """A beam extended by one token."""

    beam: Beam
    token: int
    logprob: float

    @property
    def score(self) -> float:
        """Cumulative log-probability with the new token."""
        return self.beam.score + self.logprob


Stop = Callable[[list[int]], dict[str, Any] | None]  # output tokens -> finish_reason when they end there


def check_beam_options(width: Any, length_penalty: Any, early_stopping: Any) -> None:
    """Raise ValueError naming the first bad beam-search option."""
    if not isinstance(width, int) or isinstance(width, bool) or not 1 <= width <= MAX_BEAM_WIDTH:
        raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {width!r}")
    if not isinstance(length_penalty, (int, float)) or isinstance(length_penalty, bool) or length_penalty != length_penalty or abs(length_penalty) > 100:
        raise ValueError(f"length_penalty must be a number in [-100, 100], got {length_penalty!r}")
    if not (early_stopping is True or early_stopping is False or early_stopping == "never"):
        raise ValueError(f"early_stopping must be true, false or \"never\", got {early_stopping!r}")


MAX_BEAM_WIDTH = 16


class BeamSearch:
    """The state of one prompt's beam search (``advance`` once per round until ``done``)."""

    def __init__(self, width: int, max_new_tokens: int, length_penalty: float, early_stopping: bool | str, num_end_ids: int, stop: Stop) -> None:
        check_beam_options(width, length_penalty, early_stopping)
        self.width = width
        self.max_new_tokens = max_new_tokens
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.keep = max(2, 1 + num_end_ids) * width  # continuations ranked each round
        self.stop = stop
        self.beams: list[Beam] = [Beam()]  # one beam until the first round
        self.finished: list[Hypothesis] = []  # best first, ``width`` at most
        self.rounds = 0
        self._improvable = True  # transformers' "early stop heuristic unsatisfied"
        self.done = max_new_tokens == 0

    def candidates_per_beam(self) -> int:
        """How many top tokens each live beam must propose (enough for the ranking)."""
        return self.keep

    def advance(self, proposals: Sequence[Sequence[tuple[int, float]]]) -> None:
        """One round: ``proposals[i]`` holds live beam ``i``'s top (token, log-probability) pairs."""
        if len(proposals) != len(self.beams):
            raise ValueError(f"expected proposals for {len(self.beams)} beams, got {len(proposals)}")
        ranked = [Candidate(beam, token, logprob) for beam, tops in zip(self.beams, proposals) for token, logprob in tops]
        ranked.sort(key=lambda c: c.score, reverse=True)
        ranked = ranked[: self.keep]
        length = self.rounds + 1  # output tokens of every candidate
        ends: list[dict[str, Any] | None] = []
        for c in ranked:
            tokens = c.beam.tokens + [c.token]
            end = self.stop(tokens)
            if end is None and length >= self.max_new_tokens:
                end = {"type": "length", "matched": None}
            ends.append(end)
        self._add_finished(ranked, ends, length)
        self.beams = [Beam(c.beam.tokens + [c.token], c.beam.logprobs + [c.logprob], c.score) for c, end in zip(ranked, ends) if end is None][: self.width]
        self.rounds = length
        self._update_improvable()
        all_finished = len(self.finished) == self.width
        self.done = not self.beams or not self._improvable or (all_finished and self.early_stopping is True)

    def _add_finished(self, ranked: list[Candidate], ends: list[dict[str, Any] | None], length: int) -> None:
        """Keep the candidates ending this round within the first ``width`` ranks, as transformers does."""
        if len(self.finished) == self.width and self.early_stopping is True:
            return
        if not self._improvable:
            return
        for rank, (c, end) in enumerate(zip(ranked, ends)):
            if end is None or rank >= self.width:
                continue
            score = c.score / (length**self.length_penalty)
            self.finished.append(Hypothesis(c.beam.tokens + [c.token], c.beam.logprobs + [c.logprob], score, end))
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.width :]

    def _update_improvable(self) -> None:
        """Whether the best live beam could still beat the worst finished hypothesis."""
        if not self._improvable or len(self.finished) < self.width or not self.beams:
            return
        if self.early_stopping == "never" and self.length_penalty > 0:
            best_length = self.max_new_tokens
        else:
            best_length = self.rounds
        best_possible = self.beams[0].score / (best_length**self.length_penalty)
        self._improvable = best_possible > self.finished[-1].score

    def results(self) -> list[Hypothesis]:
        """The finished hypotheses, best first (call once ``done``)."""
        return list(self.finished)
