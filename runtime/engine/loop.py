"""The engine loop: its own thread, the inbox it drains between scheduler steps, and how it ends.

Callers never touch scheduler state: requests, aborts and queries go through an inbox that the
loop thread drains between steps; results come back through per-request sinks.

Every submitted request is registered until its final output is delivered. No exception leaves
the loop; if the loop ends anyway (a fatal error, or shutdown), every registered request gets a
final error output at once and the loop reports itself dead, so no waiter ever waits forever.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from radixlm.runtime.engine.assembly import EngineParts, build_parts
from radixlm.runtime.faults import FatalEngineError
from radixlm.runtime.request import FinishReason, Req, ReqOutput
from radixlm.runtime.scheduler.step import Scheduler
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

STALLED_WAIT_S = 0.002  # after a step that could run nothing, wait this long for news before the next

_STOP = object()
_CALL_POLL_S = 0.5  # how often a caller waiting on the loop checks that it still runs


class EngineError(RuntimeError):
    """The engine loop failed or was shut down while a request was in flight."""


class EngineLoop:
    """The thread that builds the engine's parts and then runs scheduler steps, serving its inbox.

    The model is loaded on this thread and every tensor operation runs there. Constructing one
    blocks until the parts are built (``parts``), re-raising what went wrong while loading.
    """

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False  # close() was called
        self.error: BaseException | None = None
        self._in_flight: dict[tuple[str | None, str], Req] = {}  # (cache_salt, rid): submitted, final output not yet delivered
        self._in_flight_lock = threading.Lock()
        self._stopped = False  # set (under the lock) once the loop has ended
        self._check_every_step = args.debug_check_accounting or os.environ.get("RADIXLM_CHECK_ACCOUNTING") == "1"
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._run, args=(ready,), name="radixlm-engine", daemon=True)
        self.thread.start()
        self.parts: EngineParts = ready.result()  # re-raises what went wrong while loading

    # ------------------------------------------------------------- the thread
    def _run(self, ready: concurrent.futures.Future) -> None:
        try:
            rt = build_parts(self.args)
        except BaseException as exc:
            with self._in_flight_lock:
                self._stopped = True
            ready.set_exception(exc)
            return
        rt.runner.on_failure(lambda exc: self.inbox.put(("fatal", exc)))  # a worker died between steps
        if rt.pd is not None and rt.pd.role == "decode":  # received KV is stored on this thread
            rt.pd.side.post = lambda fn: self.inbox.put(("call", (fn, concurrent.futures.Future())))
        ready.set_result(rt)
        message = "the engine is shutting down"
        try:
            self._loop(rt.scheduler)
        except BaseException as exc:  # a bug outside any request's guard, or a fatal error: end cleanly, loudly
            logger.critical("the engine loop died", exc_info=not isinstance(exc, FatalEngineError))
            self.error = exc
            message = f"the engine stopped after an internal error: {exc}"
        finally:
            self._stop(rt.scheduler, message)
            if rt.pd is not None:
                rt.pd.close()
            try:
                rt.kv.close_tiers()  # what the tree holds goes down to disk, queued writes finish
            except Exception:
                logger.exception("saving the KV tiers at shutdown failed")
            rt.runner.close()

    def _loop(self, sched: Scheduler) -> None:
        stalled = False  # the last step ran nothing though work waits (memory, a disk read): do not spin
        while True:
            block = not sched.has_work()
            try:
                item = self.inbox.get(block=block or stalled, timeout=STALLED_WAIT_S if stalled and not block else None)
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    return
                self._handle(sched, item)
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    item = None
            stalled = False
            try:
                stalled = not sched.step() and sched.has_work()
            except FatalEngineError:
                raise
            except Exception as exc:  # no request owns this error: fail what runs, keep serving
                logger.exception("engine step failed")
                self.error = exc
                sched.fail_running(f"internal error: {exc}")
            if self._check_every_step:
                sched.check_accounting(full=not sched.has_work())  # a broken invariant ends the loop, loudly

    @staticmethod
    def _handle(sched: Scheduler, item: tuple) -> None:
        kind, payload = item
        if kind == "fatal":
            raise payload
        if kind == "add":
            sched.add(payload)
        elif kind == "call":
            fn, fut = payload
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)

    def _stop(self, sched: Scheduler, message: str) -> None:
        """After the loop: end what the scheduler holds, then answer every other waiter."""
        with self._in_flight_lock:
            self._stopped = True  # from here on, nothing new is accepted
        try:
            sched.abort_all(message, status=503)
        except Exception:
            logger.exception("aborting requests at shutdown failed")
        self._answer_queued_calls(message)
        with self._in_flight_lock:
            left = list(self._in_flight.values())
        for req in left:  # still queued in the inbox, or lost by a failure above (the sink unregisters it)
            req.finish = FinishReason("abort", message=message, status=503)
            try:
                req.sink(ReqOutput(req.rid, req.text, list(req.output_ids), {"id": req.rid, "finish_reason": req.finish.to_dict()}, True))
            except Exception:
                logger.exception("delivering the final output of request %s failed", req.rid)

    def _answer_queued_calls(self, message: str) -> None:
        """Fail every call still in the inbox (a /metrics or dashboard read queued as the loop ended)."""
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple) and item[0] == "call" and not item[1][1].done():
                item[1][1].set_exception(EngineError(message))

    # ------------------------------------------------------------ the callers
    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the loop thread between steps and return its result (EngineError once
        the loop has ended: a call queued as it ends is answered, never left waiting)."""
        self.check_open()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put(("call", (fn, fut)))
        while True:
            try:
                return fut.result(timeout=_CALL_POLL_S)
            except concurrent.futures.TimeoutError:
                if not self.thread.is_alive() and not fut.done():
                    raise EngineError("the engine loop stopped") from self.error

    def post(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the loop thread between steps, without waiting (nothing if the loop has ended)."""
        if self.is_alive():
            self.inbox.put(("call", (fn, concurrent.futures.Future())))

    def submit(self, req: Req) -> None:
        """Register a built request until its final output and queue it (ValueError when its rid is already in flight)."""
        deliver = req.sink

        key = (req.cache_salt, req.rid)  # rids are unique per tenant: one cannot take another's

        def sink(out: ReqOutput) -> None:
            if out.finished:
                with self._in_flight_lock:
                    if self._in_flight.get(key) is not req:
                        return  # already answered (the loop ended and failed it)
                    del self._in_flight[key]
            deliver(out)

        with self._in_flight_lock:
            if self.closed or self._stopped:
                raise EngineError("the engine has been shut down" if self.closed else "the engine loop stopped")
            if key in self._in_flight:
                raise ValueError(f"rid {req.rid!r} is already in flight")
            self._in_flight[key] = req
            req.sink = sink
        self.inbox.put(("add", req))

    def in_flight(self, cache_salt: str | None, rid: str) -> bool:
        """True while tenant ``cache_salt``'s request ``rid`` is submitted and not yet answered."""
        return (cache_salt, rid) in self._in_flight

    def check_open(self) -> None:
        """Raise EngineError once the loop is closed or has stopped."""
        if self.closed or self._stopped or not self.thread.is_alive():
            raise EngineError("the engine has been shut down" if self.closed else "the engine loop stopped")

    def check_running(self) -> None:
        """Raise EngineError (from what ended it) once the loop thread has ended."""
        if not self.thread.is_alive():
            raise EngineError("the engine loop stopped") from self.error

    def is_alive(self) -> bool:
        """True while the loop thread runs and takes requests."""
        return not self.closed and not self._stopped and self.thread.is_alive()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Block until the loop has ended (shutdown or a fatal error); False on timeout."""
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def close(self, timeout: float = 30) -> None:
        """Stop taking requests, abort what runs, and wait (up to ``timeout``) for the thread to end."""
        self.closed = True
        self.inbox.put(_STOP)
        self.thread.join(timeout=timeout)
