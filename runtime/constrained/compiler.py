"""GrammarCompiler: compiles specs on their own threads behind an LRU cache, with a timeout.

Compilation never runs on the scheduler's thread: callers (the Engine's ``generate``, HTTP
handlers) wait for the future while the engine keeps decoding other requests. Identical specs
share one cache entry, in flight or done; failures are cached too so a bad spec is refused fast.

Why a thread per compile and not a fixed pool (issue 10, bug 7): four compiles that hang used to
hold all four pool threads, and every later constrained request waited behind them. Measured on
this 2-core machine with SmolLM2's 49k-token vocabulary:

- outlines-core: ``Index("(a|b)*a(a|b){20}")`` ran > 20 s (never finished) with the GIL
  released, so a thread cannot end it; interegular (jump-forward FSM) held the GIL 2.8 s on
  ``(a|b)*a(a|b){11}``. Both now run in killable worker processes (``workers.py``): start-up
  0.40 s per worker (interpreter + vocabulary, 0.77 MB shipped once), the index comes back
  pickled (93 kB for a date regex); a worker past its deadline is killed.
- llguidance: its own limits (lexer fuel, grammar size) end every build we found: the slowest,
  an 11-level anyOf schema, failed with "schema too large" after 3.7 s, GIL released. Its matcher
  cannot be pickled, so it compiles on a thread; an overrun thread is left to finish.

So each compile gets its own daemon thread (a stuck one holds no slot others need), and at most
``max_running`` compiles run at once, stuck ones included: past that, specs are refused with
GrammarBusy rather than queued behind them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from radixlm.runtime.constrained.base import (
    SPEC_KINDS,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
)


class GrammarBusy(GrammarError):
    """Too many compilations are running (some past their deadline); try again later."""


class GrammarCompiler:
    """Compiles ``(kind, spec)`` pairs for one backend with caching and a time limit."""

    def __init__(self, make_backend: Callable[[], GrammarBackend], backend_name: str, timeout: float = 30.0, cache_size: int = 512, max_running: int = 16) -> None:
        self._make_backend = make_backend
        self.backend_name = backend_name
        self.timeout = timeout
        self.cache_size = cache_size
        self.max_running = max_running
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, str], concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._closed = False

    @property
    def backend(self) -> GrammarBackend:
        """The backend, built on first use (it converts the tokenizer's vocabulary once)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def running(self) -> int:
        """Compilations now running, including ones past their deadline."""
        with self._lock:
            return len(self._threads)

    def submit(self, kind: str, spec: str) -> concurrent.futures.Future:
        """A future of the compiled grammar (shared with identical earlier requests)."""
        if kind not in SPEC_KINDS:
            raise GrammarError(f"unknown constraint kind {kind!r}")
        key = (self.backend_name, kind, spec)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            if self._closed:
                raise GrammarBusy("the grammar compiler is shut down")
            if len(self._threads) >= self.max_running:
                raise GrammarBusy(
                    f"{len(self._threads)} grammars are compiling already, some past grammar_compile_timeout "
                    f"({self.timeout:g} s); try again later"
                )
            fut = concurrent.futures.Future()
            thread = threading.Thread(target=self._run, args=(fut, kind, spec), name="radixlm-grammar", daemon=True)
            self._threads.add(thread)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        thread.start()
        return fut

    def _run(self, fut: concurrent.futures.Future, kind: str, spec: str) -> None:
        try:
            fut.set_result(self.backend.compile(kind, spec, timeout=self.timeout))
        except BaseException as exc:
            fut.set_exception(exc)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _result(self, kind: str, fut: concurrent.futures.Future, timeout: float) -> CompiledGrammar:
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise GrammarError(f"{kind} took longer than {self.timeout:g} s to compile (grammar_compile_timeout)") from None
        except GrammarError:
            raise
        except Exception as exc:  # a backend bug or resource error: still refuse the request
            raise GrammarError(f"{kind} could not be compiled: {exc}") from None

    def compile(self, kind: str, spec: str) -> CompiledGrammar:
        """Compile (or fetch) and wait, at most ``timeout`` seconds; raises GrammarError."""
        return self._result(kind, self.submit(kind, spec), self.timeout)

    async def compile_async(self, kind: str, spec: str) -> CompiledGrammar:
        """The awaitable form of ``compile``."""
        fut = self.submit(kind, spec)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), timeout=self.timeout)
        except asyncio.TimeoutError:
            raise GrammarError(f"{kind} took longer than {self.timeout:g} s to compile (grammar_compile_timeout)") from None
        except Exception:
            pass
        return self._result(kind, fut, 0)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no compilation runs (True), or ``timeout`` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                threads = list(self._threads)
            if not threads:
                return True
            threads[0].join(min(0.1, max(deadline - time.monotonic(), 0.0)))
        return self.running() == 0

    def shutdown(self) -> None:
        """Refuse new compilations and stop the backend's workers (thread compilations finish in the background)."""
        with self._lock:
            self._closed = True
        with self._backend_lock:
            backend = self._backend
        if backend is not None:
            backend.close()
