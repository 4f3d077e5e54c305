"""JSON Schema keywords no grammar can say (uniqueItems, overlapping oneOf, not, if/then/else,
propertyNames, min/maxProperties on open objects, contains, lookaround patterns, integer bounds
past 64 bits, overlapping patternProperties) are enforced beside the grammar: every document
is judged exactly as ``jsonschema`` judges it, random walks of the mask end valid, and where
nothing valid can follow the matcher says so instead of letting invalid JSON through."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import tokenizer_parts
from radixlm.runtime.constrained.base import bitmask_width
from radixlm.runtime.constrained.llguidance_backend import LLGuidanceBackend
from radixlm.runtime.constrained.semantic import SemanticMatcher, canonical, relax

SMALL_INT = st.integers(-2, 3)
WORD = st.sampled_from(["a", "b", "ab", "x1", "x2", "y", "abc", "abd", "n", "s"])
LEAF = st.one_of(SMALL_INT, WORD, st.booleans(), st.none(), st.sampled_from([1.0, 2.5]))
OBJ_KEYS = st.sampled_from(["a", "b", "k", "v", "x1", "x2", "y", "ab"])

# name -> (schema, strategy of candidate documents near the schema's edges)
CASES = {
    "uniqueItems of integers": ({"type": "array", "items": {"type": "number"}, "uniqueItems": True}, st.lists(st.one_of(SMALL_INT, st.sampled_from([1.0, 2.0])), max_size=5)),
    "uniqueItems of strings": ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, st.lists(WORD, max_size=5)),
    "uniqueItems of objects": (
        {"type": "array", "items": {"type": "object", "additionalProperties": {"type": "integer"}}, "uniqueItems": True},
        st.lists(st.dictionaries(st.sampled_from(["p", "q"]), st.integers(0, 1), max_size=2), max_size=4),
    ),
    "overlapping oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 2}]}, st.one_of(SMALL_INT, st.sampled_from([1.5, 2.5, 3.0]))),
    "not of a general schema": (
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "not": {"required": ["a", "b"], "properties": {"a": {"const": 1}}}},
        st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 2), max_size=2),
    ),
    "if then else": (
        {
            "type": "object",
            "properties": {"k": {"enum": ["n", "s"]}, "v": {"type": ["integer", "string"], "maxLength": 3}},
            "required": ["k", "v"],
            "additionalProperties": False,
            "if": {"properties": {"k": {"const": "n"}}},
            "then": {"properties": {"v": {"type": "integer"}}},
            "else": {"properties": {"v": {"type": "string"}}},
        },
        st.fixed_dictionaries({"k": st.sampled_from(["n", "s"]), "v": st.one_of(SMALL_INT, WORD)}),
    ),
    "propertyNames and maxProperties": ({"type": "object", "propertyNames": {"pattern": "^x"}, "maxProperties": 2, "additionalProperties": {"type": "integer"}}, st.dictionaries(OBJ_KEYS, SMALL_INT, max_size=3)),
    "minProperties on an open object": ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 2}, st.dictionaries(OBJ_KEYS, SMALL_INT, max_size=3)),
    "contains with maxContains": ({"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 2}, "maxContains": 2}, st.lists(SMALL_INT, max_size=5)),
    "dependentSchemas on an open object": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "dependentSchemas": {"a": {"maxProperties": 2}}},
        st.dictionaries(OBJ_KEYS, SMALL_INT, max_size=3),
    ),
    "uniqueItems in an anyOf branch": ({"anyOf": [{"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, {"type": "string"}]}, st.one_of(st.lists(SMALL_INT, max_size=4), WORD)),
    "uniqueItems behind a $ref": (
        {"$defs": {"set": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "type": "object", "properties": {"s": {"$ref": "#/$defs/set"}, "t": {"$ref": "#/$defs/set"}}},
        st.dictionaries(st.sampled_from(["s", "t"]), st.lists(SMALL_INT, max_size=4), max_size=2),
    ),
    "integer bounds past 64 bits": ({"type": "integer", "minimum": -(2**70), "maximum": 2**80}, st.one_of(SMALL_INT, st.sampled_from([2**79, 2**80, 2**80 + 1, -(2**70) - 1, -(2**70)]))),
    "a lookahead pattern": ({"type": "string", "pattern": "^(?!ab)[a-z]+$"}, WORD),
    "overlapping patternProperties": (
        {"type": "object", "patternProperties": {"^a": {"type": "integer"}, "b$": {"type": "string"}}, "additionalProperties": False},
        st.dictionaries(OBJ_KEYS, st.one_of(SMALL_INT, WORD), max_size=3),
    ),
    "unevaluatedProperties": (
        {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}], "unevaluatedProperties": False},
        st.fixed_dictionaries({}, optional={"a": SMALL_INT, "b": SMALL_INT, "c": SMALL_INT}),
    ),
    "a duplicate-free set of enum values (nested)": (
        {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "uniqueItems": True}}, "required": ["tags"], "additionalProperties": False},
        st.fixed_dictionaries({"tags": st.lists(st.sampled_from(["red", "green", "blue"]), max_size=4)}),
    ),
}


@pytest.fixture(scope="module")
def smol(smollm2_path):
    tok, vocab, ends = tokenizer_parts(smollm2_path)
    return tok, vocab, ends, LLGuidanceBackend(tok, vocab, ends)


@pytest.fixture(scope="module")
def compiled(smol):
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = smol[3].compile("json_schema", json.dumps(CASES[name][0]))
        return cache[name]

    return get


def _allowed(matcher, vocab: int) -> np.ndarray:
    bitmask = torch.zeros(1, bitmask_width(vocab), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)


def _text(doc, schema) -> str:
    """``doc`` as compact JSON, a top-level object's declared properties first and in their
    declared order (llguidance writes declared properties in that order only)."""
    declared = list(schema.get("properties", {})) if isinstance(doc, dict) else []
    if declared:
        doc = {k: doc[k] for k in sorted(doc, key=lambda k: (k not in declared, declared.index(k) if k in declared else 0))}
    return json.dumps(doc, separators=(",", ":"))


def _accepts(grammar, smol, text: str) -> bool:
    """True when ``text`` passes the mask and accept() token by token, and may end there."""
    tok, vocab, ends, _ = smol
    m = grammar.matcher()
    for t in tok.encode(text, add_special_tokens=False):
        if not _allowed(m, vocab)[t]:
            return False
        assert m.accept(t), f"the mask allowed token {t} that accept() refused"
    return m.is_terminated() or any(_allowed(m, vocab)[e] for e in ends)


@pytest.mark.parametrize("name", list(CASES))
def test_each_semantic_keyword_accepts_exactly_what_jsonschema_validates(name, compiled, smol):
    schema, documents = CASES[name]
    grammar = compiled(name)
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert isinstance(grammar.matcher(), SemanticMatcher)

    @settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(documents)
    def judged_like_jsonschema(doc):
        text = _text(doc, schema)
        assert _accepts(grammar, smol, text) == validator.is_valid(doc), text

    judged_like_jsonschema()


@pytest.mark.parametrize("name", list(CASES))
def test_random_walks_of_the_mask_end_in_valid_documents(name, compiled, smol):
    """Follow the mask (half the time toward closing) until the document may end: it validates."""
    tok, vocab, ends, _ = smol
    schema = CASES[name][0]
    validator = jsonschema.validators.validator_for(schema)(schema)
    grammar = compiled(name)
    closing = np.array([any(c in tok.decode([t]) for c in '"]}') for t in range(vocab)])
    rng = random.Random(name)
    finished = 0
    for _ in range(6):
        m, out = grammar.matcher(), []
        for _step in range(48):
            allowed = _allowed(m, vocab)
            if not allowed.any():
                assert m.error() and "JSON schema" in m.error()  # a dead end says so
                break
            if any(allowed[e] for e in ends) and (rng.random() < 0.5 or m.is_terminated()):
                validator.validate(json.loads(tok.decode(out)))
                finished += 1
                break
            pool = np.flatnonzero(allowed & closing) if rng.random() < 0.5 and (allowed & closing).any() else np.flatnonzero(allowed)
            t = int(rng.choice(list(pool)))
            if t in ends:
                continue
            assert m.accept(t), "accept() refused a token its own mask allowed"
            out.append(t)
    assert finished >= 2, f"only {finished} of 6 walks reached a valid end"


def test_a_set_of_enum_values_never_walks_into_an_item_it_cannot_finish(smol):
    """Where the grammar forces the rest of an item (an enum value), a start whose forced end
    would be a duplicate is refused up front: random walks never reach a dead end."""
    tok, vocab, ends, backend = smol
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue", "reed"]}, "uniqueItems": True}
    grammar = backend.compile("json_schema", json.dumps(schema))
    rng = random.Random(3)
    for _ in range(12):
        m, out = grammar.matcher(), []
        while True:
            allowed = _allowed(m, vocab)
            assert allowed.any(), f"dead end after {tok.decode(out)!r}: {m.error()}"
            choices = [int(t) for t in np.flatnonzero(allowed)]
            t = rng.choice(choices)
            if t in ends:
                break
            assert m.accept(t)
            out.append(t)
        jsonschema.validate(json.loads(tok.decode(out)), schema)


def test_the_grammar_alone_would_accept_what_the_checker_refuses(smol):
    """The relaxed grammar takes a duplicate item, an overlap of both oneOf branches, a name
    propertyNames forbids: the checker is what refuses them."""
    tok, vocab, ends, backend = smol
    for schema, text in [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,2,1]"),
        ({"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 2}]}, "3"),
        ({"type": "object", "propertyNames": {"pattern": "^x"}}, '{"y":1}'),
    ]:
        grammar = backend.compile("json_schema", json.dumps(schema))
        checked = grammar.matcher()
        bare = checked.inner
        for t in tok.encode(text, add_special_tokens=False):
            assert bare.accept(t)
        assert not _accepts(grammar, smol, text)


def test_a_dead_end_is_an_error_naming_the_keyword_never_invalid_output(smol):
    tok, vocab, ends, backend = smol
    schema = {"type": "array", "items": {"enum": [1]}, "uniqueItems": True, "minItems": 2}  # no valid instance
    m = backend.compile("json_schema", json.dumps(schema)).matcher()
    for _ in range(8):  # "[" may come; then every way on completes a duplicate (seen through the forced text)
        allowed = _allowed(m, vocab)
        if not allowed.any():
            break
        assert m.accept(int(np.flatnonzero(allowed)[0]))
    assert not _allowed(m, vocab).any()
    assert "uniqueItems" in m.error()


def test_rollback_and_copy_restore_what_the_checker_has_seen(smol):
    tok, vocab, ends, backend = smol
    m = backend.compile("json_schema", json.dumps(CASES["uniqueItems of integers"][0])).matcher()
    tokens = tok.encode("[1,2,", add_special_tokens=False)
    for t in tokens:
        assert m.accept(t)
    twin = m.copy()
    one = tok.encode("1", add_special_tokens=False)[0]
    close = tok.encode("]", add_special_tokens=False)[0]
    assert m.accept(one) and not m.accept(close)  # [1,2,1] completes a duplicate
    m.rollback(3)  # back to "[1,"
    three = tok.encode("3", add_special_tokens=False)[0]
    assert m.accept(three) and m.accept(close)
    assert twin.accept(one) and not twin.accept(close)  # the copy kept its own state


def test_relax_keeps_the_original_and_takes_out_only_what_it_names():
    schema = {"type": "object", "properties": {"a": {"enum": [{"not": 1}], "uniqueItems": True, "type": "array"}}, "oneOf": [{"required": ["a"]}, {"minProperties": 1}]}
    before = json.dumps(schema)
    out = relax(schema)
    assert json.dumps(schema) == before  # the checker walks the original
    assert out.schema["properties"]["a"] == {"enum": [{"not": 1}], "type": "array"}  # data inside enum untouched
    assert out.schema["anyOf"] == [{"required": ["a"]}, {}] and "oneOf" not in out.schema
    assert sorted(k for k, _ in out.taken) == ["minProperties", "oneOf", "uniqueItems"]


def test_canonical_item_text_follows_json_schema_equality():
    assert canonical(1) == canonical(1.0) and canonical({"a": 1, "b": [2.0]}) == canonical({"b": [2], "a": 1})
    assert canonical(True) != canonical(1) and canonical("1") != canonical(1)


def test_the_outlines_backend_checks_the_same_keywords(smol):
    from radixlm.runtime.constrained.outlines_backend import OutlinesBackend

    tok, vocab, ends, _ = smol
    backend = OutlinesBackend(tok, vocab, ends)
    try:
        for schema, good, bad in [
            ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 4}, "[1,2]", "[2,2]"),
            ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1.5", "1"),
            ({"type": "string", "maxLength": 3, "not": {"const": "ab"}}, '"abc"', '"ab"'),
        ]:
            grammar = backend.compile("json_schema", json.dumps(schema))
            assert isinstance(grammar.matcher(), SemanticMatcher)
            assert _accepts(grammar, smol, good) and not _accepts(grammar, smol, bad), schema
    finally:
        backend.close()


# ------------------------------------------------------------------ through the engine
SET_OF_COLOURS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "uniqueItems": True, "minItems": 1}, "n": {"type": "integer", "not": {"const": 0}}},
    "required": ["tags", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    import radixlm

    with radixlm.Engine(model_path=tiny_llama, max_total_tokens=4096) as eng:
        yield eng


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generated_outputs_satisfy_the_checked_keywords(tiny_engine, temperature):
    """A random tiny model writes the JSON: every output parses and validates (the budget
    closer ends it within max_tokens), for greedy and sampled decoding."""
    outs = tiny_engine.generate(["Colours:"] * 6, {"json_schema": SET_OF_COLOURS, "temperature": temperature, "max_new_tokens": 40, "seed": 7})
    for out in outs:
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] in ("stop", "length"), reason
        jsonschema.validate(json.loads(out["text"]), SET_OF_COLOURS)
    tiny_engine.check_accounting()


def test_a_dead_end_in_the_engine_aborts_only_its_request_with_the_keyword_named(tiny_engine):
    impossible = {"type": "array", "items": {"enum": [1]}, "uniqueItems": True, "minItems": 2}
    dead, fine = tiny_engine.generate(["x", "y"], [{"json_schema": impossible, "max_new_tokens": 16}, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}])
    assert dead["meta_info"]["finish_reason"]["type"] == "abort"
    assert "uniqueItems" in dead["meta_info"]["finish_reason"]["message"]
    assert fine["meta_info"]["completion_tokens"] == 8
    tiny_engine.check_accounting()


def test_lookarounds_are_cut_out_of_a_pattern_leaving_a_superset():
    from radixlm.runtime.constrained.semantic import without_lookarounds

    assert without_lookarounds("^(?!ab)[a-z]+$") == "^[a-z]+$"
    assert without_lookarounds(r"^(?=.*[A-Z])(?=.*\d)[A-Za-z\d]{8,}$") == r"^[A-Za-z\d]{8,}$"
    assert without_lookarounds(r"^a[(?=]x$") == r"^a[(?=]x$"  # inside a class it is no lookaround
    assert without_lookarounds("(?!a") is None and without_lookarounds("a(?=b)*") is None
    assert relax({"type": "string", "pattern": "(?<=a"}).schema["pattern"] == "(?<=a"  # malformed: left for the backend to refuse


def test_a_ref_into_a_container_that_is_no_schema_keyword_is_relaxed_there_too(smol):
    """"#/ddd/npn" sits where relax does not walk: its target is relaxed in place, and checked."""
    schema = {"type": "object", "allOf": [{"$ref": "#/ddd/npn"}], "ddd": {"npn": {"not": {"required": ["a"]}, "propertyNames": {"maxLength": 2}}}}
    out = relax(schema)
    assert out.schema["ddd"]["npn"] == {} and schema["ddd"]["npn"]["propertyNames"] == {"maxLength": 2}
    grammar = smol[3].compile("json_schema", json.dumps(schema))
    assert _accepts(grammar, smol, '{"b":1}') and not _accepts(grammar, smol, '{"a":1}') and not _accepts(grammar, smol, '{"bcd":1}')


def test_patterns_that_overlap_across_all_of_are_checked_beside_the_grammar(smol):
    schema = {"type": "object", "allOf": [{"patternProperties": {"^.{1,3}$": False}}, {"patternProperties": {"a": True}, "additionalProperties": False}]}
    grammar = smol[3].compile("json_schema", json.dumps(schema))  # llguidance alone refuses it (not disjoint)
    assert grammar.checks is not None
    validator = jsonschema.Draft202012Validator(schema)
    for text in ['{"abcd":1}', '{"ab":1}', '{"bcde":1}', "{}"]:
        assert _accepts(grammar, smol, text) == validator.is_valid(json.loads(text)), text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("max_tokens", [16, 32, 64])
def test_openai_response_format_with_checked_keywords_always_parses_and_validates(tiny_server, temperature, max_tokens):
    """Over HTTP with the openai client: every choice is whole JSON valid under the schema,
    with the budget closer and the checker both acting on the same mask."""
    import openai

    client = openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="unused", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "colours", "schema": SET_OF_COLOURS}}
    res = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Colours?"}], response_format=fmt, max_tokens=max_tokens, temperature=temperature, n=3, seed=11)
    for choice in res.choices:
        assert choice.finish_reason in ("stop", "length"), choice
        jsonschema.validate(json.loads(choice.message.content), SET_OF_COLOURS)


def test_a_long_unique_list_still_refuses_a_duplicate_from_far_back(smol):
    """Past the items kept apart for cheap copies (``_Items.FOLD``), old items still count."""
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    grammar = smol[3].compile("json_schema", json.dumps(schema))
    items = list(range(100))
    assert _accepts(grammar, smol, json.dumps(items, separators=(",", ":")))
    tok, vocab, ends, _ = smol
    for again in (3, 97):  # refused at the item, not only when the list closes
        m = grammar.matcher()
        for t in tok.encode(json.dumps(items + [again], separators=(",", ":"))[:-1], add_special_tokens=False):
            assert m.accept(t)
        allowed = _allowed(m, vocab)
        for after in (",", "]"):
            assert not allowed[tok.encode(after, add_special_tokens=False)[0]], (again, after)


def test_a_catastrophic_pattern_is_cut_short_and_fails_its_request_not_the_engine(smol):
    """``^(a|aa)+$`` on a run of a's and a b backtracks for minutes; the checker's searches stop
    at REGEX_SECONDS, and the matcher (and every later one of this compiled schema) fails closed
    with the pattern named."""
    tok, vocab, ends, backend = smol
    schema = {"type": "string", "maxLength": 60, "not": {"pattern": "^(a|aa)+$"}}
    grammar = backend.compile("json_schema", json.dumps(schema))
    m = grammar.matcher()
    for t in tok.encode('"' + "a" * 40 + "b", add_special_tokens=False):
        if not _allowed(m, vocab).any():
            break
        assert m.accept(t)
    assert not _allowed(m, vocab).any()
    assert "took over" in m.error() and "(a|aa)" in m.error()
    assert not _allowed(grammar.matcher(), vocab).any() and "took over" in grammar.matcher().error()
