"""Bug 16 and fail-closed matchers: constraints that cannot produce anything are refused at
compile time (GrammarError, a 400), and a matcher's per-step methods never raise."""

from __future__ import annotations

import json
import re

import pytest
import torch

from helpers import grammar_backends, tokenizer_parts
from radixlm.runtime.constrained.base import GrammarError, bitmask_width
from radixlm.runtime.constrained.specs import MAX_REGEX_SIZE, regex_size

BACKENDS = ["llguidance", "outlines"]


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_llama):
    return tokenizer_parts(tiny_llama)


@pytest.fixture(scope="module")
def backends(tiny_tokenizer):
    built = grammar_backends(*tiny_tokenizer)
    yield built
    built["outlines"].close()


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
REQUIRED_SELF = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}}, "$ref": "#/$defs/n"}


def test_regex_size_multiplies_nested_repetitions():
    assert regex_size("a{1000000}") == 1_000_000
    assert regex_size("(a{1000}){3000}") == 3_000_000
    assert regex_size(r"\d{4}-\d{2}") == 7
    assert regex_size("(ab|c){3}") == 9


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(
    "kind, spec, message",
    [
        ("regex", "a{1000000}", re.escape(f"over the limit of {MAX_REGEX_SIZE:,} (MAX_REGEX_SIZE)")),
        ("regex", "(x{1000}){3000}", "MAX_REGEX_SIZE"),
        ("json_schema", '{"$ref": "#"}', "no finite instance"),
        ("json_schema", json.dumps(CYCLE), "no finite instance"),
        ("json_schema", json.dumps(REQUIRED_SELF), r"no finite instance.*#/\$defs/n"),
        ("regex", "[^\\x00-\\U0010FFFF]", "can produce no output|incompatible with the regex"),
    ],
    ids=["huge-repeat", "nested-repeat", "ref-root", "defs-cycle", "required-self", "empty-class"],
)
def test_constraints_that_cannot_produce_anything_are_refused_at_compile_time(name, kind, spec, message, backends):
    with pytest.raises(GrammarError, match=message):
        backends[name].compile(kind, spec)


@pytest.mark.parametrize("gbnf", ["root ::= root", "root ::= item\nitem ::= root"])
def test_ebnf_rules_that_only_refer_to_themselves_are_refused(gbnf, backends):
    with pytest.raises(GrammarError, match="can produce no output"):
        backends["llguidance"].compile("ebnf", gbnf)


@pytest.mark.parametrize("name", ["llguidance"])  # outlines refuses recursion past depth 3 anyway
def test_recursive_schemas_with_a_way_out_still_compile(name, backends):
    optional = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}
    backends[name].compile("json_schema", json.dumps(optional))
    either = {"$defs": {"t": {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#/$defs/t"}, "minItems": 1}]}}, "$ref": "#/$defs/t"}
    backends[name].compile("json_schema", json.dumps(either))


def _raising(*args, **kwargs):
    raise RuntimeError("library fault")


class _Broken:
    """Stands in for the library object: every method raises."""

    def __getattr__(self, name):
        return _raising


@pytest.mark.parametrize("name", BACKENDS)
def test_matcher_step_methods_never_raise_and_fail_closed(name, backends, tiny_tokenizer):
    _, vocab, _ = tiny_tokenizer
    m = backends[name].compile("regex", "(ab|cd)e").matcher()
    if name == "llguidance":
        m._m = _Broken()
    else:
        m._guide = _Broken()
    bitmask = torch.full((1, bitmask_width(vocab)), -1, dtype=torch.int32)
    m.fill_bitmask(bitmask, 0)
    assert not bool(bitmask.any())  # nothing allowed once the library failed
    assert m.accept(5) is False
    assert m.forced_text() == ""
    assert m.is_terminated() is False
    m.rollback(1)
    assert "library fault" in m.error()


@pytest.mark.parametrize("name", BACKENDS)
def test_rolling_back_past_the_history_becomes_an_error_not_an_exception(name, backends, tiny_tokenizer):
    tok, vocab, _ = tiny_tokenizer
    m = backends[name].compile("regex", "[a-z]{1,200}").matcher()
    for t in tok.encode("abc", add_special_tokens=False):
        assert m.accept(t)
    m.rollback(500)
    assert m.error() is not None
    bitmask = torch.full((1, bitmask_width(vocab)), -1, dtype=torch.int32)
    m.fill_bitmask(bitmask, 0)
    assert not bool(bitmask.any())
    assert m.accept(tok.encode("a", add_special_tokens=False)[0]) is False


@pytest.mark.parametrize("name", BACKENDS)
def test_out_of_vocabulary_tokens_are_refused_without_raising(name, backends, tiny_tokenizer):
    _, vocab, _ = tiny_tokenizer
    m = backends[name].compile("regex", "[a-z]+").matcher()
    assert m.accept(vocab + 1000) is False
    assert m.accept(-1) is False
