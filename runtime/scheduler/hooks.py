"""The disaggregation hook: the calls the scheduler makes into prefill/decode hand-over code, and
what that code may do to the scheduler in return.

The scheduler owns both protocols and knows no implementation; ``runtime/disaggregation/``
implements ``DisaggregationHook`` without importing the scheduler, and the engine's assembly
hands one to ``Scheduler.attach_pd``, which binds it with the scheduler as ``SchedulerOps``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from radixlm.radix_cache.manager import KVManager, KVState
from radixlm.radix_cache.tree import TreeNode
from radixlm.runtime.request import FinishReason, Req, ReqOutput


class SchedulerOps(Protocol):
    """What a disaggregation hook may read and do on the scheduler it is bound to (loop thread only)."""

    kv: KVManager
    waiting: list[Req]  # a request the hook admits leaves this queue
    running: list[Req]  # a request whose KV arrived joins this one and decodes

    def reserve_admission(self, req: Req, prefix_slots: torch.Tensor, node: TreeNode, new_len: int) -> KVState | None:
        """Lock ``req``'s cached prefix and reserve its slots up to ``new_len``; None when KV is short now."""
        ...

    def note_admission(self, req: Req, cached: int, node: TreeNode) -> None:
        """Record a request's prefix hit at its first admission."""
        ...

    def fail(self, req: Req, message: str) -> None:
        """Take a request out of the queues and end it with an error."""
        ...

    def finish(self, req: Req, reason: FinishReason) -> None:
        """End a request: free (and, unless it failed, cache) its KV and send its final output."""
        ...


class DisaggregationHook(Protocol):
    """The scheduler's calls into one side of a prefill/decode pair, at admission, each step and at finish."""

    def bind(self, sched: SchedulerOps) -> None:
        """Attach to the scheduler whose requests this side hands over."""
        ...

    def requests(self) -> list[Req]:
        """Requests holding KV outside the running queue (waiting for their hand-over)."""
        ...

    def on_add(self, req: Req) -> None:
        """A request was queued (raises when the link it needs is down)."""
        ...

    def takes(self, req: Req) -> bool:
        """True when ``req`` gets its prompt's KV from the other side instead of computing it."""
        ...

    def admit(self, req: Req) -> bool:
        """Admit a request that ``takes`` says arrives by hand-over; False when KV is short now."""
        ...

    def drop_aborted(self, message: str, status: int | None) -> None:
        """End the requests this side holds that are marked for abortion (each step)."""
        ...

    def abort(self, rid: str, cache_salt: Any) -> bool:
        """Mark a request this side holds for abortion; False if unknown."""
        ...

    def marks_for(self, req: Req, marks: list[int]) -> list[int]:
        """The prompt positions whose linear-attention states ``req`` must keep: ``marks`` and what this side hands over."""
        ...

    def prepare(self, req: Req, reason: FinishReason) -> object | None:
        """At finish, before the request's KV is released: what to hand over (None: nothing)."""
        ...

    def hand_over(self, job: object, out: ReqOutput, sink: Callable[[ReqOutput], None]) -> None:
        """Send what ``prepare`` returned; ``out`` reaches ``sink`` once the hand-over ends."""
        ...
