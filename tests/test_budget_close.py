"""Tool calls (and JSON asked to close within budget) end whole before max_tokens: the JSON shape
the budget matcher follows, its narrowing of the mask, and calls over HTTP with tight budgets."""

from __future__ import annotations

import json
import random
import time

import jsonschema
import numpy as np
import openai
import pytest
import torch
from pydantic import BaseModel, Field

import radixlm as sgl
from helpers import grammar_backends, tokenizer_parts
from radixlm.runtime.constrained import budget as budget_module
from radixlm.runtime.constrained.base import Matcher, bitmask_width, pack_bitmask, unpack_bitmask
from radixlm.runtime.constrained.budget import BudgetMatcher, CloseVocab, JsonShape
from radixlm.runtime.sampling_params import SamplingParams

TEXTS = ["a", '"', "}", "]", ",", ' "}', "{", "1", ":", "[", ' "]}', " ", '"}', " }]"]
CLOSE_STRING = {1, 12}  # a quote, then brackets only (a space after the quote would be content)
CLOSE_LEVEL = {2, 3, 13}


class _Free(Matcher):
    """A grammar that allows ``allowed`` (every token by default) and records what it took."""

    def __init__(self, allowed: set[int] | None = None) -> None:
        self.allowed = allowed
        self.taken: list[int] = []

    def accept(self, token: int) -> bool:
        self.taken.append(token)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = -1
        if self.allowed is not None:
            bits = torch.zeros(bitmask.shape[1] * 32, dtype=torch.bool)
            bits[sorted(self.allowed)] = True
            bitmask[row] = pack_bitmask(bits)

    def is_terminated(self) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        del self.taken[len(self.taken) - num_tokens :]

    def forced_text(self) -> str:
        return ""

    def copy(self) -> _Free:
        twin = _Free(self.allowed)
        twin.taken = list(self.taken)
        return twin


def _allowed(m: Matcher) -> set[int]:
    bitmask = torch.zeros((1, bitmask_width(len(TEXTS))), dtype=torch.int32)
    m.fill_bitmask(bitmask, 0)
    return {i for i, ok in enumerate(unpack_bitmask(bitmask, len(TEXTS))[0].tolist()) if ok}


def _feed(shape: JsonShape, pieces: list[str]) -> JsonShape:
    for p in pieces:
        shape.feed(p)
    return shape


def test_closing_tokens_end_a_string_with_a_quote_or_a_level_with_brackets():
    vocab = CloseVocab(TEXTS)
    for kind, want in (("string", CLOSE_STRING), ("level", CLOSE_LEVEL)):
        bits = unpack_bitmask(vocab.closing[kind][None], len(TEXTS))[0].tolist()
        assert {i for i, b in enumerate(bits) if b} == want, kind


def test_shape_follows_nesting_strings_escapes_and_member_lengths():
    shape = _feed(JsonShape(), ["[", '{"name"', ': "a', '\\"}', '"', ', "arguments"', ": {", '"x": 12', "}}"])
    assert len(shape.levels) == 1 and shape.levels[0].after_member, "the call list is open after a whole call"
    assert shape.levels[0].longest == 8, "the call took the 8 tokens after '['"
    assert not shape.in_string and not shape.done
    _feed(shape, [",", " {", '"name": "b', "ab"])
    assert shape.in_string and not shape.string_is_key and len(shape.levels) == 2
    _feed(shape, ['"}]'])
    assert shape.done and not shape.tight(0)


def test_a_string_closes_when_the_tokens_left_only_cover_the_closing():
    shape = _feed(JsonShape(), ["{", '"note"', ":", ' "abc'])
    assert [shape.tight(n) for n in (7, 6, 5, 1)] == [False, True, True, True]  # 2 to close, 3 for a UTF-8 tail, 1 spare
    assert shape.tight(9, need=5) and not shape.tight(10, need=5), "what the document still needs counts, not only the open levels"
    _feed(shape, ['"'])
    assert shape.tight(6) and not shape.tight(7)  # its one member took 4 tokens


def test_no_new_member_starts_when_one_as_long_as_the_longest_would_not_fit():
    shape = _feed(JsonShape(), ["[", "{", '"a"', ":", "1", "}"])  # one call of 5 tokens, then ',' or ']'
    assert shape.levels[0].after_member
    assert shape.tight(7) and not shape.tight(8)  # 5 (another call) + 1 (']') + 1 spare
    _feed(shape, [","])
    assert shape.tight(3) and not shape.tight(4), "once the next member has begun, only its shortest form fits (1 + 2 spare)"


def test_budget_matcher_narrows_to_allowed_closers_only_when_tight():
    vocab = CloseVocab(TEXTS)
    m = BudgetMatcher(_Free(), vocab, budget=11)
    for t in (6, 1, 0):  # '{', '"', 'a': inside a key
        assert m.accept(t)
    assert _allowed(m) == set(range(len(TEXTS))), "inside a key nothing can close"
    for t in (1, 8, 1):  # '"' ends the key, ':', '"' opens the value: 5 tokens left
        m.accept(t)
    assert m.shape.in_string and not m.shape.string_is_key
    assert _allowed(m) == CLOSE_STRING
    twin = m.copy()
    m.rollback(1)  # back before the value's quote: no string open, a value must start
    assert _allowed(m) == set(range(len(TEXTS))) and _allowed(twin) == CLOSE_STRING
    twin.accept(1)
    assert _allowed(twin) == CLOSE_LEVEL


def test_budget_matcher_keeps_the_grammar_mask_when_it_allows_no_closer():
    vocab = CloseVocab(TEXTS)
    m = BudgetMatcher(_Free(allowed={0, 4, 7}), vocab, budget=3)
    for t in (6, 1, 0, 1, 8, 1):
        m.accept(t)
    assert m.shape.tight(0)
    assert _allowed(m) == {0, 4, 7}, "never a token the grammar refuses (and no way out to follow)"
    narrow = BudgetMatcher(_Free(allowed={0, 2, 12}), vocab, budget=3)
    for t in (6, 1, 0, 1, 8, 1):
        narrow.accept(t)
    assert _allowed(narrow) == {12}, "in a string a bracket is content, not a close; past the budget, the one way out"


def test_the_walk_out_stops_at_its_time_bound_on_a_slow_grammar():
    class Slow(_Free):
        def fill_bitmask(self, bitmask, row):
            time.sleep(0.01)
            super().fill_bitmask(bitmask, row)

        def copy(self):
            return Slow(self.allowed)

    m = BudgetMatcher(Slow(allowed={0}), CloseVocab(TEXTS), budget=200)  # 'a' forever: no way out
    start = time.perf_counter()
    assert m.need() == 200 + budget_module.SLACK and not m._way_out
    assert time.perf_counter() - start < 1.0, "the walk gave up after WALK_SECONDS, not after 208 masks of 10 ms"


def test_close_json_within_budget_is_a_checked_sampling_parameter():
    assert SamplingParams.from_dict({"close_json_within_budget": True}).close_json_within_budget
    with pytest.raises(ValueError, match="close_json_within_budget"):
        SamplingParams.from_dict({"close_json_within_budget": "yes"}).validate()


def test_close_json_within_budget_is_on_by_default_for_json_schemas_only():
    def closes(**params) -> bool:
        p = SamplingParams.from_dict(params)
        p.validate()
        return p.closes_json_within_budget

    assert closes(json_schema="{}") and not closes(json_schema="{}", close_json_within_budget=False)
    assert not closes(regex="[a-z]+") and not closes() and closes(regex="x", close_json_within_budget=True)
    assert not closes(json_schema="{}", beam_width=2), "beams end on the grammar's end or the budget"
    with pytest.raises(ValueError, match="close_json_within_budget"):
        closes(json_schema="{}", beam_width=2, close_json_within_budget=True)


# ------------------------------------------------- real grammars, a random "model"
class City(BaseModel):
    name: str
    country: str
    population: int = Field(ge=0)


NOTES = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "pages": {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "integer"}, "text": {"type": "string"}}, "required": ["n", "text"]}},
    },
    "required": ["title", "tags", "pages"],
}
MATRIX = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}, "minItems": 2}
SCHEMAS = {"city": City.model_json_schema(), "notes": NOTES, "matrix": MATRIX}


@pytest.fixture(scope="module")
def smol(smollm2_path):
    tok, vocab, ends = tokenizer_parts(smollm2_path)
    return tok, vocab, ends, grammar_backends(tok, vocab, ends), CloseVocab.from_tokenizer(tok, vocab)


def _random_output(smol, backend: str, schema: dict, budget: int, seed: int, close: bool) -> tuple[str, BudgetMatcher | None]:
    """A uniformly random pick among the allowed tokens at every step (the worst model), for at
    most ``budget`` tokens: the text, and the budget matcher when ``close``."""
    tok, vocab, ends, backends, close_vocab = smol
    m = backends[backend].compile("json_schema", json.dumps(schema)).matcher()
    if close:
        m = BudgetMatcher(m, close_vocab, budget)
    rng = random.Random(seed)
    row = torch.zeros(1, bitmask_width(vocab), dtype=torch.int32)
    out: list[int] = []
    while len(out) < budget and not m.is_terminated():
        m.fill_bitmask(row, 0)
        allowed = np.flatnonzero(np.unpackbits(row[0].numpy().view(np.uint8), bitorder="little")[:vocab])
        token = int(allowed[rng.randrange(len(allowed))])
        if token in ends:
            break
        assert m.accept(token)
        out.append(token)
    return tok.decode(out), m if close else None


@pytest.mark.parametrize(("backend", "name"), [("llguidance", "city"), ("llguidance", "notes"), ("llguidance", "matrix"), ("outlines", "notes"), ("outlines", "matrix")])  # outlines: no 'minimum'
def test_random_output_closes_as_valid_json_at_every_budget(smol, name, backend):
    cut_short = 0
    for budget in (16 if (backend, name) != ("outlines", "notes") else 20, 24, 32, 48, 80):  # outlines' shortest Notes: 17 tokens
        for seed in range(4):
            text, m = _random_output(smol, backend, SCHEMAS[name], budget, seed, close=True)
            jsonschema.validate(json.loads(text), SCHEMAS[name])
            cut_short += m.cut_short()
    assert cut_short, "a random model never ends by itself: the closer had to act"


def _valid(text: str | None, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text or ""), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def test_without_the_closer_random_output_is_cut_mid_json(smol):
    texts = [_random_output(smol, "llguidance", SCHEMAS["city"], 24, seed, close=False)[0] for seed in range(3)]
    assert not any(_valid(t, SCHEMAS["city"]) for t in texts)


def test_tokens_that_end_a_member_and_start_another_are_known_by_their_comma():
    from radixlm.runtime.constrained.budget import _starts_member

    assert _starts_member('"},', in_string=True) and _starts_member('",', in_string=True)
    assert not _starts_member("a,b", in_string=True), "a comma inside the string is content"
    assert _starts_member(',"', in_string=False) and _starts_member("5,", in_string=False)
    assert not _starts_member('"a,b"', in_string=False) and not _starts_member('\\",', in_string=True), "an escaped quote does not end the string"


def test_a_member_with_no_room_for_another_goes_on_but_no_token_may_start_the_next(smol):
    tok, vocab, ends, backends, close_vocab = smol
    schema = {"type": "array", "items": {"type": "string"}}
    ids = tok.encode('["one two three four five six","x', add_special_tokens=False)
    probe = BudgetMatcher(backends["llguidance"].compile("json_schema", json.dumps(schema)).matcher(), close_vocab, 1000)
    for t in ids:
        assert probe.accept(t)
    longest, need = probe.shape.levels[-1].longest, probe.need()
    assert longest > 6 and need <= 2
    m = BudgetMatcher(backends["llguidance"].compile("json_schema", json.dumps(schema)).matcher(), close_vocab, len(ids) + longest + need + 1)
    for t in ids:
        m.accept(t)
    row = torch.zeros(1, bitmask_width(vocab), dtype=torch.int32)
    m.fill_bitmask(row, 0)
    allowed = set(np.flatnonzero(np.unpackbits(row[0].numpy().view(np.uint8), bitorder="little")[:vocab]).tolist())
    comma, word = tok.encode('","', add_special_tokens=False), tok.encode(" seven", add_special_tokens=False)
    assert len(comma) == 1 and comma[0] not in allowed, "the string may not end with the next member's start"
    assert set(word) <= allowed and tok.encode('"]', add_special_tokens=False)[0] in allowed, "it may go on or close"


def test_the_way_out_counts_the_required_properties_still_missing(smol):
    tok, vocab, ends, backends, close_vocab = smol
    m = BudgetMatcher(backends["llguidance"].compile("json_schema", json.dumps(NOTES)).matcher(), close_vocab, 1000)
    for t in tok.encode('{"title":"a', add_special_tokens=False):
        assert m.accept(t)
    assert m.shape.open_count() == 2
    assert m.need() >= len(tok.encode('", "tags": [], "pages": []}', add_special_tokens=False)) - 2, "tags and pages are still to come"
    assert not m.mask_needed(), "far from the end nothing narrows"


# ------------------------------------------------------------- over HTTP
NOTE = {
    "type": "function",
    "function": {
        "name": "save_note",
        "parameters": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 300}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 40}}}, "required": ["title"]},
    },
}
ASK = [{"role": "user", "content": "Save a note about the meeting."}]


@pytest.fixture(scope="module")
def oai(tiny_server):
    return openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("budget", [24, 40])
def test_a_named_call_with_long_strings_closes_within_a_tight_budget(oai, budget):
    res = oai.chat.completions.create(model="tiny", messages=ASK, tools=[NOTE], tool_choice={"type": "function", "function": {"name": "save_note"}}, n=8, temperature=1.0, seed=3, max_tokens=budget)
    for choice in res.choices:
        assert choice.finish_reason == "tool_calls", "the random model never closes a 300-character string by itself"
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), NOTE["function"]["parameters"])
        assert res.usage.completion_tokens <= budget * len(res.choices)


def test_required_calls_close_the_list_instead_of_starting_a_call_that_cannot_fit(oai):
    res = oai.chat.completions.create(model="tiny", messages=ASK, tools=[NOTE], tool_choice="required", n=8, temperature=1.0, seed=5, max_tokens=48)
    for choice in res.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), NOTE["function"]["parameters"])


def test_a_budget_too_small_for_any_call_still_ends_with_length_and_no_call(oai):
    res = oai.chat.completions.create(model="tiny", messages=ASK, tools=[NOTE], tool_choice="required", n=4, temperature=1.0, seed=5, max_tokens=4)
    for choice in res.choices:
        assert choice.finish_reason == "length" and not choice.message.tool_calls and not choice.message.content


class Page(BaseModel):
    n: int
    text: str


class Notes(BaseModel):
    title: str
    tags: list[str]
    pages: list[Page]


CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "City", "schema": City.model_json_schema()}}
ASK_CITY = [{"role": "user", "content": "Describe a big city as JSON."}]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("budget", [32, 48, 80])  # the tiny model's small vocabulary: the shortest City takes 28 tokens, Notes 24
@pytest.mark.parametrize("model", [City, Notes], ids=lambda m: m.__name__)
def test_a_response_format_answer_is_valid_json_at_any_budget(oai, model, budget, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": model.__name__, "schema": model.model_json_schema()}}
    res = oai.chat.completions.create(model="tiny", messages=ASK_CITY, response_format=fmt, n=4, temperature=temperature, seed=11, max_tokens=budget)
    for choice in res.choices:
        model.model_validate_json(choice.message.content)
        assert choice.finish_reason in ("stop", "length")
    assert res.usage.completion_tokens <= budget * len(res.choices)


def test_a_shortened_answer_says_length_and_the_closer_can_be_turned_off(oai, tiny_client):
    body = {"text": "A city: ", "sampling_params": {"max_new_tokens": 40, "temperature": 1.0, "seed": 2, "json_schema": json.dumps(SCHEMAS["city"])}}
    out = tiny_client.post("/generate", json=body).json()
    City.model_validate_json(out["text"])
    assert out["meta_info"]["finish_reason"] == {"type": "length", "matched": None, "closed_within_budget": True}, "the random model never ends a string by itself"
    res = oai.chat.completions.create(model="tiny", messages=ASK_CITY, response_format=CITY_FORMAT, n=4, temperature=1.0, seed=11, max_tokens=40, extra_body={"close_json_within_budget": False})
    assert [c.finish_reason for c in res.choices] == ["length"] * 4
    assert not any(_valid(c.message.content, SCHEMAS["city"]) for c in res.choices), "without the closer the answer is cut mid-JSON"


def test_a_program_gen_with_a_json_schema_closes_within_its_max_tokens(lang_backend):
    @sgl.function
    def describe(s, which):
        s += f"City number {which}: " + sgl.gen("city", json_schema=City, max_tokens=40, temperature=1.0)

    for which in range(2):
        state = describe.run(which=which, backend=lang_backend)
        assert state.error() is None
        City.model_validate_json(state["city"])
