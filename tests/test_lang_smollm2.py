"""Programs on the embedded SmolLM2, where the answers must make sense (greedy, in-process)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

import radixlm as sgl

pytestmark = pytest.mark.slow


@sgl.function
def capital(s, country):
    s += "Q: What is the capital of Japan?\nA: Tokyo\n\nQ: What is the capital of Italy?\nA: Rome\n\n"
    s += "Q: What is the capital of " + country + "?\nA:" + sgl.gen("city", stop="\n", max_tokens=8)


def test_few_shot_questions_get_the_right_capitals(smollm2_backend):
    states = capital.run_batch([{"country": "France"}, {"country": "Germany"}], backend=smollm2_backend, temperature=0)
    assert "Paris" in states[0]["city"] and "Berlin" in states[1]["city"]


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection])
def test_select_picks_the_capital_among_choices_of_very_different_lengths(smollm2_backend, method):
    @sgl.function
    def pick(s):
        s += sgl.user("What is the capital of France?")
        choices = ["London", "a small village in the mountains of northern Italy", "Paris", "Antidisestablishmentarianism"]
        s += sgl.assistant("The capital of France is " + sgl.select("city", choices, choices_method=method))

    assert pick.run(backend=smollm2_backend)["city"] == "Paris"


class Person(BaseModel):
    name: str
    birth_year: int


def test_json_extraction_fills_the_pydantic_model(smollm2_backend):
    @sgl.function
    def extract(s, text):
        s += sgl.user("Extract the person's name and birth year as JSON.\n" + text)
        s += sgl.assistant(sgl.gen("person", json_schema=Person, max_tokens=40))

    state = extract.run(text="Ada Lovelace, the English mathematician, was born in 1815 in London.", backend=smollm2_backend, temperature=0)
    person = Person.model_validate_json(state["person"])
    assert "Ada" in person.name


def test_multi_turn_chat_keeps_the_conversation(smollm2_backend):
    @sgl.function
    def chat(s):
        s += sgl.user("My name is Ada. Please remember it.")
        s += sgl.assistant(sgl.gen("first", max_tokens=24))
        s += sgl.user("What is my name?")
        s += sgl.assistant(sgl.gen("second", max_tokens=16))

    state = chat.run(backend=smollm2_backend, temperature=0)
    assert state.messages()[0]["role"] == "system"  # SmolLM2's template adds its default system prompt
    assert "Ada" in state["second"]
    assert state.get_meta_info("second")["cached_tokens"] >= state.get_meta_info("first")["prompt_tokens"] - 1
