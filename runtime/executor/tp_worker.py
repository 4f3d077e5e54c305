"""A tensor-parallel worker process: joins the group, loads its shard, runs the batches rank 0 sends."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from radixlm.runtime.distributed.group import TPGroup, join_store
from radixlm.runtime.executor.batch_plan import receive_batch
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.faults import InjectedFault
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.threads import configure_threads

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """What a worker needs to start: its rank, the rendezvous port and secret, and the engine's options."""

    rank: int
    size: int
    port: int
    secret: bytes = field(repr=False)  # signs the store's records; reaches the worker through spawn's pipe
    args: ServerArgs
    model_path: str
    pool_tokens: int
    num_threads: int
    timeout_s: float


def _die_with_parent() -> None:
    """Ask Linux to kill this process when the engine process (the thread that started it) ends."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the group's broken connections end the worker
        pass


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of worker ``spec.rank``: reports ``("ready", None)`` or ``("error", text)`` on ``conn``."""
    _die_with_parent()
    try:
        configure_threads(spec.num_threads)
        device = torch.device(spec.args.resolved_device())
        if device.type == "cuda":
            device = torch.device("cuda", spec.rank)
            torch.cuda.set_device(device)
        group = TPGroup(join_store(spec.port, spec.size, spec.timeout_s, spec.secret), spec.rank, spec.size, device, spec.timeout_s)
        runner = ModelRunner(spec.args, spec.model_path, group=group, pool_tokens=spec.pool_tokens)
    except BaseException:
        conn.send(("error", f"tensor-parallel worker {spec.rank} failed to start:\n{traceback.format_exc()}"))
        os._exit(1)
    conn.send(("ready", None))
    try:
        while (batch := receive_batch(group, runner.kv_pool, runner.attn_backend, runner.state_pool, runner.state_snapshots)) is not None:
            if batch.inject_worker_fault:
                raise InjectedFault("injected fault in a tensor-parallel worker")
            runner.forward(batch)
    except BaseException:
        try:
            conn.send(("error", f"tensor-parallel worker {spec.rank} failed:\n{traceback.format_exc()}"))
        finally:
            os._exit(1)  # its peers see the group's connections close
    group.close()
    conn.close()
    # Leave without the interpreter's teardown: a C++ thread of the process group still being
    # torn down there was seen to abort it ("terminate called without an active exception",
    # exit code -6) after a clean stop, now and then under load.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
