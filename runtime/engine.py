"""Engine: the offline API (SGLang's shape) over a scheduler loop running in its own thread.

Callers never touch scheduler state: requests, aborts and queries go through an inbox that the
loop thread drains between steps; results come back through per-request sinks (a thread queue
for the blocking API, an asyncio queue fed with ``call_soon_threadsafe`` for the async one).

Every submitted request is registered until its final output is delivered. No exception leaves
the loop; if the loop ends anyway (a fatal error, or shutdown), every registered request gets a
final error output at once and ``is_alive`` turns False, so no waiter ever waits forever.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import queue
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.radix_cache import KVManager, RadixCache, ReqToTokenTable, SlotAllocator
from radixlm.radix_cache.snapshot import snapshot_tree
from radixlm.runtime.cache_control import check_cache_options
from radixlm.runtime.constrained.base import Matcher
from radixlm.runtime.constrained.budget import BudgetMatcher, CloseVocab
from radixlm.runtime.constrained.compiler import GrammarCompiler
from radixlm.runtime.disaggregation.scheduling import Disaggregation, open_link_side
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.faults import FatalEngineError
from radixlm.runtime.loader import resolve_model_path
from radixlm.runtime.output import OutputBuilder
from radixlm.runtime.request import ANY_SALT, FinishReason, Req, ReqOutput
from radixlm.runtime.sampling_params import SamplingParams, per_sample_params
from radixlm.runtime.scheduler import Scheduler
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.speculative.prediction import prediction_text
from radixlm.runtime.threads import configure_threads
from radixlm.runtime.tokenizer import end_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

_STOP = object()
_CALL_POLL_S = 0.5  # how often a caller waiting on the loop checks that it still runs


class EngineError(RuntimeError):
    """The engine loop failed or was shut down while a request was in flight."""


@dataclass
class EngineParts:
    """The engine's parts assembled from ServerArgs, without a loop thread."""

    args: ServerArgs
    model_path: str
    tokenizer: Any
    runner: ModelRunner
    kv: KVManager
    scheduler: Scheduler
    grammars: GrammarCompiler
    pd: Disaggregation | None = None  # one side of a prefill/decode pair


def build_parts(args: ServerArgs) -> EngineParts:
    """Load the model and tokenizer and wire the KV memory and scheduler together."""
    configure_threads(args.num_threads, share=args.tp_size)
    model_path = resolve_model_path(args.model_path)
    tokenizer = load_tokenizer(model_path, args.tokenizer_path)
    runner = ModelRunner(args, model_path)
    device = runner.device
    allocator = SlotAllocator(runner.max_total_tokens, args.page_size, device)
    width = -(-runner.context_len // args.page_size) * args.page_size  # whole pages per row
    table = ReqToTokenTable(args.max_running_requests + 8, width, device)
    tree = RadixCache(allocator.free_slots, args.page_size, disable=args.disable_radix_cache, track_origins=not args.disable_cache_explain)
    kv = KVManager(allocator, table, tree)
    end_ids = end_token_ids(tokenizer, runner.config.eos_token_ids)
    scheduler = Scheduler(args, runner, kv, OutputBuilder(tokenizer), end_ids, tokenizer)
    grammars = make_grammar_compiler(args, tokenizer, runner.config.vocab_size, end_ids)
    pd = scheduler.attach_pd(open_link_side(args, runner)) if args.disaggregation_mode else None
    return EngineParts(args, model_path, tokenizer, runner, kv, scheduler, grammars, pd)


def make_grammar_compiler(args: ServerArgs, tokenizer, vocab_size: int, end_ids: set[int]) -> GrammarCompiler:
    """The compiler for ``args.grammar_backend`` (the backend itself is built on first use)."""

    def make_llguidance():
        from radixlm.runtime.constrained.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, end_ids)

    def make_backend():
        if args.grammar_backend == "outlines":  # EBNF (tool_choice auto, reasoning) goes to llguidance
            from radixlm.runtime.constrained.lark_fallback import LarkFallback
            from radixlm.runtime.constrained.outlines_backend import OutlinesBackend

            return LarkFallback(OutlinesBackend(tokenizer, vocab_size, end_ids), make_llguidance)
        return make_llguidance()

    return GrammarCompiler(make_backend, args.grammar_backend, timeout=args.grammar_compile_timeout)


class Engine:
    """An in-process radixlm runtime: ``generate`` / ``async_generate`` over a batching loop.

    The model is loaded on the loop thread and every tensor operation runs there: on CPUs, a
    second thread that has run parallel (OpenMP) work keeps its own thread team, and the two
    teams slowed decode steps down by 30-50% in our measurements.
    """

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._rid_counter = itertools.count()
        self._closed = False
        self._at_exit: Callable[[], object] | None = None
        self._error: BaseException | None = None
        self._in_flight: dict[tuple[str | None, str], Req] = {}  # (cache_salt, rid): submitted, final output not yet delivered
        self._in_flight_lock = threading.Lock()
        self._stopped = False  # set (under the lock) once the loop has ended
        self._check_every_step = self.args.debug_check_accounting or os.environ.get("RADIXLM_CHECK_ACCOUNTING") == "1"
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="radixlm-engine", daemon=True)
        self._thread.start()
        rt: EngineParts = ready.result()  # re-raises what went wrong while loading
        self.model_path, self.tokenizer, self.runner = rt.model_path, rt.tokenizer, rt.runner
        self.kv, self.scheduler, self.grammars, self.pd = rt.kv, rt.scheduler, rt.grammars, rt.pd
        self.config = self.runner.config
        self.context_len = self.runner.context_len
        self._close_vocab: CloseVocab | None = None  # built on the first request that closes JSON within budget
        self.end_ids = self.scheduler.end_ids
        # No token spells more characters than its vocabulary entry has, so a longer text than
        # this is over the context length for sure: refused before the (slow) tokenizer runs.
        self._max_text_chars = self.context_len * max(map(len, self.tokenizer.get_vocab()), default=1)
        if self.runner.tp_size > 1:  # stop the workers politely at exit, before multiprocessing kills them
            ref = weakref.ref(self)
            self._at_exit = lambda: (engine := ref()) is not None and engine.shutdown()
            atexit.register(self._at_exit)

    # ------------------------------------------------------------- the loop
    def _run(self, ready: concurrent.futures.Future) -> None:
        try:
            rt = build_parts(self.args)
        except BaseException as exc:
            with self._in_flight_lock:
                self._stopped = True
            ready.set_exception(exc)
            return
        rt.runner.on_failure(lambda exc: self._inbox.put(("fatal", exc)))  # a worker died between steps
        if rt.pd is not None and rt.pd.role == "decode":  # received KV is stored on this thread
            rt.pd.side.post = lambda fn: self._inbox.put(("call", (fn, concurrent.futures.Future())))
        ready.set_result(rt)
        message = "the engine is shutting down"
        try:
            self._loop(rt.scheduler)
        except BaseException as exc:  # a bug outside any request's guard, or a fatal error: end cleanly, loudly
            logger.critical("the engine loop died", exc_info=not isinstance(exc, FatalEngineError))
            self._error = exc
            message = f"the engine stopped after an internal error: {exc}"
        finally:
            self._stop(rt.scheduler, message)
            if rt.pd is not None:
                rt.pd.close()
            rt.runner.close()

    def _loop(self, sched: Scheduler) -> None:
        while True:
            block = not sched.has_work()
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    return
                self._handle(sched, item)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            try:
                sched.step()
            except FatalEngineError:
                raise
            except Exception as exc:  # no request owns this error: fail what runs, keep serving
                logger.exception("engine step failed")
                self._error = exc
                sched.fail_running(f"internal error: {exc}")
            if self._check_every_step:
                sched.check_accounting(full=not sched.has_work())  # a broken invariant ends the loop, loudly

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
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple) and item[0] == "call" and not item[1][1].done():
                item[1][1].set_exception(EngineError(message))

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

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the loop thread between steps and return its result (EngineError once
        the loop has ended: a call queued as it ends is answered, never left waiting)."""
        self._check_open()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (fn, fut)))
        while True:
            try:
                return fut.result(timeout=_CALL_POLL_S)
            except concurrent.futures.TimeoutError:
                if not self._thread.is_alive() and not fut.done():
                    raise EngineError("the engine loop stopped") from self._error

    def _check_open(self) -> None:
        if self._closed or self._stopped or not self._thread.is_alive():
            raise EngineError("the engine has been shut down" if self._closed else "the engine loop stopped")

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Block until the loop has ended (shutdown or a fatal error); False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        """What ended the loop, or the last step error it survived; None when all went well."""
        return self._error

    def is_alive(self) -> bool:
        """True while the loop thread runs and takes requests."""
        return not self._closed and not self._stopped and self._thread.is_alive()

    # ------------------------------------------------------------ requests
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (ValueError, without tokenizing, for a text no context can hold)."""
        if len(text) > self._max_text_chars:
            raise ValueError(f"prompt is {len(text):,} characters, more than the context length ({self.context_len} tokens) can hold")
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def make_request(
        self,
        sink: Callable[[ReqOutput], None],
        prompt: str | None = None,
        input_ids: list[int] | None = None,
        sampling_params: dict[str, Any] | SamplingParams | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | None = None,
        cache_salt: str | None = None,
        return_cache_info: bool = False,
        program: str | None = None,
        prompt_cache_key: str | None = None,
        cache_ttl: float | None = None,
        retention: list[tuple[int, float]] | None = None,
        prediction: str | dict[str, Any] | None = None,
        bootstrap_room: int | None = None,
    ) -> Req:
        """Validate one request and build its Req (raises ValueError naming the bad argument).

        ``cache_salt``: the request shares cached KV only with requests of the same salt (without
        one, a client can tell from ``cached_tokens`` whether others sent the same prefix).
        ``return_cache_info`` adds the cache explanation to meta_info; ``program`` and
        ``prompt_cache_key`` label the prefixes this request computes; ``cache_ttl`` (seconds) asks
        eviction to spare the whole prompt that long, ``retention`` the given (length, ttl) prefixes.
        ``prediction``: the output the client expects (a string, or OpenAI's ``{"type": "content",
        "content": ...}``); its tokens are proposed as speculative drafts, even when no
        ``speculative_algorithm`` is set. The output is the same with or without it.
        ``bootstrap_room``: on one side of a prefill/decode pair, the id that pairs this request
        with its other half (the router sets it): the prefill side only computes the prompt, the
        decode side takes the prompt's KV from it.
        """
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if not prompt:
                raise ValueError("prompt must not be empty")
            input_ids = self.tokenize(prompt)
        else:
            if not isinstance(input_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
                raise ValueError("input_ids must be a list of integers")
            if not input_ids:
                raise ValueError("input_ids must not be empty")
            bad = [t for t in input_ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"input_ids contains {bad[0]}, outside the vocabulary [0, {self.config.vocab_size})")
        if len(input_ids) >= self.context_len:
            raise ValueError(f"prompt is {len(input_ids)} tokens; the context length is {self.context_len} (prompt must be shorter)")
        if len(input_ids) + 1 > self.runner.max_total_tokens:
            raise ValueError(f"prompt is {len(input_ids)} tokens; the KV pool holds only {self.runner.max_total_tokens}")
        params = sampling_params if isinstance(sampling_params, SamplingParams) else SamplingParams.from_dict(sampling_params, self.config.vocab_size, self.context_len)
        params = self._check_bootstrap_room(bootstrap_room, params)
        if not isinstance(return_logprob, bool):
            raise ValueError("return_logprob must be a boolean")
        if not isinstance(top_logprobs_num, int) or isinstance(top_logprobs_num, bool) or top_logprobs_num < 0:
            raise ValueError("top_logprobs_num must be an integer >= 0")
        if not isinstance(logprob_start_len, int) or isinstance(logprob_start_len, bool) or logprob_start_len < -1:
            raise ValueError("logprob_start_len must be an integer >= -1")
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise ValueError("rid must be a non-empty string")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        if rid is not None and (cache_salt, rid) in self._in_flight:
            raise ValueError(f"rid {rid!r} is already in flight")
        predicted = prediction_text(prediction)
        hints = check_cache_options(return_cache_info, program, prompt_cache_key, cache_ttl, retention, not self.args.disable_cache_explain)
        if cache_ttl is not None:
            hints.append((len(input_ids), float(cache_ttl)))
        req = Req(
            rid=rid or uuid.uuid4().hex,
            input_ids=list(input_ids),
            params=params,
            sink=sink,
            stream=stream,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            logprob_start_len=logprob_start_len,
            return_text_in_logprobs=return_text_in_logprobs,
            cache_salt=cache_salt,
            program=program,
            prompt_cache_key=prompt_cache_key,
            return_cache_info=return_cache_info,
            retention=hints,
            bootstrap_room=bootstrap_room,
        )
        if predicted:
            # indexed on the loop thread at the first step: bounded by what the output can use
            # (twice max_new_tokens leaves room for an output that drops parts of the prediction)
            keep = min(self.context_len, 2 * params.max_new_tokens + 16)
            req.prediction_ids = self.tokenizer(predicted[: self._max_text_chars], add_special_tokens=False).input_ids[:keep]
        if params.seed is not None:
            req.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        return req

    def _check_bootstrap_room(self, room: int | None, params: SamplingParams) -> SamplingParams:
        """Validate ``bootstrap_room``; on the prefill side the request only computes its prompt."""
        if room is None:
            return params
        if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2**63:
            raise ValueError(f"bootstrap_room must be an integer in [0, 2**63), got {room!r}")
        if self.pd is None:
            raise ValueError("bootstrap_room applies only to a server started with --disaggregation-mode prefill or decode")
        if params.n != 1:
            raise ValueError("bootstrap_room pairs one request: n must be 1")
        if self.pd.role == "prefill":  # the decode side samples, checks stops and applies the constraint
            params = dataclasses.replace(params, max_new_tokens=0, min_new_tokens=0, regex=None, json_schema=None, ebnf=None)
        return params

    def attach_grammar(self, req: Req) -> None:
        """Compile the request's constraint (off the loop thread) and give it a matcher."""
        if req.params.constraint is not None:
            compiled = self.grammars.compile(*req.params.constraint)
            req.grammar, req.constraint_warnings = self._within_budget(req, compiled.matcher()), compiled.warnings

    async def attach_grammar_async(self, req: Req) -> None:
        """The awaitable form of ``attach_grammar``."""
        if req.params.constraint is not None:
            compiled = await self.grammars.compile_async(*req.params.constraint)
            # its first mask is CPU work, and so is the budget closer's vocabulary the first time
            req.grammar = await asyncio.to_thread(lambda: self._within_budget(req, compiled.matcher()))
            req.constraint_warnings = compiled.warnings

    def _within_budget(self, req: Req, matcher: Matcher) -> Matcher:
        """``matcher``, wrapped to close its JSON in time when the request asks (close_json_within_budget)."""
        if not req.params.close_json_within_budget:
            return matcher
        if self._close_vocab is None:
            self._close_vocab = CloseVocab.from_tokenizer(self.tokenizer, self.config.vocab_size)
        budget = min(req.params.max_new_tokens, self.context_len - len(req.input_ids))
        return BudgetMatcher(matcher, self._close_vocab, budget)

    def submit(self, req: Req) -> None:
        """Queue a built request on the loop (ValueError when its rid is already in flight)."""
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
            if self._closed or self._stopped:
                raise EngineError("the engine has been shut down" if self._closed else "the engine loop stopped")
            if key in self._in_flight:
                raise ValueError(f"rid {req.rid!r} is already in flight")
            self._in_flight[key] = req
            req.sink = sink
        self._inbox.put(("add", req))

    def abort(self, rid: str, cache_salt: Any = ANY_SALT) -> bool:
        """Abort a waiting or running request; False if no such request is in flight.

        ``cache_salt`` limits the abort to that tenant's request (None: requests without a salt);
        by default the request with this rid is aborted whatever its salt.
        """
        return self._call(lambda: self.scheduler.abort(rid, cache_salt))

    def abort_nowait(self, rid: str, cache_salt: Any = ANY_SALT) -> None:
        """Ask the loop to abort a request, without waiting (safe from an event loop)."""
        if self.is_alive():
            self._inbox.put(("call", (lambda: self.scheduler.abort(rid, cache_salt), concurrent.futures.Future())))

    async def start_request(self, **kwargs: Any) -> tuple[Req, asyncio.Queue]:
        """Validate, compile the constraint of, and queue one request; outputs arrive on the queue."""
        q: asyncio.Queue = asyncio.Queue()
        sink = _async_sink(asyncio.get_running_loop(), q)
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
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (a dict) or a batch (a list of dicts); ``stream`` yields dicts.

        With ``sampling_params["n"] = k > 1`` a prompt gets k samples sharing its prompt's KV
        (sample j seeded ``seed + j``): a list of k dicts for one prompt, m*k for m prompts,
        prompt-major (prompt i's samples at i*k .. i*k+k-1). ``prediction`` (the expected output,
        see ``make_request``) applies to every prompt of a batch; ``bootstrap_room`` (see
        ``make_request``) takes one prompt.
        """
        batch, items = self._split_batch(prompt, input_ids, sampling_params)
        common = dict(return_logprob=return_logprob, top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len, return_text_in_logprobs=return_text_in_logprobs, cache_salt=cache_salt, return_cache_info=return_cache_info, program=program, prompt_cache_key=prompt_cache_key, cache_ttl=cache_ttl, prediction=prediction, bootstrap_room=bootstrap_room)
        if stream:
            if batch or len(items) > 1:
                raise ValueError("stream=True takes a single prompt with n = 1, not a batch")
            q: queue.Queue = queue.Queue()
            req = self.make_request(q.put, stream=True, **items[0], **common)
            self.attach_grammar(req)
            self.submit(req)
            return self._stream_sync(q, req.rid, req.cache_salt)
        queues = [queue.Queue() for _ in items]
        reqs = [self.make_request(q.put, **item, **common) for q, item in zip(queues, items)]
        for req in reqs:
            self.attach_grammar(req)
        for req in reqs:
            self.submit(req)
        results = []
        for q, req in zip(queues, reqs):
            results.append(_to_dict(self._wait_final(q, req.rid)))
        return results if batch or len(results) > 1 else results[0]

    def _wait_final(self, q: queue.Queue, rid: str) -> ReqOutput:
        while True:
            try:
                out = q.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise EngineError("the engine loop stopped") from self._error
                continue
            if out.finished:
                return out

    def _stream_sync(self, q: queue.Queue, rid: str, cache_salt: str | None) -> Iterator[dict[str, Any]]:
        try:
            while True:
                try:
                    out = q.get(timeout=1.0)
                except queue.Empty:
                    if not self._thread.is_alive():
                        raise EngineError("the engine loop stopped") from self._error
                    continue
                yield _to_dict(out)
                if out.finished:
                    return
        finally:
            self.abort_nowait(rid, cache_salt)

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
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """The asyncio form of ``generate``; with ``stream`` it returns an async iterator."""
        batch, items = self._split_batch(prompt, input_ids, sampling_params)
        common = dict(return_logprob=return_logprob, top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len, return_text_in_logprobs=return_text_in_logprobs, cache_salt=cache_salt, return_cache_info=return_cache_info, program=program, prompt_cache_key=prompt_cache_key, cache_ttl=cache_ttl, prediction=prediction, bootstrap_room=bootstrap_room)
        if stream and (batch or len(items) > 1):
            raise ValueError("stream=True takes a single prompt with n = 1, not a batch")
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in items]
        reqs = [self.make_request(_async_sink(loop, q), stream=stream, **item, **common) for q, item in zip(queues, items)]
        for req in reqs:
            await self.attach_grammar_async(req)
        for req in reqs:
            self.submit(req)
        if stream:
            return self._stream_async(queues[0], reqs[0].rid, reqs[0].cache_salt)
        results = [_to_dict(await self._await_final(q)) for q in queues]
        return results if batch or len(results) > 1 else results[0]

    async def _await_final(self, q: asyncio.Queue) -> ReqOutput:
        while True:
            out = await q.get()
            if out.finished:
                return out

    async def _stream_async(self, q: asyncio.Queue, rid: str, cache_salt: str | None) -> AsyncIterator[dict[str, Any]]:
        finished = False
        try:
            while True:
                out = await q.get()
                yield _to_dict(out)
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort_nowait(rid, cache_salt)

    def _split_batch(self, prompt, input_ids, sampling_params) -> tuple[bool, list[dict[str, Any]]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if prompt is not None:
            batch = isinstance(prompt, list)
            prompts = prompt if batch else [prompt]
            items = [{"prompt": p} for p in prompts]
        else:
            batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
            items = [{"input_ids": ids} for ids in (input_ids if batch else [input_ids])]
        if batch and not items:
            raise ValueError("prompt must not be an empty list")
        if isinstance(sampling_params, list):
            if not batch or len(sampling_params) != len(items):
                raise ValueError("sampling_params as a list needs one dict per prompt")
            for item, sp in zip(items, sampling_params):
                item["sampling_params"] = sp
        else:
            for item in items:
                item["sampling_params"] = sampling_params
        samples = [{**item, "sampling_params": sp} for item in items for sp in per_sample_params(item["sampling_params"])]
        return batch, samples

    # ------------------------------------------------------------ utilities
    def get_stats(self) -> dict[str, Any]:
        """Queue lengths, KV usage and cache counters, read on the loop thread."""

        def stats() -> dict[str, Any]:
            s, tree = self.scheduler, self.kv.tree
            return {
                "num_running": len(s.running),
                "num_waiting": len(s.waiting),
                "max_total_tokens": self.runner.max_total_tokens,
                "kv_cache_dtype": self.runner.kv_format.name,
                "kv_bytes_per_token": self.runner.kv_bytes_per_token,  # on rank 0 under tensor parallelism
                "tp_size": self.runner.tp_size,
                "tp_all_reduce_seconds": 0.0 if self.runner.group is None else self.runner.group.reduce_seconds,
                "free_slots": self.kv.allocator.available_slots(),
                "tree_slots": tree.total_size(),
                "evictable_slots": tree.evictable_size(),
                "running_slots": sum(r.kv.owned for r in s.holding_kv() if r.kv is not None),
                "cache_hit_rate": tree.hit_rate(),
                "forward_passes": s.forward_passes,
                "total_retracted": s.total_retracted,
                "retention_hits": tree.retention_hits,
                "evictions_despite_hint": tree.evicted_despite_hint,
                "grammar_masks": s.decoder.grammar_masks,
                "grammar_lazy_picks": s.decoder.grammar_lazy_picks,
                **s.speculator.stats(),
                **(self.pd.stats() if self.pd is not None else {}),
            }

        return self._call(stats)

    def cache_explanations(self, last: int = 20, cache_salt: Any = ANY_SALT) -> list[dict[str, Any]]:
        """The cache explanations of the last ``last`` admitted requests, oldest first: of tenant
        ``cache_salt`` only (None: requests without a salt), or by default every tenant's."""
        if not isinstance(last, int) or isinstance(last, bool) or last < 0:
            raise ValueError(f"last must be an integer >= 0, got {last!r}")
        explainer = self.scheduler.explainer
        return self._call(lambda: explainer.last(last, cache_salt)) if explainer is not None else []

    def dashboard_counters(self) -> dict[str, Any]:
        """Pool usage and cumulative counters for the dashboard's history, read on the loop thread."""
        return self._call(self._counters)

    def dashboard_state(self, max_nodes: int = 400, walk_budget: int = 20_000, queue_limit: int = 50) -> dict[str, Any]:
        """A bounded snapshot of the radix tree, the queues and the counters, taken in one loop turn."""

        def state() -> dict[str, Any]:
            tree = snapshot_tree(self.kv.tree, max_nodes, walk_budget)
            return {"tree": tree, "queues": self.scheduler.queue_view(queue_limit), "counters": self._counters()}

        return self._call(state)

    def _counters(self) -> dict[str, Any]:
        s, tree = self.scheduler, self.kv.tree
        return {
            "max_total_tokens": self.runner.max_total_tokens,
            "free_slots": self.kv.allocator.available_slots(),
            "tree_slots": tree.total_size(),
            "evictable_slots": tree.evictable_size(),
            "running_slots": sum(r.kv.owned for r in s.holding_kv() if r.kv is not None),
            "query_tokens": tree.query_tokens,
            "hit_tokens": tree.hit_tokens,
            "output_tokens": s.output_tokens(),
            "prefill_tokens": s.prefill_tokens,
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "clock": tree.root.last_access,  # the LRU clock, as of the last prefix match
        }

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
        if self._closed:
            return
        self._closed = True
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
        self._inbox.put(_STOP)
        self._thread.join(timeout=30)
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


def _to_dict(out: ReqOutput) -> dict[str, Any]:
    return {"text": out.text, "output_ids": out.output_ids, "meta_info": out.meta_info}


def _async_sink(loop: asyncio.AbstractEventLoop, q: asyncio.Queue) -> Callable[[ReqOutput], None]:
    def put(out: ReqOutput) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, out)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass

    return put
