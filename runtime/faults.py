"""Failures: the error that ends the engine loop, and fault injection for tests.

Fault injection makes chosen requests fail at a chosen stage of the engine loop.

Off unless the engine is started with ``debug_fault_injection=True`` (``--debug-fault-injection``).
A request whose rid starts with ``fault-<stage>-`` then fails at that stage; every other request
must go on unharmed, which is what the reliability tests check.
"""

from __future__ import annotations

import torch

STAGES = ("admit", "grammar", "sample", "forward", "output", "nan")
# ``fault-tp_worker-``: every tensor-parallel worker raises in that request's forward pass, which
# ends the engine (not a per-request stage: without workers nothing fails)


class FatalEngineError(RuntimeError):
    """An error after which the engine cannot go on (a tensor-parallel peer died): it is not
    retried per request; the loop ends and every waiter gets it."""


class InjectedFault(RuntimeError):
    """The error an injected fault raises."""


class FaultInjector:
    """Raises (or poisons logits) for requests that asked for a fault at a stage."""

    @staticmethod
    def wants(rid: str, stage: str) -> bool:
        """True when the request ``rid`` asked to fail at ``stage``."""
        return rid.startswith(f"fault-{stage}-")

    def check(self, rid: str, stage: str) -> None:
        """Raise InjectedFault if ``rid`` asked to fail at ``stage``."""
        if self.wants(rid, stage):
            raise InjectedFault(f"injected fault at {stage}")

    def poison(self, logits: torch.Tensor, spans: list[tuple[str, int, int]]) -> None:
        """Set the logits of requests that asked for ``nan`` to NaN (spans: rid, first, count)."""
        with torch.inference_mode():  # the logits are inference tensors
            for rid, first, count in spans:
                if self.wants(rid, "nan"):
                    logits[first : first + count] = float("nan")
