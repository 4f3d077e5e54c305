"""The llguidance backend: regex, JSON schema and Lark/GBNF grammars via its Earley parser."""

from __future__ import annotations

import json
import re
import threading

import torch

from radixlm.runtime.constrained.base import CompiledGrammar, GrammarBackend, GrammarError, Matcher
from radixlm.runtime.constrained.schema_rewrite import rewrite_lark, rewrite_schema
from radixlm.runtime.constrained.semantic import (
    Relaxed,
    SchemaChecker,
    SemanticMatcher,
    TokenBytes,
    relax,
)
from radixlm.runtime.constrained.specs import (
    anchors_to_pointers,
    check_finite,
    check_refs,
    check_regex_size,
    check_schema_patterns,
    normalize_regex,
    parse_json_schema,
    unsupported_error,
)

_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \[(.*?)\]')
_NOT_DISJOINT = re.compile(r"patternProperty regexes .* are not disjoint", re.S)
# The string formats llguidance enforces itself (others are rewritten or ignored: schema_rewrite.py).
FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"})


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
    The per-step methods never raise: an exception from the library becomes ``error()`` and the
    matcher fails closed (no token allowed).
    """

    def __init__(self, matcher, grammar: LLGuidanceGrammar | None = None) -> None:
        self._m = matcher
        self._grammar = grammar
        self._failure: str | None = None

    def _fail(self, what: str, exc: Exception) -> None:
        if self._failure is None:
            self._failure = f"llguidance {what} failed: {type(exc).__name__}: {exc}"

    def accept(self, token: int) -> bool:
        """Consume ``token`` if the grammar allows it."""
        if self._failure is not None:
            return False
        try:
            return self._m.try_consume_tokens([token]) == 1
        except Exception as exc:
            self._fail("accept", exc)
            return False

    def accept_many(self, tokens: list[int]) -> int:
        """Consume as many of ``tokens`` as the grammar allows, in order; returns how many."""
        if self._failure is not None:
            return 0
        try:
            return self._m.try_consume_tokens(tokens)
        except Exception as exc:
            self._fail("accept", exc)
            return 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the next step's allowed tokens into ``bitmask[row]`` (none once failed)."""
        v = bitmask[row]
        if self._failure is None:
            try:
                self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
                return
            except Exception as exc:
                self._fail("fill_bitmask", exc)
        v.zero_()

    def is_terminated(self) -> bool:
        """True when only end-of-sequence may follow (and not because of an error)."""
        if self._failure is not None:
            return False
        try:
            return self._m.is_stopped() and not self._m.is_error()
        except Exception as exc:
            self._fail("is_terminated", exc)
            return False

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` tokens (a failure shows in ``error()``)."""
        if num_tokens and self._failure is None:
            try:
                if not self._m.rollback(num_tokens):
                    self._failure = f"llguidance cannot roll back {num_tokens} tokens"
            except Exception as exc:
                self._fail("rollback", exc)

    def forced_text(self) -> str:
        """The forced continuation (complete UTF-8 characters only; '' once failed)."""
        if self._failure is not None:
            return ""
        try:
            return _utf8_prefix(self._m.compute_ff_bytes())
        except Exception as exc:
            self._fail("forced_text", exc)
            return ""

    def copy(self) -> LLGuidanceMatcher:
        """An independent copy."""
        twin = LLGuidanceMatcher(self._m.deep_copy(), self._grammar)
        twin._failure = self._failure
        return twin

    def error(self) -> str | None:
        """Why this matcher failed: the library's error state, or an exception it raised."""
        if self._failure is not None:
            return self._failure
        try:
            if not self._m.is_error():
                return None
            message = self._m.get_error()
        except Exception as exc:
            self._fail("error", exc)
            return self._failure
        if self._grammar is not None:
            self._grammar.mark_poisoned()
        return message

    @property
    def raw(self):
        """The underlying ``llguidance.LLMatcher`` (for batched mask filling)."""
        return self._m


class LLGuidanceGrammar(CompiledGrammar):
    """A validated llguidance grammar with a template matcher to copy per request.

    The template computes its first mask at compile time and every copy computes its own once
    when made, so the lexer's (sometimes slow) first steps run on the caller's thread, never on
    the scheduler's. The template and the poisoned flag are shared between the threads that make
    matchers and the engine thread that marks the grammar poisoned: one lock guards both, and a
    poisoned template is rebuilt once, by whichever caller comes first.
    """

    def __init__(self, template, build, checks: tuple[SchemaChecker, TokenBytes] | None = None) -> None:
        self._build = build
        self.checks = checks  # keywords checked beside the grammar (semantic.py), or None
        self._template = template
        self._template.compute_bitmask()
        self._poisoned = False
        self._lock = threading.Lock()
        self.rebuilds = 0

    @property
    def poisoned(self) -> bool:
        """True when a matcher hit a limit in the shared lexer and the next matcher starts over."""
        with self._lock:
            return self._poisoned

    def mark_poisoned(self) -> None:
        """Have the next ``matcher()`` rebuild the template (safe from any thread)."""
        with self._lock:
            self._poisoned = True

    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start, its first mask already computed once (with
        the schema's semantic checks around it, if it has any)."""
        with self._lock:
            if self._poisoned:
                template = self._build()
                template.compute_bitmask()
                self._template, self._poisoned = template, False
                self.rebuilds += 1
            m = self._template.deep_copy()
        m.compute_bitmask()
        if self.checks is not None:
            return SemanticMatcher(LLGuidanceMatcher(m, self), *self.checks)
        return LLGuidanceMatcher(m, self)


class LLGuidanceBackend(GrammarBackend):
    """Compiles specs with llguidance against one Hugging Face tokenizer."""

    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int, end_ids: set[int], whitespace_pattern: str | None = None) -> None:
        import llguidance
        import llguidance.hf

        self._LLMatcher = llguidance.LLMatcher
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(end_ids))
        self._hf_tokenizer, self._vocab_size, self._end_ids = hf_tokenizer, vocab_size, set(end_ids)
        self._token_bytes: TokenBytes | None = None
        self._token_bytes_lock = threading.Lock()
        self.json_options = {"item_separator": ",", "key_separator": ":", "whitespace_flexible": False}
        if whitespace_pattern is not None:
            self.json_options = {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}

    def token_bytes(self) -> TokenBytes:
        """Every token's bytes (for the semantic checks), read from the tokenizer once."""
        with self._token_bytes_lock:
            if self._token_bytes is None:
                from radixlm.runtime.constrained.vocab import token_bytes

                self._token_bytes = TokenBytes(token_bytes(self._hf_tokenizer), self._vocab_size, self._end_ids)
            return self._token_bytes

    def _grammar(self, kind: str, spec: str, overlapping: bool = False) -> tuple[str, object, list[str], SchemaChecker | None]:
        """The llguidance grammar of a spec, the schema it enforces (for error messages), the
        warnings about what it leaves out, and the checker of what the grammar was relaxed of.

        ``overlapping``: also take ``patternProperties`` out of the grammar (checked beside it)."""
        LLMatcher = self._LLMatcher
        if kind == "regex":
            check_regex_size(spec)
            return LLMatcher.grammar_from_regex(normalize_regex(spec)), None, [], None
        if kind == "json_schema":
            schema = anchors_to_pointers(parse_json_schema(spec))
            check_refs(schema)
            check_finite(schema)
            check_schema_patterns(schema)
            rewrite = rewrite_schema(schema, FORMATS)
            relaxed: Relaxed = relax(rewrite.schema, pattern_properties=overlapping)
            checker = SchemaChecker(rewrite.schema, relaxed) if relaxed.taken else None
            try:
                grammar = LLMatcher.grammar_from_json_schema(json.dumps(relaxed.schema), overrides=dict(self.json_options))
            except ValueError as exc:
                raise GrammarError(f"json_schema: {exc}") from None
            return grammar, rewrite.schema, rewrite.warnings, checker
        if kind == "ebnf":
            lark = spec
            if "::=" in spec:  # GBNF (llama.cpp / xgrammar style)
                from llguidance.gbnf_to_lark import gbnf_to_lark

                try:
                    lark = gbnf_to_lark(spec)
                except Exception as exc:
                    raise GrammarError(f"ebnf: cannot parse the GBNF grammar: {exc}") from None
            lark, warnings = rewrite_lark(lark, FORMATS)  # its %json lexemes get the schema rewrites
            return LLMatcher.grammar_from_lark(lark), None, warnings, None
        raise GrammarError(f"unknown constraint kind {kind!r}")

    def compile(self, kind: str, spec: str, timeout: float | None = None) -> LLGuidanceGrammar:
        """Build and validate the grammar; GrammarError names the offending keyword or syntax.

        A grammar that allows nothing at its start (``root ::= root``, ``{"$ref": "#"}``: the
        library's first mask is an error, or empty) is refused here rather than at generation.
        ``timeout`` is not used: llguidance's own limits end its builds.
        """
        grammar, schema, warnings, checker = self._grammar(kind, spec)
        is_error, messages = self._LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error and kind == "json_schema" and messages and _NOT_DISJOINT.search(messages[0]):
            grammar, schema, warnings, checker = self._grammar(kind, spec, overlapping=True)
            is_error, messages = self._LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise self._error(kind, messages[0] if messages else "invalid grammar", schema)
        template = self._LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise self._error(kind, template.get_error(), schema)
        checks = None if checker is None else (checker, self.token_bytes())
        compiled = LLGuidanceGrammar(template, lambda: self._LLMatcher(self.tokenizer, grammar, log_level=0), checks)
        if template.is_error() or not any(template.compute_bitmask()):
            reason = template.get_error().strip().splitlines()[0] if template.is_error() else "no token is allowed"
            raise GrammarError(f"{kind} can produce no output at all ({reason}): a rule or $ref that only refers to itself?")
        compiled.warnings = tuple(warnings)
        return compiled

    def _error(self, kind: str, message: str, schema) -> GrammarError:
        m = _UNIMPLEMENTED.search(message)
        if m and schema is not None:
            keys = [k.strip().strip('"') for k in m.group(1).split(",") if k.strip()]
            return unsupported_error(self.name, schema, keys)
        return GrammarError(f"invalid {kind}: {message.strip()}")
