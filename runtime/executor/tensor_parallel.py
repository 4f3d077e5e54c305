"""What the model runner needs from rank 0's end of a tensor-parallel group, and the group's error.

The runner does not start workers itself: the engine's assembly hands it a ``StartTP`` (the
driver class of ``tp_driver``), which it calls once it has sized the pool. The driver spawns
workers that build their own runners, so the runner must not import the driver.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from radixlm.runtime.distributed.group import TPGroup
from radixlm.runtime.faults import FatalEngineError
from radixlm.runtime.server_args import ServerArgs


class TensorParallelError(FatalEngineError):
    """A tensor-parallel worker died, raised, or stopped answering: the group cannot go on."""


class TensorParallel(Protocol):
    """Rank 0's end of a started tensor-parallel group, as the model runner uses it."""

    group: TPGroup

    def wait_ready(self) -> None:
        """Block until every worker has loaded its shard (TensorParallelError otherwise)."""
        ...

    def check(self, wait_s: float = 0.0) -> None:
        """Raise TensorParallelError if a worker has failed."""
        ...

    def error_from(self, exc: BaseException) -> TensorParallelError:
        """The group's error after ``exc`` interrupted a step."""
        ...

    def on_failure(self, hook: Callable[[TensorParallelError], None]) -> None:
        """Have ``hook`` called when a worker fails between steps."""
        ...

    def close(self) -> None:
        """Stop and join the workers."""
        ...


# (args, model_path, pool_tokens per rank, threads per rank, rank 0's device) -> the started group
StartTP = Callable[[ServerArgs, str, int, int, torch.device], TensorParallel]
