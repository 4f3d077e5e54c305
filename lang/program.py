"""Function: a ``@function`` prompt program and how it runs (run, run_batch, bind, trace, cache)."""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from radixlm.lang.backend.base import Backend
from radixlm.lang.global_config import global_config
from radixlm.lang.interpreter import RunDefaults, StreamExecutor
from radixlm.lang.ir import check_lora
from radixlm.lang.state import ProgramState
from radixlm.lang.tracer import Argument, Trace, TracingState, trace_program
from radixlm.runtime.sampling_params import SamplingParams


def set_default_backend(backend: Any) -> None:
    """The backend programs run on when ``run`` gets none (a Backend or a ``radixlm.Engine``)."""
    global_config.default_backend = as_backend(backend)


def get_default_backend() -> Backend | None:
    """The backend set by ``set_default_backend`` (or assigned to ``global_config.default_backend``)."""
    backend = global_config.default_backend
    if backend is not None and not isinstance(backend, Backend):
        global_config.default_backend = backend = as_backend(backend)  # wrap an Engine once
    return backend


def as_backend(backend: Any) -> Backend:
    """A Backend for ``backend`` (an in-process ``radixlm.Engine`` is wrapped)."""
    if isinstance(backend, Backend):
        return backend
    engine_module = sys.modules.get("radixlm.runtime.engine")  # no Engine exists before it is imported
    if engine_module is not None and isinstance(backend, engine_module.Engine):
        from radixlm.lang.backend.engine import EngineBackend

        return EngineBackend(backend)
    raise TypeError(f"a backend must be a RuntimeEndpoint, Runtime, EngineBackend or radixlm.Engine, not {type(backend).__name__}")


def _resolve(backend: Any) -> Backend:
    if backend is not None:
        return as_backend(backend)
    default = get_default_backend()
    if default is None:
        raise RuntimeError("no backend: pass backend=... or call radixlm.set_default_backend(...) first")
    return default


def _defaults(caller: str, max_new_tokens, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k, min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len, top_logprobs_num, return_text_in_logprobs, lora) -> RunDefaults:
    params = {
        "max_new_tokens": max_new_tokens, "n": None if n == 1 else n, "stop": stop, "stop_token_ids": stop_token_ids,
        "stop_regex": stop_regex or None, "temperature": temperature,
        "top_p": top_p, "top_k": top_k, "min_p": min_p, "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty, "ignore_eos": ignore_eos,
    }
    params = {k: v for k, v in params.items() if v is not None}
    try:
        SamplingParams.from_dict(dict(params))
    except ValueError as exc:
        raise ValueError(f"{caller}: {exc}") from None
    return RunDefaults(params, bool(return_logprob), logprob_start_len, top_logprobs_num, return_text_in_logprobs, lora=check_lora(lora, caller))


class Function:
    """A prompt program: Python whose first parameter is the state ``s`` (make one with ``@function``)."""

    def __init__(self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None, num_api_spec_tokens: int | None = None) -> None:
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"@function {func.__name__}: the first parameter must be the program state (s)")
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens  # API speculation: used by the OpenAI backend only
        self.bind_arguments = dict(bind_arguments or {})
        self.arg_names = params[1:]
        functools.update_wrapper(self, func)

    def bind(self, **kwargs: Any) -> Function:
        """A copy of this program with some arguments fixed."""
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.func.__name__}() has no parameter {unknown[0]!r}")
        return Function(self.func, {**self.bind_arguments, **kwargs}, self.num_api_spec_tokens)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Inside a program, ``fn(s, ...)`` runs this body on state ``s``; otherwise it is ``run``."""
        if args and isinstance(args[0], (ProgramState, TracingState)):
            return self.func(args[0], *args[1:], **{**self.bind_arguments, **kwargs})
        if any(isinstance(a, Argument) for a in (*args, *kwargs.values())):
            raise RuntimeError("a traced argument reached a nested program")
        return self.run(*args, **kwargs)

    def _keywords(self, values: list | tuple) -> dict[str, Any]:
        """The keyword form of one instance's positional arguments (for ``run_batch``)."""
        try:
            bound = inspect.signature(self.func).bind_partial(None, *values)
        except TypeError as exc:
            raise TypeError(f"{self.func.__name__}(): {exc}") from None
        return dict(list(bound.arguments.items())[1:])

    def _bind(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        merged = {**self.bind_arguments, **kwargs}
        try:
            inspect.signature(self.func).bind(None, *args, **merged)
        except TypeError as exc:
            raise TypeError(f"{self.func.__name__}(): {exc}") from None
        return args, merged

    def run(
        self,
        *args: Any,
        max_new_tokens: int = 128,
        n: int = 1,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        stream: bool = False,
        backend: Any = None,
        lora: str | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program once; sampling arguments are defaults its ``gen`` calls may override.

        ``lora`` names the LoRA adapter every ``gen`` and ``select`` of the run uses, unless the
        call names its own (see docs/lora.md).

        Returns the final state (with ``stream=True`` at once, while the program runs). A failed
        call is kept in ``state.error()`` and raised when its variable is read.
        """
        defaults = _defaults(f"{self.func.__name__}.run", max_new_tokens, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k, min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len, top_logprobs_num, return_text_in_logprobs, lora)
        return self._start(_resolve(backend), defaults, stream, *self._bind(args, kwargs))

    def _start(self, backend: Backend, defaults: RunDefaults, stream: bool, args: tuple, kwargs: dict[str, Any]) -> ProgramState:
        defaults.program = self.func.__name__  # the origin label of the prefixes this program computes
        state = ProgramState(StreamExecutor(backend, defaults, stream, num_api_spec_tokens=self.num_api_spec_tokens))
        if stream:
            state._body = threading.Thread(target=self._body, args=(state, args, kwargs, True), name="radixlm-program-body", daemon=True)
            state._body.start()
            return state
        self._body(state, args, kwargs, False)
        state.sync()
        if global_config.verbosity >= 2:
            print(state.text())
        return state

    def _body(self, state: ProgramState, args: tuple, kwargs: dict[str, Any], background: bool) -> None:
        ex = state._ex
        try:
            state.ret_value = self.func(state, *args, **kwargs)
        except BaseException as exc:
            ex.cancel()
            if not background:
                raise
            ex.sync()
            if ex.error is None:
                ex.error = exc if isinstance(exc, Exception) else RuntimeError(str(exc))
        finally:
            ex.end()

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        max_new_tokens: int = 128,
        n: int = 1,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        lora: str | None = None,
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Run the program once per argument set, concurrently, after prefilling their shared prefix.

        Each item of ``batch_kwargs`` is a dict of keyword arguments or a list/tuple of positional
        ones. The shared prefix is found by tracing the program's Python once with placeholder
        arguments (arguments equal in every instance count as constants); set
        ``global_config.enable_precache_with_tracing = False`` to skip it. Returns the states in
        order (``generator_style``: yields each in order as it finishes). ``lora``: the LoRA
        adapter of every run (and of the shared prefix's prefill), as in ``run``.
        """
        if not isinstance(batch_kwargs, (list, tuple)) or not all(isinstance(kw, (dict, list, tuple)) for kw in batch_kwargs):
            raise TypeError("run_batch takes a list of keyword-argument dicts or of positional-argument lists")
        batch_kwargs = [kw if isinstance(kw, dict) else self._keywords(kw) for kw in batch_kwargs]
        defaults = _defaults(f"{self.func.__name__}.run_batch", max_new_tokens, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k, min_p, frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len, top_logprobs_num, return_text_in_logprobs, lora)
        backend = _resolve(backend)
        bound = [self._bind((), kw) for kw in batch_kwargs]
        if len(batch_kwargs) > 1 and global_config.enable_precache_with_tracing:
            self._cache(backend, _shared_values(batch_kwargs), defaults.lora)
        if num_threads == "auto":
            num_threads = min(max(len(batch_kwargs), 1), 128)
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be 'auto' or a positive integer, got {num_threads!r}")
        pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="radixlm-batch")
        futures = [pool.submit(self._start, backend, defaults, False, args, kw) for args, kw in bound]
        bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(futures), desc=self.func.__name__)
            for f in futures:
                f.add_done_callback(lambda _: bar.update(1))

        def results() -> Iterator[ProgramState]:
            try:
                for f in futures:
                    yield f.result()
            finally:
                pool.shutdown(wait=True)
                if bar is not None:
                    bar.close()

        return results() if generator_style else list(results())

    def trace(self, *, backend: Any = None, **kwargs: Any) -> Trace:
        """Find the text every call shares by running the Python with placeholders (given arguments are fixed)."""
        backend = as_backend(backend) if backend is not None else get_default_backend()
        return trace_program(self.func, {**self.bind_arguments, **kwargs}, backend)

    def cache(self, backend: Any = None, **kwargs: Any) -> Trace:
        """Prefill the program's shared prefix on the backend so every call starts from the cache."""
        return self._cache(_resolve(backend), kwargs, None)

    def _cache(self, backend: Backend, kwargs: dict[str, Any], lora: str | None) -> Trace:
        """``cache``, prefilling under the LoRA adapter ``lora`` (KV is cached per adapter)."""
        found = self.trace(backend=backend, **kwargs)
        if found.prefix:
            backend.cache_prefix(found.prefix, **({"lora": lora} if lora is not None else {}))
        return found


def _shared_values(batch_kwargs: list[dict[str, Any]]) -> dict[str, Any]:
    """Plain arguments with the same value in every instance (they may be traced as constants)."""
    first, shared = batch_kwargs[0], {}
    for key, value in first.items():
        if isinstance(value, (str, int, float, bool)) and all(type(kw.get(key)) is type(value) and kw.get(key) == value for kw in batch_kwargs[1:]):
            shared[key] = value
    return shared
