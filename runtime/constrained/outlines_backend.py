"""The outlines-core backend: regexes (and JSON schemas turned into regexes) as token FSMs.

outlines-core enforces what a regex can express and silently drops the rest of a JSON schema,
so schemas are checked against the keywords it really enforces first (fail closed). Forced
continuations for jump-forward come from interegular's character FSM of the same regex.
"""

from __future__ import annotations

import json

import torch

from radixlm.runtime.constrained import outlines_worker
from radixlm.runtime.constrained.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    Matcher,
    bitmask_width,
)
from radixlm.runtime.constrained.schema_rewrite import rewrite_schema
from radixlm.runtime.constrained.semantic import SchemaChecker, SemanticMatcher, TokenBytes, relax
from radixlm.runtime.constrained.specs import (
    ANNOTATIONS,
    anchors_to_pointers,
    check_finite,
    check_refs,
    check_regex_size,
    iter_keywords,
    normalize_regex,
    parse_json_schema,
    unsupported_error,
)
from radixlm.runtime.constrained.vocab import token_bytes
from radixlm.runtime.constrained.workers import WorkerCrashed, WorkerPool, WorkerTimeout

# What outlines-core's schema-to-regex translation enforces. Integer/number bounds, allOf,
# oneOf's "exactly one", uniqueItems, patternProperties, not, if/then/else ... are not.
ENFORCED = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const",
        "anyOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern", "format",
        "minItems", "maxItems",
    }
)
# Formats it enforces well enough; its own "date" accepts Feb 30 and its "date-time" and "time"
# a missing UTC offset, so those three are rewritten as exact RFC 3339 patterns first.
FORMATS = frozenset({"uuid", "uri", "email", "date", "date-time", "time"})
_DAY = (
    r"(?:\d{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)"
    r"|02-(?:0[1-9]|1\d|2[0-8]))"
    r"|(?:\d{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)-02-29)"
)
_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:(?:[0-5]\d|60)(?:\.\d+)?(?:[Zz]|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
FORMAT_PATTERNS = {"date": _DAY, "time": _TIME, "date-time": f"{_DAY}[Tt]{_TIME}"}
_LITERALS = frozenset({"enum", "const", "default", "examples"})  # values, not schemas
# Keywords that may stand beside a combinator without outlines-core dropping them.
_BESIDE_COMBINATOR = ANNOTATIONS | {"$defs", "definitions"}
_MAX_ROLLBACK = 64


class CharFSM:
    """A character DFA of a regex (interegular's, as plain tables): tracks text, reports forced characters."""

    def __init__(self, tables: tuple) -> None:
        self.initial, self.finals, self.map, self._symbol_of, self._other, self._single = tables

    def step(self, state: int | None, text: str) -> int | None:
        """The state after reading ``text`` (None once the text left the language)."""
        for ch in text:
            if state is None:
                return None
            sym = self._symbol_of.get(ch, self._other)
            state = None if sym is None else self.map.get(state, {}).get(sym)
        return state

    def forced(self, state: int | None, limit: int = 256) -> str:
        """Characters that must come next: while the state is not final and has one single-char exit."""
        out: list[str] = []
        while state is not None and state not in self.finals and len(out) < limit:
            exits = self.map.get(state, {})
            if len(exits) != 1:
                break
            sym, nxt = next(iter(exits.items()))
            if sym not in self._single:
                break
            out.append(self._single[sym])
            state = nxt
        return "".join(out)


class OutlinesMatcher(Matcher):
    """A request's state: the token-level guide plus the character FSM for forced text.

    The per-step methods never raise: an exception from outlines-core (e.g. a rollback past its
    history) becomes ``error()`` and the matcher fails closed (no token allowed).
    """

    def __init__(self, guide, token_text: dict[int, bytes], charfsm: CharFSM | None) -> None:
        self._guide = guide
        self._bytes = token_text
        self._fsm = charfsm
        self._states = [charfsm.initial if charfsm else None]
        self._pending = [b""]  # undecoded UTF-8 tail after each token
        self._failure: str | None = None

    def _fail(self, what: str, exc: Exception) -> None:
        if self._failure is None:
            self._failure = f"outlines {what} failed: {type(exc).__name__}: {exc}"

    def accept(self, token: int) -> bool:
        """Advance if ``token`` is allowed."""
        if self._failure is not None:
            return False
        try:
            if not self._guide.accepts_tokens([token]):
                return False
            self._guide.advance(token, return_tokens=False)
        except Exception as exc:
            self._fail("accept", exc)
            return False
        if self._fsm is not None:
            data = self._pending[-1] + self._bytes.get(token, b"")
            text, rest = _split_utf8(data)
            self._states.append(self._fsm.step(self._states[-1], text))
            self._pending.append(rest)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed tokens into ``bitmask[row]`` (none once failed)."""
        v = bitmask[row]
        if self._failure is None:
            try:
                self._guide.write_mask_into(v.data_ptr(), v.numel(), v.element_size())
                return
            except Exception as exc:
                self._fail("fill_bitmask", exc)
        v.zero_()

    def is_terminated(self) -> bool:
        """True when only EOS may follow."""
        if self._failure is not None:
            return False
        try:
            return self._guide.is_finished()
        except Exception as exc:
            self._fail("is_terminated", exc)
            return False

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` tokens (a failure shows in ``error()``)."""
        if not num_tokens or self._failure is not None:
            return
        try:
            self._guide.rollback_state(num_tokens)
        except Exception as exc:
            self._fail("rollback", exc)
            return
        if self._fsm is not None:
            del self._states[-num_tokens:]
            del self._pending[-num_tokens:]

    def forced_text(self) -> str:
        """Forced characters from the character FSM ('' with a partial UTF-8 character pending)."""
        if self._fsm is None or self._pending[-1] or self._failure is not None:
            return ""
        return self._fsm.forced(self._states[-1])

    def copy(self) -> OutlinesMatcher:
        """An independent copy."""
        import copy

        twin = OutlinesMatcher(copy.deepcopy(self._guide), self._bytes, self._fsm)
        twin._states, twin._pending, twin._failure = list(self._states), list(self._pending), self._failure
        return twin

    def error(self) -> str | None:
        """Why this matcher failed (an exception from outlines-core), or None."""
        return self._failure


def _split_utf8(data: bytes) -> tuple[str, bytes]:
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8"), data[cut:]
        except UnicodeDecodeError:
            continue
    return "", data


class OutlinesGrammar(CompiledGrammar):
    """A compiled outlines-core index and the character FSM of its regex."""

    def __init__(self, index, token_text: dict[int, bytes], charfsm: CharFSM | None, checks: tuple[SchemaChecker, TokenBytes] | None = None) -> None:
        self._index, self._bytes, self._fsm = index, token_text, charfsm
        self.checks = checks  # keywords checked beside the grammar (semantic.py), or None

    def matcher(self) -> Matcher:
        """A guide at the start state (with the schema's semantic checks around it, if any)."""
        import outlines_core

        m = OutlinesMatcher(outlines_core.Guide(self._index, max_rollback=_MAX_ROLLBACK), self._bytes, self._fsm)
        return m if self.checks is None else SemanticMatcher(m, *self.checks)


class OutlinesBackend(GrammarBackend):
    """Compiles regexes and JSON schemas with outlines-core (no EBNF).

    The index and the character FSM are built in worker processes (``workers.py``), each given
    the vocabulary once: both builds can run for minutes on some regexes, and a worker past the
    compile timeout is killed rather than left running.
    """

    name = "outlines"
    default_timeout = 30.0  # when compile() is called without one

    def __init__(self, hf_tokenizer, vocab_size: int, end_ids: set[int], whitespace_pattern: str | None = None) -> None:
        import outlines_core

        self._oc = outlines_core
        self.vocab_size = vocab_size
        eos = hf_tokenizer.eos_token_id if hf_tokenizer.eos_token_id is not None else min(end_ids)
        self._bytes = {t: b for t, b in token_bytes(hf_tokenizer).items() if t < vocab_size and t not in end_ids and b}
        self._end_ids = set(end_ids)
        self._token_bytes: TokenBytes | None = None  # built on the first schema that needs checks
        groups: dict[bytes, list[int]] = {}
        for tid, data in self._bytes.items():
            groups.setdefault(data, []).append(tid)
        self.workers = WorkerPool(outlines_worker.__file__, (eos, groups))
        self.workers.warm()
        self.whitespace_pattern = whitespace_pattern if whitespace_pattern is not None else ""

    def token_bytes(self) -> TokenBytes:
        """Every token's bytes, for the semantic checks (built once, on first use)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self._bytes, self.vocab_size, self._end_ids)
        return self._token_bytes

    def schema_regex(self, spec: str) -> tuple[str, list[str], SchemaChecker | None]:
        """The regex outlines-core builds for a JSON schema, after checking it is enforceable,
        the warnings about what it leaves out, and the checker of the keywords it was relaxed
        of (``semantic.py``)."""
        schema = anchors_to_pointers(parse_json_schema(spec))
        check_refs(schema)
        check_finite(schema)
        rewrite = rewrite_schema(schema, FORMATS)
        relaxed = relax(rewrite.schema)
        checker = SchemaChecker(rewrite.schema, relaxed) if relaxed.taken else None
        schema = relaxed.schema
        bad = {k for k, _ in iter_keywords(schema) if k not in ENFORCED and k not in ANNOTATIONS}
        if _unknown_format(schema):
            bad.add("format")
        if bad:
            raise unsupported_error(self.name, schema, sorted(bad))
        dropped = _dropped_combinations(schema)
        if dropped:
            raise GrammarError(f"json_schema combines keywords the {self.name} backend would not all enforce: {'; '.join(dropped[:5])}")
        try:
            return self._oc.json_schema.build_regex_from_schema(json.dumps(_prepared(schema)), self.whitespace_pattern), rewrite.warnings, checker
        except Exception as exc:
            raise GrammarError(f"json_schema: {exc}") from None

    def compile(self, kind: str, spec: str, timeout: float | None = None) -> OutlinesGrammar:
        """Compile to an outlines-core index in a worker; GrammarError on bad, unsupported,
        too large or empty specs, and on a build that runs past ``timeout`` seconds."""
        if kind == "ebnf":
            raise GrammarError("ebnf grammars need the llguidance backend (--grammar-backend llguidance)")
        warnings: list[str] = []
        checker = None
        if kind == "json_schema":
            regex, warnings, checker = self.schema_regex(spec)
            check_regex_size(regex, "the regex of this json_schema")
        elif kind == "regex":
            check_regex_size(spec)
            regex = spec
        else:
            raise GrammarError(f"unknown constraint kind {kind!r}")
        limit = self.default_timeout if timeout is None else timeout
        try:
            status, answer = self.workers.run(normalize_regex(regex), limit)
        except WorkerTimeout:
            raise GrammarError(f"{kind} took longer than {limit:g} s to compile (grammar_compile_timeout)") from None
        except (WorkerCrashed, RuntimeError) as exc:
            raise GrammarError(f"{kind} could not be compiled: {exc}") from None
        if status != "ok":
            raise GrammarError(f"invalid {kind}: {answer}")
        index, tables = answer
        checks = None if checker is None else (checker, self.token_bytes())
        compiled = OutlinesGrammar(index, self._bytes, CharFSM(tables) if tables is not None else None, checks)
        bitmask = torch.zeros(1, bitmask_width(self.vocab_size), dtype=torch.int32)
        compiled.matcher().fill_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            raise GrammarError(f"{kind} can produce no output at all: no token is allowed at its start")
        compiled.warnings = tuple(warnings)
        return compiled

    def close(self) -> None:
        """Kill the worker processes."""
        self.workers.close()


def _unknown_format(schema) -> bool:
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            fmt = node.get("format")
            if isinstance(fmt, str) and fmt not in FORMATS and node.get("type") == "string":
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _subschemas(schema, path: str = ""):
    """Every ``(JSON pointer, subschema dict)`` in a schema, the root first."""
    if not isinstance(schema, dict):
        return
    yield path or "/", schema
    for key, value in schema.items():
        sub = f"{path}/{key}"
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            for name, child in value.items():
                yield from _subschemas(child, f"{sub}/{name}")
        elif key in ("anyOf", "prefixItems", "items") and isinstance(value, list):
            for i, child in enumerate(value):
                yield from _subschemas(child, f"{sub}/{i}")
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            yield from _subschemas(value, sub)


def _dropped_combinations(schema) -> list[str]:
    """Places where outlines-core would keep one keyword and silently drop another beside it."""
    found = []
    for path, node in _subschemas(schema):
        if "pattern" in node and ({"minLength", "maxLength", "format"} & node.keys()):
            found.append(f"'pattern' with {sorted({'minLength', 'maxLength', 'format'} & node.keys())} at {path}")
        if "format" in node and ({"minLength", "maxLength"} & node.keys()):
            found.append(f"'format' with a length bound at {path}")
        for combinator in ("anyOf", "$ref", "enum", "const"):
            if combinator in node:
                extra = sorted(k for k in node if k != combinator and k not in _BESIDE_COMBINATOR and not (combinator in ("enum", "const") and k == "type"))
                if extra:
                    found.append(f"'{combinator}' beside {extra} at {path}")
                break
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        missing = [name for name in node.get("required", []) if isinstance(name, str) and name not in props]
        if missing:
            found.append(f"required {missing} not in 'properties' at {path}")
    return found


def _prepared(schema):
    """A copy of the schema as outlines-core should see it: date and time formats as exact
    patterns, every pattern confined to the JSON string (see ``confine_pattern``)."""
    if isinstance(schema, list):
        return [_prepared(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _LITERALS else _prepared(value) for key, value in schema.items()}
    types = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if "string" in types and isinstance(out.get("format"), str) and out["format"] in FORMAT_PATTERNS:
        out["pattern"] = FORMAT_PATTERNS[out.pop("format")]
    elif isinstance(out.get("pattern"), str):
        out["pattern"] = confine_pattern(out["pattern"])
    return out


_PLAIN = '"\\\\\\x00-\\x1f'  # what a JSON string holds only escaped: quote, backslash, controls
_NEGATED = {".": f"[^{_PLAIN}]", "S": f"[^\\s{_PLAIN}]", "W": f"[^\\w{_PLAIN}]", "D": f"[^0-9{_PLAIN}]"}


def confine_pattern(pattern: str) -> str:
    """The pattern, matching only unescaped JSON string characters where it matched "anything but".

    outlines-core pastes a pattern between the string's quotes as it is, so ``.``, ``\\S`` or
    ``[^a]`` would also match a quote (ending the string early) or escape text (``\\u0000``
    passing ``[^\\x00]``), and ``\\s`` a raw newline. Rewritten, they match no quote, backslash
    or control character (``\\s`` only a space); strings needing those under such a pattern cannot
    be generated (fail closed).
    """
    if '"' in pattern:
        raise GrammarError(f"json_schema pattern {pattern!r} mentions a quote, which the outlines backend cannot confine to the string")
    out: list[str] = []
    i, in_class, negated = 0, False, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt in "SWD":
                if in_class:
                    raise GrammarError(f"json_schema pattern {pattern!r}: a class with \\{nxt} cannot be confined to the string by the outlines backend")
                out.append(_NEGATED[nxt])
            elif nxt == "s" and not (in_class and negated):  # raw tabs and newlines are not JSON: a space
                out.append(" " if in_class else "[ ]")
            else:
                out.append(c + nxt)
            i += 2
            continue
        if in_class:
            if c == "]":
                out.append(_PLAIN + "]" if negated else "]")
                in_class = False
            else:
                out.append(c)
        elif c == "[":
            in_class, negated = True, pattern[i + 1 : i + 2] == "^"
            out.append("[^" if negated else "[")
            i += 2 if negated else 1
            if pattern[i : i + 1] == "]":  # a leading ']' is a literal
                out.append("]")
                i += 1
            continue
        elif c == ".":
            out.append(_NEGATED["."])
        else:
            out.append(c)
        i += 1
    return "".join(out)
