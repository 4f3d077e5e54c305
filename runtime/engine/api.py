"""Engine: the offline API (SGLang's shape) over the engine loop, which runs in its own thread.

Results come back through per-request sinks: a thread queue for the blocking API, an asyncio
queue fed with ``call_soon_threadsafe`` for the async one.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from radixlm.radix_cache.snapshot import snapshot_tree
from radixlm.runtime.engine.beam import BeamIntake
from radixlm.runtime.engine.loop import EngineLoop
from radixlm.runtime.engine.pooling import PoolingIntake
from radixlm.runtime.engine.requests import RequestIntake, split_batch
from radixlm.runtime.engine.results import (
    async_sink,
    await_final,
    stream_async,
    stream_sync,
    to_dict,
    wait_final,
)
from radixlm.runtime.engine.stats import dashboard_counters, engine_stats
from radixlm.runtime.lora.control import LoraControl
from radixlm.runtime.request import ANY_SALT, Req
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


class Engine(LoraControl, PoolingIntake, BeamIntake, RequestIntake):
    """An in-process radixlm runtime: ``generate`` / ``async_generate`` over a batching loop
    (and ``embed`` / ``score`` for pooling, ``runtime/engine/pooling.py``).

    The model is loaded on the loop thread and every tensor operation runs there: on CPUs, a
    second thread that has run parallel (OpenMP) work keeps its own thread team, and the two
    teams slowed decode steps down by 30-50% in our measurements.
    """

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        self._at_exit: Callable[[], object] | None = None
        self._loop = EngineLoop(self.args)  # re-raises what went wrong while loading
        self._inbox = self._loop.inbox
        rt = self._parts = self._loop.parts
        super().__init__(self.args, rt, self._loop.in_flight)
        self.model_path, self.kv, self.scheduler = rt.model_path, rt.kv, rt.scheduler
        self.end_ids = self.scheduler.end_ids
        if self.runner.tp_size > 1:  # stop the workers politely at exit, before multiprocessing kills them
            ref = weakref.ref(self)
            self._at_exit = lambda: (engine := ref()) is not None and engine.shutdown()
            atexit.register(self._at_exit)

    # ------------------------------------------------------------- the loop
    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the loop thread between steps and return its result (EngineError once the loop has ended)."""
        return self._loop.call(fn)

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Block until the loop has ended (shutdown or a fatal error); False on timeout."""
        return self._loop.wait_stopped(timeout)

    @property
    def error(self) -> BaseException | None:
        """What ended the loop, or the last step error it survived; None when all went well."""
        return self._loop.error

    def is_alive(self) -> bool:
        """True while the loop thread runs and takes requests."""
        return self._loop.is_alive()

    # ------------------------------------------------------------ requests
    def submit(self, req: Req) -> None:
        """Queue a built request on the loop (ValueError when its rid is already in flight)."""
        self._loop.submit(req)

    def abort(self, rid: str, cache_salt: Any = ANY_SALT) -> bool:
        """Abort a waiting or running request; False if no such request is in flight.

        ``cache_salt`` limits the abort to that tenant's request (None: requests without a salt);
        by default the request with this rid is aborted whatever its salt.
        """
        return self._call(lambda: self.scheduler.abort(rid, cache_salt))

    def abort_nowait(self, rid: str, cache_salt: Any = ANY_SALT) -> None:
        """Ask the loop to abort a request, without waiting (safe from an event loop)."""
        self._loop.post(lambda: self.scheduler.abort(rid, cache_salt))

    async def start_request(self, **kwargs: Any) -> tuple[Req, asyncio.Queue]:
        """Validate, compile the constraint of, and queue one request; outputs arrive on the queue."""
        q: asyncio.Queue = asyncio.Queue()
        sink = async_sink(asyncio.get_running_loop(), q)
        req = await asyncio.to_thread(self.make_request, sink, **kwargs)  # tokenizing is CPU work
        await self.attach_grammar_async(req)
        self.submit(req)
        return req, q

    # ----------------------------------------------------------- public API
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        stream: bool = False,
        return_text_in_logprobs: bool = False,
        cache_salt: str | None = None,
        return_cache_info: bool = False,
        program: str | None = None,
        prompt_cache_key: str | None = None,
        cache_ttl: float | None = None,
        prediction: str | dict[str, Any] | None = None,
        bootstrap_room: int | None = None,
        priority: int = 0,
        lora: str | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (a dict) or a batch (a list of dicts); ``stream`` yields dicts.

        With ``sampling_params["n"] = k > 1`` a prompt gets k samples sharing its prompt's KV
        (sample j seeded ``seed + j``): a list of k dicts for one prompt, m*k for m prompts,
        prompt-major (prompt i's samples at i*k .. i*k+k-1). ``prediction`` (the expected output,
        see ``make_request``) applies to every prompt of a batch; ``bootstrap_room`` (see
        ``make_request``) takes one prompt. ``priority``: every request's class under
        ``--schedule-policy priority`` (smaller is more urgent). ``lora``: the name of the LoRA
        adapter every request runs with (None: the base model).
        """
        batch, items = split_batch(prompt, input_ids, sampling_params)
        common = dict(return_logprob=return_logprob, top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len, return_text_in_logprobs=return_text_in_logprobs, cache_salt=cache_salt, return_cache_info=return_cache_info, program=program, prompt_cache_key=prompt_cache_key, cache_ttl=cache_ttl, prediction=prediction, bootstrap_room=bootstrap_room, priority=priority, lora=lora)
        if stream:
            if batch or len(items) > 1:
                raise ValueError("stream=True takes a single prompt with n = 1, not a batch")
            q: queue.Queue = queue.Queue()
            req = self.make_request(q.put, stream=True, **items[0], **common)
            self.attach_grammar(req)
            self.submit(req)
            return stream_sync(q, self._loop, lambda: self.abort_nowait(req.rid, req.cache_salt))
        queues = [queue.Queue() for _ in items]
        reqs = [self.make_request(q.put, **item, **common) for q, item in zip(queues, items)]
        for req in reqs:
            self.attach_grammar(req)
        for req in reqs:
            if req.params.beam_width == 1:
                self.submit(req)
        # beam searches run now, round by round, side by side (runtime/engine/beam.py)
        beams = self.beam_searches_sync([req for req in reqs if req.params.beam_width > 1])
        results = []
        for q, req in zip(queues, reqs):
            if req.params.beam_width > 1:
                results.extend(beams.pop(0))
            else:
                results.append(to_dict(wait_final(q, self._loop)))
        return results if batch or len(results) > 1 else results[0]

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        stream: bool = False,
        return_text_in_logprobs: bool = False,
        cache_salt: str | None = None,
        return_cache_info: bool = False,
        program: str | None = None,
        prompt_cache_key: str | None = None,
        cache_ttl: float | None = None,
        prediction: str | dict[str, Any] | None = None,
        bootstrap_room: int | None = None,
        priority: int = 0,
        lora: str | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """The asyncio form of ``generate``; with ``stream`` it returns an async iterator."""
        batch, items = split_batch(prompt, input_ids, sampling_params)
        common = dict(return_logprob=return_logprob, top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len, return_text_in_logprobs=return_text_in_logprobs, cache_salt=cache_salt, return_cache_info=return_cache_info, program=program, prompt_cache_key=prompt_cache_key, cache_ttl=cache_ttl, prediction=prediction, bootstrap_room=bootstrap_room, priority=priority, lora=lora)
        if stream and (batch or len(items) > 1):
            raise ValueError("stream=True takes a single prompt with n = 1, not a batch")
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in items]
        reqs = [self.make_request(async_sink(loop, q), stream=stream, **item, **common) for q, item in zip(queues, items)]
        for req in reqs:
            await self.attach_grammar_async(req)
        for req in reqs:
            if req.params.beam_width == 1:
                self.submit(req)
        if stream:
            first = reqs[0]
            return stream_async(queues[0], lambda: self.abort_nowait(first.rid, first.cache_salt))
        beams = await asyncio.gather(*(self.beam_search_async(req) for req in reqs if req.params.beam_width > 1))
        results: list[dict[str, Any]] = []
        for q, req in zip(queues, reqs):
            if req.params.beam_width > 1:
                results.extend(beams.pop(0))
            else:
                results.append(to_dict(await await_final(q)))
        return results if batch or len(results) > 1 else results[0]

    # ------------------------------------------------------------ utilities
    def get_stats(self) -> dict[str, Any]:
        """Queue lengths, KV usage and cache counters, read on the loop thread."""
        return self._call(lambda: engine_stats(self._parts))

    def cache_explanations(self, last: int = 20, cache_salt: Any = ANY_SALT) -> list[dict[str, Any]]:
        """The cache explanations of the last ``last`` admitted requests, oldest first: of tenant
        ``cache_salt`` only (None: requests without a salt), or by default every tenant's."""
        if not isinstance(last, int) or isinstance(last, bool) or last < 0:
            raise ValueError(f"last must be an integer >= 0, got {last!r}")
        explainer = self.scheduler.explainer
        return self._call(lambda: explainer.last(last, cache_salt)) if explainer is not None else []

    def dashboard_counters(self) -> dict[str, Any]:
        """Pool usage and cumulative counters for the dashboard's history, read on the loop thread."""
        return self._call(lambda: dashboard_counters(self._parts))

    def dashboard_state(self, max_nodes: int = 400, walk_budget: int = 20_000, queue_limit: int = 50) -> dict[str, Any]:
        """A bounded snapshot of the radix tree, the queues and the counters, taken in one loop turn."""

        def state() -> dict[str, Any]:
            tree = snapshot_tree(self.kv.tree, max_nodes, walk_budget)
            return {"tree": tree, "queues": self.scheduler.queue_view(queue_limit), "counters": dashboard_counters(self._parts)}

        return self._call(state)

    def check_accounting(self) -> None:
        """Assert on the loop thread that every KV slot is free, in the tree or held by a request."""
        self._call(self.scheduler.check_accounting)

    def kv_invariant_holds_when_idle(self) -> bool | None:
        """``check_accounting`` as a boolean when nothing runs or waits, else None (not checked):
        the full check walks the whole pool on the loop thread, which must not stall decoding."""

        def check() -> bool | None:
            if not self.scheduler.idle():
                return None
            try:
                self.scheduler.check_accounting()
                return True
            except AssertionError:
                logger.exception("KV accounting broken")
                return False

        return self._call(check)

    def flush_cache(self) -> bool:
        """Empty the radix cache (and speculation's recent outputs); False (nothing done) while requests are in flight."""

        def flush() -> bool:
            if not self.scheduler.idle():
                return False
            self.kv.flush()
            self.scheduler.speculator.flush()  # recent outputs are cached text too
            return True

        return self._call(flush)

    def shutdown(self) -> None:
        """Abort what runs and stop the loop thread."""
        if self._loop.closed:
            return
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
        self._loop.close(timeout=30)
        self.grammars.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
