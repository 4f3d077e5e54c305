"""PassCost: what verifying more positions costs, learned from the target's own pass times.

A decode pass's time grows with the tokens ``T`` it computes, and not smoothly: on a CPU a
matmul over 1-3 rows reads the weights once (nearly free extra rows) while 4 or more rows may
switch to a compute-bound kernel (measured here: 576x49152 head, 2 threads: 8.5 ms for 1-2 rows,
18 ms for 5). So the cost is measured, not assumed: a running mean of the pass time for each
``T`` seen, and a least-squares line ``a + b T`` over all passes (older ones discounted) for the
sizes not seen yet. A request in a batch of ``B`` rows drafting ``k`` tokens turns a pass of
``B`` tokens into one of about ``B (1 + k)``; per extra position that costs
``(t(B (1 + k)) - t(B)) / (k t(B))`` of a plain pass. Until there is a measurement for both
sizes (or a usable line) the configured prior is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.98  # weight of the older passes in the line fit, per pass
MEAN_DECAY = 0.8  # weight of the older passes in the per-size running means
MIN_WEIGHT = 8.0  # discounted passes needed before the line is trusted


@dataclass
class PassCost:
    """Pass seconds by tokens per pass: running means per size and a line fit over all sizes."""

    prior: float  # per-position cost (in a request's share of a plain pass) before measurements
    by_size: dict[int, float] = field(default_factory=dict)
    w: float = 0.0
    st: float = 0.0
    stt: float = 0.0
    sy: float = 0.0
    sty: float = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        """Account one decode or verify pass of ``tokens`` new tokens that took ``seconds``."""
        old = self.by_size.get(tokens)
        self.by_size[tokens] = seconds if old is None else MEAN_DECAY * old + (1 - MEAN_DECAY) * seconds
        d = DECAY
        self.w = d * self.w + 1.0
        self.st = d * self.st + tokens
        self.stt = d * self.stt + tokens * tokens
        self.sy = d * self.sy + seconds
        self.sty = d * self.sty + tokens * seconds

    def line(self) -> tuple[float, float] | None:
        """The fitted ``(a, b)``, or None while it cannot be trusted."""
        if self.w < MIN_WEIGHT:
            return None
        mean_t, mean_y = self.st / self.w, self.sy / self.w
        var = self.stt / self.w - mean_t * mean_t
        if var < 0.25:  # every pass had (nearly) the same size: a and b cannot be told apart
            return None
        b = (self.sty / self.w - mean_t * mean_y) / var
        a = mean_y - b * mean_t
        if b < 0 or a <= 0:
            return None
        return a, b

    def seconds(self, tokens: int) -> float | None:
        """Measured (or, from the line, estimated) seconds of a pass of ``tokens`` tokens."""
        if tokens in self.by_size:
            return self.by_size[tokens]
        fit = self.line()
        return None if fit is None else fit[0] + fit[1] * tokens

    def plain_pass_s(self, batch: int) -> float | None:
        """Seconds of a pass of ``batch`` rows without drafts, or None while unknown."""
        return self.seconds(batch)

    def position_cost(self, batch: int, k: int = 1) -> float:
        """Cost of each of ``k`` extra verified positions of a request in a batch of ``batch`` rows."""
        plain, more = self.seconds(batch), self.seconds(batch * (1 + k))
        if plain is None or more is None or plain <= 0 or k <= 0:
            return self.prior
        return max(more - plain, 0.0) / (k * plain)
