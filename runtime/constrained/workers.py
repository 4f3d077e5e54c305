"""Killable worker processes: a compile that overruns its deadline is ended by killing its worker.

A thread stuck in a native library call cannot be stopped: it keeps a core busy and its memory
growing for as long as the build runs (outlines-core's index of ``(a|b)*a(a|b){20}`` never
finished in our runs). A process can be killed. Each worker is a fresh interpreter running a
small script (no fork of a threaded parent, no import of the radixlm package), sent its
initial payload (the vocabulary) once; idle workers are reused, and one spare is kept started
so a compile rarely waits for a start-up.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection


class WorkerTimeout(TimeoutError):
    """A request ran past its deadline; its worker was killed."""


class WorkerCrashed(RuntimeError):
    """A worker died (killed from outside, out of memory) before answering."""


class _Worker:
    """One worker process and its two pipe ends."""

    def __init__(self, script: str, init: object, startup_timeout: float) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", script, str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.outbox = Connection(to_child_w, readable=False)
        self.inbox = Connection(from_child_r, writable=False)
        self.outbox.send(init)
        self.answer(startup_timeout)

    def answer(self, timeout: float) -> object:
        """The worker's next reply; WorkerTimeout (worker killed) if none comes in ``timeout`` s."""
        try:
            ready = self.inbox.poll(max(timeout, 0.0))
        except (OSError, EOFError):
            ready = True
        if not ready:
            self.kill()
            raise WorkerTimeout(f"no answer within {timeout:g} s")
        try:
            return self.inbox.recv()
        except (OSError, EOFError):
            self.kill()
            raise WorkerCrashed(f"the worker process ended (exit code {self.proc.poll()})") from None

    def kill(self) -> None:
        """End the process now and close the pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.outbox.close()
        self.inbox.close()


class WorkerPool:
    """Processes running ``script`` that answer pickled requests; an overrun kills its worker."""

    def __init__(self, script: str, init: object, spares: int = 1, max_idle: int = 4, startup_timeout: float = 60.0) -> None:
        self.script = script
        self.init = init
        self.spares = spares
        self.max_idle = max_idle
        self.startup_timeout = startup_timeout
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._starting = 0
        self._lock = threading.Lock()
        self._closed = False
        self.started = 0  # workers started so far (a figure for tests and logs)
        self.last_startup_s: float | None = None

    def _start(self) -> _Worker:
        t0 = time.perf_counter()
        worker = _Worker(self.script, self.init, self.startup_timeout)
        self.last_startup_s = time.perf_counter() - t0
        with self._lock:
            self.started += 1
        return worker

    def warm(self) -> None:
        """Start the spare workers now, in the background."""
        self._top_up()

    def _top_up(self) -> None:
        """Start spare workers in the background until ``spares`` are idle or starting."""
        with self._lock:
            missing = self.spares - len(self._idle) - self._starting
            if self._closed or missing <= 0:
                return
            self._starting += missing
        for _ in range(missing):
            threading.Thread(target=self._start_spare, name="radixlm-grammar-spawn", daemon=True).start()

    def _start_spare(self) -> None:
        try:
            worker = self._start()
        except Exception:
            with self._lock:
                self._starting -= 1
            return
        with self._lock:
            self._starting -= 1
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def run(self, request: object, timeout: float) -> object:
        """Send ``request`` to a worker and return its answer within ``timeout`` seconds.

        Raises WorkerTimeout (the worker is killed and replaced) or WorkerCrashed. The time to
        start a worker, when none is idle, is not counted in ``timeout``.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool is shut down")
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = self._start()
        with self._lock:
            self._busy.add(worker)
        self._top_up()
        try:
            worker.outbox.send(request)
            answer = worker.answer(timeout)
        except BaseException:
            with self._lock:
                self._busy.discard(worker)
            worker.kill()
            raise
        with self._lock:
            self._busy.discard(worker)
            keep = not self._closed and len(self._idle) < self.max_idle
            if keep:
                self._idle.append(worker)
        if not keep:
            worker.kill()
        return answer

    def alive(self) -> int:
        """Worker processes now running (idle or busy)."""
        with self._lock:
            return sum(1 for w in [*self._idle, *self._busy] if w.proc.poll() is None)

    def close(self) -> None:
        """Kill every worker, busy ones included (their callers get WorkerCrashed)."""
        with self._lock:
            self._closed = True
            idle, busy = list(self._idle), list(self._busy)
            self._idle.clear()
        for worker in idle:
            worker.kill()
        for worker in busy:  # their run() sees the pipe close, then cleans up
            if worker.proc.poll() is None:
                worker.proc.kill()
