"""What a proposer returns, and the interface every proposer implements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from radixlm.radix_cache.manager import KVManager
from radixlm.runtime.request import Req
from radixlm.runtime.sampler import SamplingRow, sample_draft


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


class ChainRow(Protocol):
    """A row of a drafting pass: which request (and its place in the caller's list) it drafts for."""

    index: int
    req: Req


Row = TypeVar("Row", bound=ChainRow)


def draw_chains(rows: list[Row], num_tokens: list[int], generator: torch.Generator, step: Callable[[list[Row]], torch.Tensor],
                follow: Callable[[Row, int, int], Row]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:  # fmt: skip
    """Draft each row's chain, one pass for all rows at a time: ``step(rows)`` gives the logits of
    each row's next token (it may reorder ``rows`` in place), a token is drawn with the request's
    own sampling settings (greedy rows: the argmax), and ``follow(row, j, token)`` gives the row
    that feeds ``rows[j]``'s token, while its request has fewer than ``num_tokens[row.index]``
    drafts. Returns the drafts and the laws ``q`` they were drawn from (none for greedy rows), by
    ``row.index``."""
    drafted: list[list[int]] = [[] for _ in num_tokens]
    laws: list[list[torch.Tensor]] = [[] for _ in num_tokens]
    while rows:
        logits = step(rows)
        srows = [SamplingRow(r.req.params, r.req.input_ids, r.req.output_ids + drafted[r.index], r.req.generator, (), False, 0) for r in rows]
        tokens, q = sample_draft(logits, srows, generator)
        next_rows = []
        for j, row in enumerate(rows):
            drafted[row.index].append(tokens[j])
            if q is not None and not row.req.params.greedy:
                laws[row.index].append(q[j])
            if len(drafted[row.index]) < num_tokens[row.index]:
                next_rows.append(follow(row, j, tokens[j]))
        rows = next_rows
    return drafted, laws


def reserved(kv: KVManager, req: Req, end: int) -> bool:
    """Whether the request's slots up to position ``end`` are reserved for drafting (False where
    the pool is short or ``end`` is past its slot table's width)."""
    try:
        return kv.reserve(req.kv, end)
    except ValueError:
        return False
