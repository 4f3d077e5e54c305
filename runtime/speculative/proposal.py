"""What a proposer returns, and the interface every proposer implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from radixlm.runtime.request import Req


@dataclass
class Proposal:
    """Draft tokens for one request.

    ``probs`` is float32 ``[len(tokens), V]``: the draft distribution q each token was sampled
    from; None for a deterministic proposal (n-gram, prediction), which is verified with the
    point-mass rule.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """A source of draft tokens."""

    name: str

    def propose(self, reqs: list[Req], num_tokens: list[int]) -> list[Proposal]:
        """At most ``num_tokens[i]`` draft tokens for ``reqs[i]`` (an empty Proposal for none)."""
        ...

    def release(self, req: Req) -> None:
        """Drop per-request state (the request ended or was retracted)."""
        ...
