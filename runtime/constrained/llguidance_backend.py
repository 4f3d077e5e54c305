"""The llguidance backend: regex, JSON schema and Lark/GBNF grammars via its Earley parser."""

from __future__ import annotations

import json
import re

import torch

from radixlm.runtime.constrained.base import CompiledGrammar, GrammarBackend, GrammarError, Matcher
from radixlm.runtime.constrained.specs import (
    check_refs,
    normalize_regex,
    parse_json_schema,
    unsupported_error,
)

_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \[(.*?)\]')


def _utf8_prefix(data: bytes) -> str:
    """The longest prefix of ``data`` that is complete UTF-8."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


class LLGuidanceMatcher(Matcher):
    """A request's state in an llguidance grammar.

    llguidance reports resource limits (e.g. its lexer building too many states) by putting the
    matcher in an error state, where it stops and allows only end tokens; ``error()`` exposes
    that, ``is_terminated()`` never mistakes it for a finished grammar, and the grammar it came
    from is marked so later requests get a freshly built one (the lexer's state is shared).
    """

    def __init__(self, matcher, grammar: LLGuidanceGrammar | None = None) -> None:
        self._m = matcher
        self._grammar = grammar

    def accept(self, token: int) -> bool:
        """Consume ``token`` if the grammar allows it."""
        return self._m.try_consume_tokens([token]) == 1

    def accept_many(self, tokens: list[int]) -> int:
        """Consume as many of ``tokens`` as the grammar allows, in order; returns how many."""
        return self._m.try_consume_tokens(tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the next step's allowed tokens into ``bitmask[row]``."""
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def is_terminated(self) -> bool:
        """True when only end-of-sequence may follow (and not because of an error)."""
        return self._m.is_stopped() and not self._m.is_error()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` tokens."""
        if num_tokens:
            self._m.rollback(num_tokens)

    def forced_text(self) -> str:
        """The forced continuation (complete UTF-8 characters only)."""
        return _utf8_prefix(self._m.compute_ff_bytes())

    def copy(self) -> LLGuidanceMatcher:
        """An independent copy."""
        return LLGuidanceMatcher(self._m.deep_copy(), self._grammar)

    def error(self) -> str | None:
        """The matcher's error message once it entered its error state."""
        if not self._m.is_error():
            return None
        if self._grammar is not None:
            self._grammar.poisoned = True
        return self._m.get_error()

    @property
    def raw(self):
        """The underlying ``llguidance.LLMatcher`` (for batched mask filling)."""
        return self._m


class LLGuidanceGrammar(CompiledGrammar):
    """A validated llguidance grammar with a template matcher to copy per request.

    The template computes its first mask at compile time and every copy computes its own once
    when made, so the lexer's (sometimes slow) first steps run on the caller's thread, never on
    the scheduler's.
    """

    def __init__(self, template, build) -> None:
        self._build = build
        self._template = template
        self._template.compute_bitmask()
        self.poisoned = False

    def matcher(self) -> LLGuidanceMatcher:
        """A fresh matcher at the grammar's start, its first mask already computed once."""
        if self.poisoned:  # a matcher hit a limit in the shared lexer: start over from the grammar
            self._template = self._build()
            self._template.compute_bitmask()
            self.poisoned = False
        m = self._template.deep_copy()
        m.compute_bitmask()
        return LLGuidanceMatcher(m, self)


class LLGuidanceBackend(GrammarBackend):
    """Compiles specs with llguidance against one Hugging Face tokenizer."""

    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int, end_ids: set[int], whitespace_pattern: str | None = None) -> None:
        import llguidance
        import llguidance.hf

        self._LLMatcher = llguidance.LLMatcher
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(end_ids))
        self.json_options = {"item_separator": ",", "key_separator": ":", "whitespace_flexible": False}
        if whitespace_pattern is not None:
            self.json_options = {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}

    def _grammar(self, kind: str, spec: str) -> tuple[str, object]:
        LLMatcher = self._LLMatcher
        if kind == "regex":
            return LLMatcher.grammar_from_regex(normalize_regex(spec)), None
        if kind == "json_schema":
            schema = parse_json_schema(spec)
            check_refs(schema)
            try:
                return LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=dict(self.json_options)), schema
            except ValueError as exc:
                raise GrammarError(f"json_schema: {exc}") from None
        if kind == "ebnf":
            lark = spec
            if "::=" in spec:  # GBNF (llama.cpp / xgrammar style)
                from llguidance.gbnf_to_lark import gbnf_to_lark

                try:
                    lark = gbnf_to_lark(spec)
                except Exception as exc:
                    raise GrammarError(f"ebnf: cannot parse the GBNF grammar: {exc}") from None
            return LLMatcher.grammar_from_lark(lark), None
        raise GrammarError(f"unknown constraint kind {kind!r}")

    def compile(self, kind: str, spec: str) -> LLGuidanceGrammar:
        """Build and validate the grammar; GrammarError names the offending keyword or syntax."""
        grammar, schema = self._grammar(kind, spec)
        is_error, messages = self._LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise self._error(kind, messages[0] if messages else "invalid grammar", schema)
        template = self._LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise self._error(kind, template.get_error(), schema)
        return LLGuidanceGrammar(template, lambda: self._LLMatcher(self.tokenizer, grammar, log_level=0))

    def _error(self, kind: str, message: str, schema) -> GrammarError:
        m = _UNIMPLEMENTED.search(message)
        if m and schema is not None:
            keys = [k.strip().strip('"') for k in m.group(1).split(",") if k.strip()]
            return unsupported_error(self.name, schema, keys)
        return GrammarError(f"invalid {kind}: {message.strip()}")
