"""How ``select`` picks a choice from the log-probabilities of its tokens (SGLang's three methods).

Every choice is scored in context: its tokens are those that follow the prompt's tokens in
``tokenize(prompt + choice)``. When the prompt's last token merges with the choice's first
characters, the span starts at the first token that differs from the prompt's tokens.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

Logprob = tuple  # (logprob, token_id, token_text or None)


@dataclass
class ChoiceScores:
    """The measured log-probabilities of each choice's tokens."""

    choices: list[str]
    token_logprobs: list[list[Logprob]]  # in context, one list per choice
    unconditional: list[list[Logprob]] | None = None  # the same tokens without the prompt

    @property
    def normalized(self) -> list[float]:
        """Mean token logprob of each choice."""
        return [_mean([t[0] for t in lps]) for lps in self.token_logprobs]

    def meta_info(self) -> dict[str, Any]:
        """SGLang's select meta_info fields."""
        meta: dict[str, Any] = {
            "normalized_prompt_logprobs": self.normalized,
            "input_token_logprobs": self.token_logprobs,
            "output_token_logprobs": [[] for _ in self.choices],
        }
        if self.unconditional is not None:
            meta["unconditional_token_logprobs"] = self.unconditional
        return meta


class ChoicesMethod(ABC):
    """A rule that ranks choices; ``select`` takes the highest key (the first one on ties)."""

    needs_unconditional: bool = False
    supports_temperature: bool = True

    @abstractmethod
    def keys(self, scores: ChoiceScores) -> list[Any]:
        """One comparable key per choice (higher is better)."""

    def extra_meta(self, scores: ChoiceScores) -> dict[str, Any]:
        """Method-specific fields added to the select's meta_info."""
        return {}

    def decide(self, scores: ChoiceScores, temperature: float = 0.0, rng: random.Random | None = None) -> tuple[int, dict[str, Any]]:
        """The index of the chosen choice and the select's meta_info."""
        keys = self.keys(scores)
        if temperature > 0:
            weights = [math.exp((k - max(keys)) / temperature) for k in keys]
            index = (rng or random.Random()).choices(range(len(keys)), weights=weights)[0]
        else:
            index = max(range(len(keys)), key=keys.__getitem__)
        return index, {**scores.meta_info(), **self.extra_meta(scores), "choice_keys": keys}

    def __repr__(self) -> str:
        return _NAMES.get(type(self), type(self).__name__)


class TokenLengthNormalized(ChoicesMethod):
    """The choice with the highest mean token logprob (SGLang's default)."""

    def keys(self, scores: ChoiceScores) -> list[Any]:
        return scores.normalized


class GreedyTokenSelection(ChoicesMethod):
    """The choice whose first token is likeliest, ties broken by later tokens.

    A choice shorter than another is padded with its own mean logprob, so a choice that is a
    prefix of a longer one is compared fairly.
    """

    supports_temperature = False

    def _matrix(self, scores: ChoiceScores) -> list[list[float]]:
        width = max(len(lps) for lps in scores.token_logprobs)
        rows = []
        for lps in scores.token_logprobs:
            values = [t[0] for t in lps]
            rows.append(values + [_mean(values)] * (width - len(values)))
        return rows

    def keys(self, scores: ChoiceScores) -> list[Any]:
        return [tuple(row) for row in self._matrix(scores)]  # lexicographic = greedy elimination

    def extra_meta(self, scores: ChoiceScores) -> dict[str, Any]:
        return {"greedy_logprob_matrix": self._matrix(scores)}


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    """The choice with the highest mean of (logprob in context - logprob without the prompt).

    Costs one more batched prefill (the choices' tokens alone). The first unconditional
    token has no logprob and counts as 0.
    """

    needs_unconditional = True

    def _values(self, scores: ChoiceScores) -> list[float]:
        if scores.unconditional is None:
            raise ValueError("unconditional_likelihood_normalized needs the unconditional logprobs")
        out = []
        for cond, uncond in zip(scores.token_logprobs, scores.unconditional):
            if len(cond) != len(uncond):
                raise ValueError("conditional and unconditional logprobs differ in length")
            base = [u[0] if u[0] is not None else 0.0 for u in uncond]
            out.append(_mean([c[0] - b for c, b in zip(cond, base)]))
        return out

    def keys(self, scores: ChoiceScores) -> list[Any]:
        return self._values(scores)

    def extra_meta(self, scores: ChoiceScores) -> dict[str, Any]:
        return {"normalized_unconditional_prompt_logprobs": self._values(scores)}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()

_NAMES = {
    TokenLengthNormalized: "token_length_normalized",
    GreedyTokenSelection: "greedy_token_selection",
    UnconditionalLikelihoodNormalized: "unconditional_likelihood_normalized",
}


def choice_spans(prompt_ids: list[int], full_ids: list[list[int]], choices: list[str]) -> list[int]:
    """Where each choice's tokens start in ``full_ids`` (the first token that differs from the prompt's)."""
    starts = []
    for ids, choice in zip(full_ids, choices):
        k = 0
        limit = min(len(prompt_ids), len(ids))
        while k < limit and ids[k] == prompt_ids[k]:
            k += 1
        if k >= len(ids):
            raise ValueError(f"choice {choice!r} adds no tokens after the prompt")
        if k == 0:
            raise ValueError("select needs text before it (the first token has no logprob)")
        starts.append(k)
    return starts


def score_choices(backend, prompt: str, choices: list[str], method: ChoicesMethod, **options: Any) -> tuple[ChoiceScores, list[dict[str, Any]]]:
    """Score every choice in one batched prefill that shares the prompt's KV.

    ``options`` go to every ``backend.prefill`` (``lora``: the adapter whose logprobs they are).
    Returns the scores and the meta_info of each scoring request (prompt/cached token counts).
    """
    ids = backend.tokenize([prompt] + [prompt + c for c in choices])
    prompt_ids, full = ids[0], ids[1:]
    starts = choice_spans(prompt_ids, full, choices)
    first = min(starts)
    outs = backend.prefill(full, logprob_start_len=first, **options)
    token_lps = [[tuple(t) for t in out["meta_info"]["input_token_logprobs"][s - first :]] for out, s in zip(outs, starts)]
    scores = ChoiceScores(list(choices), token_lps)
    if method.needs_unconditional:
        spans = [ids_[s:] for ids_, s in zip(full, starts)]
        alone = backend.prefill(spans, logprob_start_len=0, **options)
        scores.unconditional = [[tuple(t) for t in out["meta_info"]["input_token_logprobs"]] for out in alone]
    return scores, [o["meta_info"] for o in outs]
