"""Constrained decoding: backends, fail-closed refusals, the compiler cache, jump-forward."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch

from helpers import accepts_text as _walk
from helpers import grammar_backends, tokenizer_parts
from radixlm.runtime.constrained.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    bitmask_width,
    unpack_bitmask,
)
from radixlm.runtime.constrained.compiler import GrammarCompiler
from radixlm.runtime.constrained.specs import locate, normalize_regex

BACKENDS = ["llguidance", "outlines"]


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_path):
    return tokenizer_parts(smollm2_path)


@pytest.fixture(scope="module")
def backends(smol_tokenizer):
    return grammar_backends(*smol_tokenizer)


def test_normalize_regex_makes_digits_ascii_inside_and_outside_classes():
    assert normalize_regex(r"\d{3}-[\d.]+") == r"[0-9]{3}-[0-9.]+"
    assert normalize_regex(r"\\d[\]\d]") == r"\\d[\]0-9]"
    assert normalize_regex(r"[^\d]") == r"[^0-9]"


def test_locate_names_keywords_with_their_json_pointer():
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "a": {"not": {"type": "integer"}}}, "$defs": {"x": {"uniqueItems": True}}}
    assert locate(schema, ["not", "uniqueItems"]) == ["'not' at /properties/a", "'uniqueItems' at /$defs/x"]


@pytest.mark.parametrize("name", BACKENDS)
def test_regex_accepts_matches_and_rejects_the_rest(name, backends, smol_tokenizer):
    tok, vocab, ends = smol_tokenizer
    b = backends[name]
    assert _walk(b, tok, vocab, ends, "regex", r"\d{4}-\d{2}-\d{2}", "2024-02-29")
    assert not _walk(b, tok, vocab, ends, "regex", r"\d{4}-\d{2}-\d{2}", "2024-2-29")
    assert not _walk(b, tok, vocab, ends, "regex", r"\d{4}", "٢٠٢٤")  # Arabic-Indic digits: \d means ASCII here
    # probe fact: outlines-core alone rejected this valid string
    assert _walk(b, tok, vocab, ends, "regex", r"[a-z.]+\.[a-z]{2}", "a.bc.de")


@pytest.mark.parametrize("name", BACKENDS)
def test_eos_is_allowed_only_where_the_grammar_can_end(name, backends, smol_tokenizer):
    tok, vocab, ends = smol_tokenizer
    m = backends[name].compile("regex", r"ab(cd)?").matcher()
    bitmask = torch.zeros(1, bitmask_width(vocab), dtype=torch.int32)
    for text, can_end in (("", False), ("ab", True), ("cd", True)):
        for t in tok.encode(text, add_special_tokens=False):
            assert m.accept(t)
        if m.is_terminated():
            assert can_end
            continue
        m.fill_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask, vocab)[0]
        assert any(bool(allowed[e]) for e in ends) == can_end, text


@pytest.mark.parametrize("name", BACKENDS)
def test_json_schema_instances(name, backends, smol_tokenizer):
    tok, vocab, ends = smol_tokenizer
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "tags"], "additionalProperties": False})
    b = backends[name]
    assert _walk(b, tok, vocab, ends, "json_schema", schema, '{"name":"Ada","tags":["x","y"]}')
    assert not _walk(b, tok, vocab, ends, "json_schema", schema, '{"name":"Ada"}')
    assert not _walk(b, tok, vocab, ends, "json_schema", schema, '{"name": "Ada","tags":[]}')  # whitespace is bounded: compact


def test_llguidance_enforces_integer_bounds_and_outlines_refuses_them(backends, smol_tokenizer):
    tok, vocab, ends = smol_tokenizer
    schema = json.dumps({"type": "integer", "minimum": 3, "maximum": 5})
    assert _walk(backends["llguidance"], tok, vocab, ends, "json_schema", schema, "4")
    assert not _walk(backends["llguidance"], tok, vocab, ends, "json_schema", schema, "7")
    with pytest.raises(GrammarError, match="'maximum' at /"):
        backends["outlines"].compile("json_schema", schema)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, r"'pattern' with \['maxLength'\] at /"),
        ({"type": "string", "format": "date", "minLength": 10}, "'format' with a length bound at /"),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]}, "'anyOf' beside"),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, r"required \['b'\] not in 'properties' at /"),
    ],
    ids=["pattern-and-length", "date-and-length", "anyof-beside-properties", "required-not-a-property"],
)
def test_outlines_refuses_schemas_it_would_enforce_only_in_part(backends, schema, message):
    with pytest.raises(GrammarError, match=message):
        backends["outlines"].compile("json_schema", json.dumps(schema))


@pytest.mark.parametrize(
    ("fmt", "good", "bad"),
    [("date", "2024-02-29", "2023-02-29"), ("date", "2022-12-31", "2022-04-31"), ("date-time", "2022-01-01T12:00:00Z", "2022-01-01T12:00:00"), ("time", "08:30:00+05:30", "08:30:00")],
)
def test_outlines_enforces_date_and_time_formats_exactly(backends, smol_tokenizer, fmt, good, bad):
    tok, vocab, ends = smol_tokenizer
    schema = json.dumps({"type": "string", "format": fmt})
    assert _walk(backends["outlines"], tok, vocab, ends, "json_schema", schema, json.dumps(good))
    assert not _walk(backends["outlines"], tok, vocab, ends, "json_schema", schema, json.dumps(bad))


def test_outlines_patterns_cannot_leave_the_json_string(backends, smol_tokenizer):
    tok, vocab, ends = smol_tokenizer
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "string", "pattern": "^[^\\s]+$"}}, "required": ["a"], "additionalProperties": False})
    assert _walk(backends["outlines"], tok, vocab, ends, "json_schema", schema, '{"a":"x1"}')
    assert not _walk(backends["outlines"], tok, vocab, ends, "json_schema", schema, '{"a":"x","b":"1"}')
    nul = json.dumps({"type": "string", "pattern": "^/[^\u0000]+$"})
    assert not _walk(backends["outlines"], tok, vocab, ends, "json_schema", nul, '"/a\\u0000"')
    words = json.dumps({"type": "string", "pattern": "^\\w+\\s\\w+$"})
    assert _walk(backends["outlines"], tok, vocab, ends, "json_schema", words, '"ab cd"')
    assert not _walk(backends["outlines"], tok, vocab, ends, "json_schema", words, '"ab\ncd"')  # a raw newline is not JSON
    with pytest.raises(GrammarError, match="pattern"):
        backends["outlines"].compile("json_schema", json.dumps({"type": "string", "pattern": "[\\S]+"}))


def test_outlines_accepts_annotations_and_typed_enums_beside_keywords(backends):
    schema = {"type": "object", "$defs": {"c": {"type": "string", "enum": ["red", "blue"], "description": "colour"}}, "properties": {"c": {"$ref": "#/$defs/c", "description": "x"}}, "required": ["c"]}
    backends["outlines"].compile("json_schema", json.dumps(schema))


def test_llguidance_handles_all_of(backends, smol_tokenizer):
    tok, vocab, ends = smol_tokenizer
    schema = json.dumps({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"required": ["b"], "properties": {"b": {"type": "boolean"}}}]})
    assert _walk(backends["llguidance"], tok, vocab, ends, "json_schema", schema, '{"a":1,"b":true}')
    assert not _walk(backends["llguidance"], tok, vocab, ends, "json_schema", schema, '{"a":1}')


def test_lark_and_gbnf_grammars_with_llguidance(backends, smol_tokenizer):
    tok, vocab, ends = smol_tokenizer
    lark = 'start: "yes" | "no" | NUMBER\nNUMBER: /[0-9]+/'
    gbnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-z]+'
    b = backends["llguidance"]
    assert _walk(b, tok, vocab, ends, "ebnf", lark, "no") and _walk(b, tok, vocab, ends, "ebnf", lark, "42")
    assert not _walk(b, tok, vocab, ends, "ebnf", lark, "maybe")
    assert _walk(b, tok, vocab, ends, "ebnf", gbnf, "(ab,c)") and not _walk(b, tok, vocab, ends, "ebnf", gbnf, "(ab,)")
    with pytest.raises(GrammarError, match="llguidance"):
        backends["outlines"].compile("ebnf", lark)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(
    "kind, spec, message",
    [
        ("regex", "(unclosed", "invalid regex"),
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", '{"$ref": "#/$defs/missing"}', "missing"),
        ("json_schema", '{"type": "object", "properties": {"a": {"$dynamicRef": "#/$defs/x"}}}', "'$dynamicRef' at /properties/a"),
        ("json_schema", "[1, 2]", "JSON object"),
    ],
)
def test_bad_specs_are_refused_with_a_clear_error(name, kind, spec, message, backends):
    with pytest.raises(GrammarError, match=re.escape(message)):
        backends[name].compile(kind, spec)


@pytest.mark.parametrize("name", BACKENDS)
def test_a_ref_to_a_plain_name_anchor_resolves_like_its_pointer(name, backends, smol_tokenizer):
    """Draft 4's ``id: "#name"``, draft 6/7's ``$id`` and 2019's ``$anchor`` name a schema that
    ``$ref: "#name"`` refers to."""
    tok, vocab, ends = smol_tokenizer
    for declare in ({"id": "#cap"}, {"$id": "#cap"}, {"$anchor": "cap"}):
        schema = {"definitions": {"c": {**declare, "enum": [1, 7]}}, "type": "object", "properties": {"x": {"$ref": "#cap"}}, "required": ["x"], "additionalProperties": False}
        spec = json.dumps(schema)
        assert _walk(backends[name], tok, vocab, ends, "json_schema", spec, '{"x":7}')
        assert not _walk(backends[name], tok, vocab, ends, "json_schema", spec, '{"x":"7"}')
        assert not _walk(backends[name], tok, vocab, ends, "json_schema", spec, '{"x":12}')


EXPLOSIVE = "(a|b)*a(a|b){11}"  # its DFA has 2^12 states: outlines-core builds them all


def test_a_regex_that_explodes_in_size_times_out_with_outlines(backends):
    compiler = GrammarCompiler(lambda: backends["outlines"], "outlines", timeout=0.3)
    with pytest.raises(GrammarError, match="grammar_compile_timeout"):
        compiler.compile("regex", EXPLOSIVE)
    assert compiler.wait_idle(30)  # the worker building it was killed, not left running


def test_llguidance_enforces_the_same_regex_lazily(backends, smol_tokenizer):
    tok, vocab, ends = smol_tokenizer
    text = "ba" + "ab" * 5 + "b"
    assert _walk(backends["llguidance"], tok, vocab, ends, "regex", EXPLOSIVE, text)
    assert not _walk(backends["llguidance"], tok, vocab, ends, "regex", EXPLOSIVE, "b" * 13)


@pytest.mark.parametrize("name", BACKENDS)
def test_matcher_rollback_and_copy(name, backends, smol_tokenizer):
    tok, vocab, _ = smol_tokenizer
    m = backends[name].compile("regex", "(abc|abd)e").matcher()
    ids = tok.encode("abd", add_special_tokens=False)
    for t in ids:
        assert m.accept(t)
    twin = m.copy()
    m.rollback(len(ids))
    for t in tok.encode("abc", add_special_tokens=False):
        assert m.accept(t)
    e = tok.encode("e", add_special_tokens=False)[0]
    assert twin.accept(e) and m.accept(e)
    assert twin.is_terminated() and m.is_terminated()


@pytest.mark.parametrize("name", BACKENDS)
def test_forced_text_is_reported_for_jump_forward(name, backends):
    schema = json.dumps({"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"], "additionalProperties": False})
    m = backends[name].compile("json_schema", schema).matcher()
    assert m.forced_text() == '{"answer":'


class _SlowBackend(GrammarBackend):
    name = "slow"

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def compile(self, kind: str, spec: str, timeout: float | None = None) -> CompiledGrammar:
        with self.lock:
            self.calls += 1
        if spec == "slow":
            time.sleep(1.0)
        if spec == "bad":
            raise GrammarError("bad spec")
        return object()  # type: ignore[return-value]


def test_compiler_caches_by_spec_and_times_out():
    backend = _SlowBackend()
    compiler = GrammarCompiler(lambda: backend, "slow", timeout=0.2)
    a = compiler.compile("regex", "x")
    assert compiler.compile("regex", "x") is a and backend.calls == 1
    compiler.compile("json_schema", "x")
    assert backend.calls == 2  # the kind is part of the key
    with pytest.raises(GrammarError, match="grammar_compile_timeout"):
        compiler.compile("regex", "slow")
    with pytest.raises(GrammarError, match="bad spec"):
        compiler.compile("regex", "bad")
    with pytest.raises(GrammarError):
        compiler.compile("regex", "bad")
    assert backend.calls == 4  # failures are cached too
    compiler.shutdown()
