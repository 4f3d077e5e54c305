"""A backend that hands EBNF grammars to llguidance: for the outlines backend, which compiles only
regexes and JSON schemas. Tool calls with ``tool_choice="auto"`` and reasoning sections are Lark
grammars, so with outlines they still work (their matchers are llguidance's)."""

from __future__ import annotations

import threading

from radixlm.runtime.constrained.base import CompiledGrammar, GrammarBackend


class LarkFallback(GrammarBackend):
    """``primary`` for regex and JSON schema; llguidance (built on first use) for EBNF."""

    def __init__(self, primary: GrammarBackend, make_llguidance) -> None:
        self.primary = primary
        self.name = primary.name
        self._make_llguidance = make_llguidance
        self._llguidance: GrammarBackend | None = None
        self._lock = threading.Lock()  # compiles run on several threads

    def compile(self, kind: str, spec: str, timeout: float | None = None) -> CompiledGrammar:
        """Compile with the backend that takes ``kind``."""
        if kind != "ebnf":
            return self.primary.compile(kind, spec, timeout)
        with self._lock:
            if self._llguidance is None:
                self._llguidance = self._make_llguidance()
            backend = self._llguidance
        return backend.compile(kind, spec, timeout)

    def close(self) -> None:
        """Close both backends."""
        self.primary.close()
        if self._llguidance is not None:
            self._llguidance.close()
