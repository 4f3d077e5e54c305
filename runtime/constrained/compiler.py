"""GrammarCompiler: compiles specs on worker threads behind an LRU cache, with a timeout.

Compilation never runs on the scheduler's thread: callers (the Engine's ``generate``, HTTP
handlers) wait for the future while the engine keeps decoding other requests. Identical specs
share one cache entry, in flight or done; failures are cached too so a bad spec is refused fast.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Callable

from radixlm.runtime.constrained.base import (
    SPEC_KINDS,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
)


class GrammarCompiler:
    """Compiles ``(kind, spec)`` pairs for one backend with caching and a time limit."""

    def __init__(self, make_backend: Callable[[], GrammarBackend], backend_name: str, timeout: float = 30.0, cache_size: int = 512, max_workers: int = 4) -> None:
        self._make_backend = make_backend
        self.backend_name = backend_name
        self.timeout = timeout
        self.cache_size = cache_size
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, str], concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="radixlm-grammar")

    @property
    def backend(self) -> GrammarBackend:
        """The backend, built on first use (it converts the tokenizer's vocabulary once)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

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
            fut = self._pool.submit(lambda: self.backend.compile(kind, spec))
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    def _result(self, kind: str, fut: concurrent.futures.Future, timeout: float) -> CompiledGrammar:
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise GrammarError(f"{kind} took longer than {timeout:g} s to compile (grammar_compile_timeout)") from None
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

    def shutdown(self) -> None:
        """Stop the worker threads (running compilations finish in the background)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
