"""Tool calls (and JSON asked to close within budget) end whole before max_tokens: the JSON shape
the budget matcher follows, its narrowing of the mask, and calls over HTTP with tight budgets."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

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
    assert shape.done and shape.tight(0) is None


def test_a_string_closes_when_the_tokens_left_only_cover_the_closing():
    shape = _feed(JsonShape(), ["{", '"note"', ":", ' "abc'])
    assert [shape.tight(n) for n in (7, 6, 5, 1)] == [None, "string", "string", "string"]  # 2 to close, 3 for a UTF-8 tail, 1 spare
    _feed(shape, ['"'])
    assert shape.tight(6) == "level" and shape.tight(7) is None  # its one member took 4 tokens


def test_no_new_member_starts_when_one_as_long_as_the_longest_would_not_fit():
    shape = _feed(JsonShape(), ["[", "{", '"a"', ":", "1", "}"])  # one call of 5 tokens, then ',' or ']'
    assert shape.levels[0].after_member
    assert shape.tight(7) == "level" and shape.tight(8) is None  # 5 (another call) + 1 (']') + 1 spare
    _feed(shape, [","])
    assert shape.tight(1) is None, "once the next member has begun it must be written"


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
    assert _allowed(m) == {0, 4, 7}, "never a token the grammar refuses"
    narrow = BudgetMatcher(_Free(allowed={0, 2, 12}), vocab, budget=3)
    for t in (6, 1, 0, 1, 8, 1):
        narrow.accept(t)
    assert _allowed(narrow) == {12}, "in a string a bracket is content, not a close"


def test_close_json_within_budget_is_a_checked_sampling_parameter():
    assert SamplingParams.from_dict({"close_json_within_budget": True}).close_json_within_budget
    with pytest.raises(ValueError, match="close_json_within_budget"):
        SamplingParams.from_dict({"close_json_within_budget": "yes"}).validate()


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
