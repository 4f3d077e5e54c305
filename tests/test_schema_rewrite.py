"""Schema rewrites (format, oneOf, dependencies, not, min/maxProperties) keep the valid instances
exactly (property tests, both ways, with jsonschema), the backends enforce the rewritten forms,
and strict generation closes only standalone object schemas."""

from __future__ import annotations

import base64
import binascii
import copy
import ipaddress
import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import accepts_text, grammar_backends, tokenizer_parts
from radixlm.runtime.constrained.base import GrammarError
from radixlm.runtime.constrained.llguidance_backend import FORMATS as LLG_FORMATS
from radixlm.runtime.constrained.schema_rewrite import FORMAT_PATTERNS, rewrite_schema
from radixlm.runtime.constrained.schema_strict import close_objects

KEYS = ["a", "b", "c", "kind", "x", "zz"]
SCALARS = st.sampled_from([None, True, False, 0, 1, 1.5, -3, "", "a", "b", "x", "z", "QQ=="])
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=4), max_leaves=8)

DEPENDENCY_SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}}, "dependentRequired": {"a": ["b"]}},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "dependentRequired": {"a": ["b"], "b": ["a"]}, "additionalProperties": False},
    {"properties": {"a": {}, "c": {}}, "dependentSchemas": {"a": {"properties": {"c": {"const": True}}, "required": ["c"]}}},
]
DRAFT7_SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}, "x": {}}, "dependencies": {"a": ["b", "x"], "b": {"required": ["x"]}}},
]
NOT_SCHEMAS = [
    {"type": "object", "properties": {"a": {}, "b": {}}, "not": {"required": ["a", "b"]}},
    {"not": {"required": ["a"]}},
    {"not": {"required": []}},
    {"not": {"type": ["string", "null"]}},
    {"not": {"type": "number"}},
    {"not": {"const": None}},
    {"not": {"enum": [True, None]}},
    {"enum": ["a", "b", "x", 1], "not": {"enum": ["b", 1.0]}},
    {"type": "boolean", "not": {"const": True}},
    {"type": ["boolean", "null"], "not": {"enum": [False]}},
]
ONE_OF_EXCLUSIVE = [
    {"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
    {"oneOf": [{"enum": ["x", "a"]}, {"enum": ["z", 1]}]},
    {
        "oneOf": [
            {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["kind"]},
            {"type": "object", "properties": {"kind": {"const": "b"}, "x": {"type": "string"}}, "required": ["kind"]},
        ]
    },
    {  # pydantic's discriminated union: branches behind $ref
        "$defs": {
            "A": {"type": "object", "properties": {"kind": {"enum": ["a"]}, "a": {"type": "integer"}}, "required": ["kind", "a"]},
            "B": {"type": "object", "properties": {"kind": {"enum": ["b"]}, "b": {"type": "string"}}, "required": ["kind", "b"]},
        },
        "oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}],
    },
    {
        "oneOf": [
            {"type": "object", "properties": {"a": {}}, "required": ["a"], "additionalProperties": False},
            {"type": "object", "properties": {"b": {}}, "required": ["b"], "additionalProperties": False},
        ]
    },
]
ONE_OF_EXCLUSIVE += [  # exclusive only given the type and required keys of the schema around them
    {"type": "object", "oneOf": [{"properties": {"a": {}, "x": {}}, "required": ["a", "x"], "additionalProperties": False}, {"properties": {"b": {}}, "required": ["b"], "additionalProperties": False}]},
    {"type": "object", "required": ["kind"], "oneOf": [{"properties": {"kind": {"enum": ["a"]}}}, {"properties": {"kind": {"enum": ["b", "x"]}}}]},
    {"oneOf": [{"oneOf": [{"enum": ["a"]}, {"enum": ["b"]}]}, {"enum": ["x", 1]}]},  # the inner oneOf, rewritten first
]
ONE_OF_OVERLAPPING = [
    {"type": "object", "oneOf": [{"properties": {"kind": {"enum": ["a"]}}}, {"properties": {"kind": {"enum": ["b"]}}}]},  # {} is in both
    {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]},
    {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    {"oneOf": [{"type": "object", "properties": {"a": {}}, "required": ["a"]}, {"type": "object", "properties": {"b": {}}, "required": ["b"]}]},
    {"oneOf": [{"required": ["a"], "additionalProperties": False, "properties": {"a": {}}}, {"properties": {"b": {}}, "required": ["b"], "additionalProperties": False}]},
]
COUNT_SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}}, "required": ["a"], "additionalProperties": False, "minProperties": 2},
    {"type": "object", "properties": {"a": {}, "b": {}, "c": {}, "x": {}}, "additionalProperties": False, "minProperties": 1, "maxProperties": 2},
    {"properties": {"a": {}, "b": {}}, "additionalProperties": False, "maxProperties": 1},
    {"type": "object", "properties": {"a": {}, "b": {}}, "additionalProperties": False, "minProperties": 0, "maxProperties": 5},
]
EQUIVALENT = DEPENDENCY_SCHEMAS + NOT_SCHEMAS + ONE_OF_EXCLUSIVE + COUNT_SCHEMAS
CANDIDATES = [{"kind": "a", "a": 1}, {"kind": "b", "b": "x"}, {}, {"a": 1}, {"a": 1, "b": "x"}, {"b": "x"}, {"a": 1, "b": "x", "c": True}, {"a": 1, "c": 3}, {"a": 1, "b": 2}, {"kind": "a", "x": 1}, {"kind": "b", "x": "s"}, {"kind": "a", "x": "s"}, {"c": True}, {"a": None, "c": True}, "x", 5, None, True, False, [1]]
PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def _validator(schema, draft7: bool = False):
    cls = jsonschema.Draft7Validator if draft7 else jsonschema.Draft202012Validator
    return cls(schema)


def _rewritten(schema):
    out = rewrite_schema(schema, LLG_FORMATS).schema
    _validator(out).check_schema(out)
    return out


def _assert_same_verdicts(schema, draft7: bool = False):
    """Random instances (and the hand-picked CANDIDATES) get one verdict from both schemas,
    and both verdicts occur: valid under the original means valid under the rewrite and back."""
    before, after = _validator(schema, draft7), _validator(_rewritten(schema), draft7)
    seen: set[bool] = set()

    @PROPERTY_SETTINGS
    @given(JSON)
    def agree(instance):
        seen.add(before.is_valid(instance))
        assert before.is_valid(instance) == after.is_valid(instance), instance

    agree()
    for instance in CANDIDATES:
        seen.add(before.is_valid(instance))
        assert before.is_valid(instance) == after.is_valid(instance), instance
    assert seen == {True, False} or schema in ({"not": {"required": []}},), f"only {seen} instances were tried"


@pytest.mark.parametrize("schema", EQUIVALENT, ids=lambda s: json.dumps(s)[:60])
def test_each_rewrite_keeps_exactly_the_valid_instances(schema):
    _assert_same_verdicts(schema)


@pytest.mark.parametrize("schema", DRAFT7_SCHEMAS, ids=lambda s: json.dumps(s)[:60])
def test_draft7_dependencies_rewrite_keeps_exactly_the_valid_instances(schema):
    _assert_same_verdicts(schema, draft7=True)


def test_the_rewrites_use_no_keyword_they_replace():
    for schema in EQUIVALENT:
        text = json.dumps(_rewritten(schema))
        for keyword in ("dependentRequired", "dependentSchemas", "dependencies", "oneOf", "minProperties", "maxProperties", '"not"'):
            assert keyword not in text, (keyword, schema)


@pytest.mark.parametrize("schema", ONE_OF_OVERLAPPING, ids=lambda s: json.dumps(s)[:60])
def test_one_of_with_branches_that_may_overlap_is_left_as_it_is(schema):
    """Not rewritten to anyOf (that would accept an instance both branches take): the
    semantic checker enforces it (tests/test_semantic_checks.py)."""
    assert rewrite_schema(schema, LLG_FORMATS).schema == schema


def test_what_cannot_be_rewritten_is_left_for_the_backend_to_refuse():
    kept = [
        {"type": "string", "not": {"const": "x"}},
        {"not": {"type": "integer"}},  # "not an integer" includes 1.5
        {"type": "object", "properties": {"a": {}}, "minProperties": 1},  # open: infinitely many key sets
        {"type": "object", "properties": {k: {} for k in "abcdefghij"}, "additionalProperties": False, "minProperties": 5},  # 638 key sets
    ]
    for schema in kept:
        assert rewrite_schema(schema, LLG_FORMATS).schema == schema


# ------------------------------------------------------------------ formats
def test_unknown_formats_are_dropped_with_a_warning_and_known_ones_kept():
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": "semver"}, "d": {"type": "string", "format": "date"}, "u": {"type": "string", "format": "url"}}}
    out = rewrite_schema(schema, LLG_FORMATS)
    props = out.schema["properties"]
    assert "format" not in props["v"] and props["d"]["format"] == "date" and props["u"]["format"] == "uri"
    assert out.warnings == ["format 'semver' at /properties/v is not enforced: the grammar backend does not know it"]
    assert schema["properties"]["v"]["format"] == "semver", "the caller's schema is not modified"


def test_integer_formats_become_exact_bounds():
    out = rewrite_schema({"type": "integer", "format": "int32", "minimum": 0}, LLG_FORMATS)
    assert out.schema == {"type": "integer", "minimum": 0, "maximum": 2**31 - 1} and not out.warnings


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=12) | st.text(alphabet="AQZaz09+/=-_ ", max_size=10))
def test_the_byte_pattern_matches_exactly_base64(value):
    if isinstance(value, bytes):
        assert re.search(FORMAT_PATTERNS["byte"], base64.b64encode(value).decode())
        return
    try:
        ok = len(value) % 4 == 0 and base64.b64decode(value, validate=True) is not None
    except (binascii.Error, ValueError):
        ok = False
    assert bool(re.search(FORMAT_PATTERNS["byte"], value)) == ok, value


@settings(max_examples=300, deadline=None)
@given(st.ip_addresses(v=4).map(str) | st.text(alphabet="0123456789.", max_size=16))
def test_the_ipv4_pattern_matches_exactly_what_ipaddress_accepts(value):
    try:
        ipaddress.IPv4Address(value)
        ok = True
    except ValueError:
        ok = False
    assert bool(re.search(FORMAT_PATTERNS["ipv4"], value)) == ok, value


# ------------------------------------------------------------------ strictness
def test_close_objects_closes_standalone_objects_and_pydantic_refs():
    schema = {
        "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        "type": "object",
        "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/Place"}, "work": {"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}]}, "meta": {"type": "object"}},
    }
    out = close_objects(schema)
    assert out["additionalProperties"] is False and out["$defs"]["Place"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["meta"], "a free-form object (no properties) stays free"
    assert "additionalProperties" not in schema, "the caller's schema is not modified"


def test_close_objects_leaves_combined_and_explicitly_open_schemas_open():
    combined = {
        "$defs": {"Base": {"properties": {"id": {"type": "integer"}}}},
        "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"extra": {"type": "string"}}}],
        "properties": {"id": {}, "extra": {}},
    }
    out = close_objects(combined)
    assert "additionalProperties" not in out["$defs"]["Base"] and "additionalProperties" not in out["allOf"][1]
    assert "additionalProperties" not in out, "a schema with allOf is combined with its members"
    with_branches = {"type": "object", "properties": {"kind": {}}, "anyOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert close_objects(with_branches) == with_branches
    open_one = {"type": "object", "properties": {"a": {}}, "additionalProperties": True}
    assert close_objects(open_one) == open_one
    needs_undeclared = {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}
    assert close_objects(needs_undeclared) == needs_undeclared


@PROPERTY_SETTINGS
@given(JSON)
def test_closed_schemas_accept_a_subset_of_the_original(instance):
    for schema in DEPENDENCY_SCHEMAS + ONE_OF_EXCLUSIVE + [{"type": "object", "properties": {"a": {"type": "object", "properties": {"x": {}}}}}]:
        if _validator(close_objects(schema)).is_valid(instance):
            assert _validator(schema).is_valid(instance), (schema, instance)


# ------------------------------------------------------------------ backends
@pytest.fixture(scope="module")
def llg(smollm2_path):
    tok, vocab, ends = tokenizer_parts(smollm2_path)
    return grammar_backends(tok, vocab, ends)["llguidance"], tok, vocab, ends




@pytest.mark.parametrize("schema", [s for s in EQUIVALENT if s != {"not": {"required": []}}], ids=lambda s: json.dumps(s)[:60])
def test_llguidance_enforces_each_rewritten_schema_exactly(llg, schema):
    backend, tok, vocab, ends = llg
    validator = _validator(schema)
    declared = list(schema.get("properties", {}))
    for instance in CANDIDATES:
        if isinstance(instance, dict):  # llguidance takes declared properties in order, then the rest
            instance = dict(sorted(instance.items(), key=lambda kv: declared.index(kv[0]) if kv[0] in declared else len(declared)))
        text = json.dumps(instance, separators=(",", ":"))
        assert accepts_text(backend, tok, vocab, ends, "json_schema", json.dumps(schema), text) == validator.is_valid(instance), (schema, instance)


def test_llguidance_reports_an_ignored_format_in_the_compiled_grammar(llg):
    backend, *_ = llg
    assert backend.compile("json_schema", json.dumps({"type": "string", "format": "uri-template"})).warnings == (
        "format 'uri-template' at / is not enforced: the grammar backend does not know it",
    )
    assert backend.compile("json_schema", json.dumps(ONE_OF_OVERLAPPING[0])).checks is not None  # enforced beside the grammar
    with pytest.raises(GrammarError):  # "not: {required: []}" admits nothing at all
        backend.compile("json_schema", json.dumps({"not": {"required": []}}))


def test_hostile_schemas_are_refused_or_left_alone():
    malformed = {"dependencies": [1], "dependentRequired": {"a": "b"}}
    assert rewrite_schema(malformed, LLG_FORMATS).schema == malformed, "not the schema form: left for the backend to refuse"
    with pytest.raises(GrammarError, match="has 300 branches"):
        rewrite_schema({"oneOf": [{"const": i} for i in range(300)]}, LLG_FORMATS)
    nested: dict = {"type": "string"}
    for _ in range(6):  # an allOf tree 6 deep and 4 wide (4,096 schemas): the check looks at a few
        nested = {"allOf": [copy.deepcopy(nested) for _ in range(4)]}
    branches = [{"type": "integer", **nested}, {"type": "string"}] + [{"const": [i]} for i in range(200)]
    assert rewrite_schema({"oneOf": branches}, LLG_FORMATS).schema["anyOf"][1] == {"type": "string"}


def test_rewrite_lark_rewrites_each_json_lexeme_and_collects_its_warnings():
    from radixlm.runtime.constrained.schema_rewrite import rewrite_lark

    one = {"oneOf": [{"type": "integer"}, {"type": "string"}]}
    fmt = {"type": "string", "format": "semver"}
    grammar = f'start: a | b\na: "x" %json {json.dumps(one)}\nb: %json{json.dumps(fmt)}\nc: "%json {{not json"'
    out, warnings = rewrite_lark(grammar, frozenset())
    assert '%json {"anyOf": [{"type": "integer"}, {"type": "string"}]}' in out
    assert '"format"' not in out and out.endswith('c: "%json {not json"')
    assert warnings == ["format 'semver' at / is not enforced: the grammar backend does not know it"]
    assert rewrite_lark("start: /a+/", frozenset()) == ("start: /a+/", [])
