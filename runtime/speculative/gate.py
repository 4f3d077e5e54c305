"""The gate: which requests speculate this step, and with how many draft tokens.

Each request keeps a running estimate ``a`` of the chance that a draft token is accepted given
the ones before it were: discounted counts of accepted tokens and of rejections (a pass that
accepts ``j`` of ``k`` drafts is ``j`` successes and, if ``j < k``, one failure), with a prior.
With ``k`` drafts a verify pass yields ``1 + a + ... + a^k`` tokens on average and costs
``1 + (position_cost + draft_cost) * k`` plain passes (``draft_cost``: what proposing one draft
token costs, in plain passes: about 0 for n-gram lookup, measured for a draft model); the gate picks the ``k`` with the best ratio and
speculates only when that ratio reaches ``min_gain``. A request that stops speculating probes
again (a short draft) every ``probe_every`` steps, so a recovered acceptance is noticed.

The cost of a position grows with the batch (the pass turns compute-bound): the Speculator
measures it (``PassCost``) and passes it in. Above ``max_batch`` running decodes the gate turns
speculation off outright, except for requests that must not depend on their batch (``own_only``: a seeded sample stays reproducible only if its drafts depend on nothing
but its own history). Every decision depends only on the request's own history and, without
``own_only``, the batch size and the measured costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class GateConfig:
    """The gate's knobs (defaults chosen for CPU serving of small models)."""

    max_batch: int = 8  # above this many decoding requests, nobody speculates
    min_gain: float = 1.15  # expected tokens per unit of pass cost needed to speculate
    position_cost: float = 0.05  # cost of one extra verified position, in plain decode passes
    decay: float = 0.8  # weight of the older history in the running counts, per verify pass
    prior_rate: float = 0.6  # acceptance assumed before any evidence
    prior_weight: float = 2.0  # how many observations the prior is worth
    probe_every: int = 16  # steps without speculation before one probing draft
    probe_tokens: int = 2  # draft tokens of a probe


@dataclass
class _Track:
    accepted: float = 0.0  # discounted accepted draft tokens
    rejected: float = 0.0  # discounted rejections (at most one per pass)
    idle: int = 0  # steps since this request last speculated


class Gate:
    """Per-request speculation decisions from the measured acceptance."""

    def __init__(self, config: GateConfig | None = None) -> None:
        self.config = config or GateConfig()
        self._tracks: dict[object, _Track] = {}

    def rate(self, key: object) -> float:
        """The request's estimated per-token acceptance probability."""
        t = self._tracks.get(key) or _Track()
        c = self.config
        return (t.accepted + c.prior_rate * c.prior_weight) / (t.accepted + t.rejected + c.prior_weight)

    def gain(self, rate: float, k: int, draft_cost: float = 0.0, position_cost: float | None = None) -> float:
        """Expected tokens per pass with ``k`` drafts at acceptance ``rate``, over the pass's cost."""
        expected = sum(rate**i for i in range(k + 1))
        per_position = self.config.position_cost if position_cost is None else position_cost
        return expected / (1.0 + (per_position + draft_cost) * k)

    def best_k(self, rate: float, max_tokens: int, draft_cost: float = 0.0, position_cost: Callable[[int], float] | None = None) -> int:
        """The draft length with the best gain, or 0 when none reaches ``min_gain``.

        ``position_cost(k)``: the measured cost of each of ``k`` extra positions (default: the
        configured constant).
        """
        best, best_gain = 0, self.config.min_gain
        for k in range(1, max_tokens + 1):
            g = self.gain(rate, k, draft_cost, None if position_cost is None else position_cost(k))
            if g >= best_gain:
                best, best_gain = k, g
        return best

    def plan(self, key: object, max_tokens: int, batch: int, own_only: bool = False, draft_cost: float = 0.0, position_cost: Callable[[int], float] | None = None) -> int:
        """How many tokens request ``key`` may draft this step (0: decode plainly).

        ``position_cost(k)`` (measured, see ``PassCost``) replaces the configured constant when given.
        """
        c = self.config
        if max_tokens <= 0 or (batch > c.max_batch and not own_only):
            return 0
        t = self._tracks.setdefault(key, _Track())
        k = self.best_k(self.rate(key), max_tokens, draft_cost, position_cost)
        if k:
            t.idle = 0
            return k
        t.idle += 1
        if t.idle >= c.probe_every:
            t.idle = 0
            return min(c.probe_tokens, max_tokens)
        return 0

    def record(self, key: object, proposed: int, accepted: int) -> None:
        """Account one verify pass of request ``key``: ``accepted`` of ``proposed`` drafts kept."""
        if proposed <= 0:
            return
        t = self._tracks.setdefault(key, _Track())
        d = self.config.decay
        t.accepted = d * t.accepted + accepted
        t.rejected = d * t.rejected + (1.0 if accepted < proposed else 0.0)

    def forget(self, key: object) -> None:
        """Drop the request's history."""
        self._tracks.pop(key, None)
