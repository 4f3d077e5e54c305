"""Rank 0's side of a tensor-parallel group: starts the workers, watches them, stops them.

The engine process is rank 0: it runs the scheduler, the radix tree and sampling, and computes
its own shard like every other rank. Workers ``1 .. tp-1`` are spawned processes that load their
shards and then follow rank 0's batch plans (``batch_plan``). A worker that dies or raises breaks
the group: rank 0's next (or current) collective fails, and the driver turns that into one
``TensorParallelError`` naming the worker and what it reported, which ends the engine loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import torch
import torch.multiprocessing as mp

from radixlm.runtime.distributed.group import TPGroup, open_store
from radixlm.runtime.executor.batch_plan import send_stop
from radixlm.runtime.executor.tensor_parallel import TensorParallelError
from radixlm.runtime.executor.tp_worker import WorkerSpec, worker_main
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 900.0  # loading a shard of a large model
JOIN_TIMEOUT_S = 10.0


class TPDriver:
    """Starts ``tp_size - 1`` workers and holds rank 0's end of the group (a ``TensorParallel``)."""

    def __init__(self, args: ServerArgs, model_path: str, pool_tokens: int, num_threads: int, device: torch.device) -> None:
        size = args.tp_size
        timeout = args.tp_timeout
        self.store = open_store(size, timeout)
        ctx = mp.get_context("spawn")
        self.workers: list[mp.Process] = []
        self.conns: list[Connection] = []
        self.failure: str | None = None
        self._closing = False
        self._lock = threading.RLock()  # the watcher and the engine's loop thread both read the pipes
        self._on_failure: Callable[[TensorParallelError], None] | None = None
        self._ready: set[int] = set()  # workers whose "ready" a failure check read first
        for rank in range(1, size):
            receive, send = ctx.Pipe(duplex=False)
            # the secret travels in the pickled spec over spawn's pipe, never on a command line
            spec = WorkerSpec(rank, size, self.store.port, self.store.secret, args, model_path, pool_tokens, num_threads, timeout)
            proc = ctx.Process(target=worker_main, args=(spec, send), name=f"radixlm-tp{rank}", daemon=True)
            proc.start()
            send.close()
            self.workers.append(proc)
            self.conns.append(receive)
        self._watcher: threading.Thread | None = None
        try:
            self.group: TPGroup = self._join(device, timeout)
        except BaseException:
            self._kill_workers()
            raise

    # ------------------------------------------------------------ start-up
    def _join(self, device: torch.device, timeout: float) -> TPGroup:
        """Rank 0's process group, built while watching that no worker failed before joining."""
        result: list = []
        thread = threading.Thread(target=lambda: result.append(self._make_group(device, timeout)), daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while thread.is_alive():
            self.check(wait_s=0.1)
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers did not join within {timeout:.0f} s")
        if not result or isinstance(result[0], BaseException):
            raise TensorParallelError(f"could not build the tensor-parallel group: {result[0] if result else 'unknown error'}")
        return result[0]

    def _make_group(self, device: torch.device, timeout: float) -> TPGroup | BaseException:
        try:
            return TPGroup(self.store, 0, len(self.workers) + 1, device, timeout)
        except BaseException as exc:
            return exc

    def wait_ready(self) -> None:
        """Block until every worker has loaded its shard; raise what one reported instead."""
        pending = set(range(len(self.workers))) - self._ready
        deadline = time.monotonic() + READY_TIMEOUT_S
        while pending:
            for i in list(pending):
                if i in self._ready:
                    pending.discard(i)
                elif self.conns[i].poll():
                    kind, text = self.conns[i].recv()
                    if kind != "ready":
                        self._fail(text)
                    pending.discard(i)
                elif not self.workers[i].is_alive():
                    self._fail(f"tensor-parallel worker {i + 1} exited with code {self.workers[i].exitcode} while starting")
            if self.failure is not None:
                raise TensorParallelError(self.failure)
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers were not ready within {READY_TIMEOUT_S:.0f} s")
            if pending:
                wait([self.conns[i] for i in pending] + [self.workers[i].sentinel for i in pending], timeout=0.5)
        self._watcher = threading.Thread(target=self._watch, name="radixlm-tp-watch", daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------ failures
    def on_failure(self, hook: Callable[[TensorParallelError], None]) -> None:
        """Call ``hook`` (from the watcher thread) when a worker fails while the engine waits."""
        self._on_failure = hook
        if self.failure is not None:
            hook(TensorParallelError(self.failure))

    def _watch(self) -> None:
        """Wait for any worker to report an error or exit; record it and tell the engine."""
        while not self._closing and not self._collect(wait_s=1.0):
            pass
        if not self._closing and self._on_failure is not None:
            self._on_failure(TensorParallelError(self.failure or "the tensor-parallel workers' pipes closed"))

    def _collect(self, wait_s: float = 0.0) -> bool:
        """Record the first worker failure (its report, or its exit), waiting up to ``wait_s``
        for one; True once the group has failed."""
        if wait_s:
            try:
                if wait(list(self.conns) + [p.sentinel for p in self.workers], timeout=wait_s):
                    time.sleep(0.05)  # a worker's report arrives just before its exit
            except OSError:  # the pipes were closed: the group is shutting down
                return True
        with self._lock:
            for i, (conn, proc) in enumerate(zip(self.conns, self.workers)):
                try:
                    if conn.poll():
                        kind, text = conn.recv()
                        if kind == "error":
                            self._fail(text)
                        elif kind == "ready":  # read while joining: wait_ready must not wait for it again
                            self._ready.add(i)
                except (EOFError, OSError):
                    pass
                if self.failure is None and not proc.is_alive():
                    self._fail(f"tensor-parallel worker {i + 1} exited with code {proc.exitcode}")
            return self.failure is not None

    def _fail(self, text: str) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = text.strip()
                logger.error("%s", self.failure)

    def check(self, wait_s: float = 0.0) -> None:
        """Raise TensorParallelError if a worker has failed (before a step starts)."""
        if self._collect(wait_s):
            raise TensorParallelError(self.failure or "the tensor-parallel group was closed")

    def error_from(self, exc: BaseException) -> TensorParallelError:
        """The group's error after ``exc`` interrupted a step: what a worker reported, if anything."""
        deadline = time.monotonic() + 2.0
        while not self._collect(wait_s=0.05) and time.monotonic() < deadline:
            pass
        if self.failure is None:
            self._fail(f"tensor-parallel step failed on rank 0: {type(exc).__name__}: {exc}")
        return TensorParallelError(self.failure)

    # ------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop the workers (politely when the group is healthy) and join every one of them."""
        self._closing = True
        if self.failure is None and all(p.is_alive() for p in self.workers):
            try:
                send_stop(self.group)
            except Exception:
                logger.warning("telling the tensor-parallel workers to stop failed", exc_info=True)
        self._kill_workers(JOIN_TIMEOUT_S)
        self.failure = self.failure or "the tensor-parallel group was closed"
        self.group.close()

    def _kill_workers(self, grace_s: float = 0.0) -> None:
        """Join every worker, killing those still running after ``grace_s``."""
        self._closing = True
        deadline = time.monotonic() + grace_s
        for proc in self.workers:
            proc.join(max(deadline - time.monotonic(), 0.01))
        for proc in self.workers:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
