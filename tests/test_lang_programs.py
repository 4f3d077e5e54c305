"""Prompt programs end to end, each run in-process (EngineBackend) and over HTTP (RuntimeEndpoint).

The tiny random-weight Llama stands behind both: these tests check what the language guarantees
(prompt assembly, chat rendering, constraints, scoring, concurrency, caching, errors), not what
the model says.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from typing import Annotated, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

import radixlm as sgl
from radixlm.lang.choices import choice_spans
from radixlm.lang.tools import calls_schema

SHOTS = "".join(f"Question: what is {a} plus {a}? Answer: {2 * a}.\n" for a in range(1, 9))


def _tokens(backend, text: str) -> int:
    return len(backend.tokenize([text])[0])


def _flush(backend) -> None:
    """Empty the radix cache (a request an earlier test abandoned may still be finishing)."""
    deadline = time.monotonic() + 30
    while not backend.flush_cache():
        assert time.monotonic() < deadline, "the cache could not be flushed"
        time.sleep(0.1)


# ---------------------------------------------------------------------------- basics
@sgl.function
def few_shot_qa(s, question):
    s += SHOTS
    s += "Question: " + question + " Answer:" + sgl.gen("answer", max_tokens=6, stop="\n")


def test_few_shot_qa_sends_exactly_the_program_text(lang_backend):
    state = few_shot_qa.run(question="what is 9 plus 9?", backend=lang_backend, temperature=0)
    prompt = SHOTS + "Question: what is 9 plus 9? Answer:"
    direct = lang_backend.generate(prompt, {"max_new_tokens": 6, "stop": ["\n"], "temperature": 0})
    assert state["answer"] == direct["text"]  # the same request the program made
    assert state.text() == prompt + state["answer"]
    assert state.get_meta_info("answer")["prompt_tokens"] == _tokens(lang_backend, prompt)
    assert state.error() is None


@sgl.function
def chat(s, questions):
    s += sgl.system("You are terse.")
    for i, q in enumerate(questions):
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen(f"reply{i}", max_tokens=5))


@sgl.function
def chat_blocks(s, questions):
    s += sgl.system_begin() + "You are terse." + sgl.system_end()
    for i, q in enumerate(questions):
        with s.user():
            s += q
        s += sgl.assistant_begin()
        s += sgl.gen(f"reply{i}", max_tokens=5)
        s += sgl.assistant_end()


def test_multi_turn_chat_renders_like_the_chat_template(lang_backend):
    questions = ["Hi there.", "What is a radix tree?", "Thanks!"]
    state = chat.run(questions=questions, backend=lang_backend, temperature=0)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * 3
    assert [m["content"] for m in messages[2::2]] == [state[f"reply{i}"] for i in range(3)]
    assert state.text() == lang_backend.apply_chat_template(messages, add_generation_prompt=False)
    blocks = chat_blocks.run(questions=questions, backend=lang_backend, temperature=0)
    assert blocks.text() == state.text()  # `with s.user()` and *_begin/_end render the same


# ---------------------------------------------------------------------------- select
LONG = "no, not in a million years, absolutely never, not even on a rainy Sunday afternoon"


@pytest.mark.parametrize("prompt, choices", [("Question: is the sky green? Answer: ", ["yes", LONG]), ("Radix trees share pre", ["fixes", "tty things"])])
def test_select_scores_each_choice_in_context_in_one_batch(lang_backend, prompt, choices):
    @sgl.function
    def pick(s):
        s += prompt
        s += sgl.select("answer", choices=choices)

    state = pick.run(backend=lang_backend)
    meta = state.get_meta_info("answer")
    ids = lang_backend.tokenize([prompt] + [prompt + c for c in choices])
    starts = choice_spans(ids[0], ids[1:], choices)
    for full, start, measured in zip(ids[1:], starts, meta["input_token_logprobs"]):
        alone = lang_backend.prefill([full], logprob_start_len=start)[0]["meta_info"]["input_token_logprobs"]
        assert [t[1] for t in measured] == full[start:]  # exactly the choice's tokens
        assert [t[0] for t in measured] == pytest.approx([t[0] for t in alone], abs=1e-3)
    means = [sum(t[0] for t in lps) / len(lps) for lps in meta["input_token_logprobs"]]
    assert state["answer"] == choices[max(range(len(choices)), key=means.__getitem__)]
    assert state.text() == prompt + state["answer"]


def test_select_methods_follow_their_rules(lang_backend):
    choices = ["yes", "maybe", LONG]

    def run(method):
        @sgl.function
        def pick(s):
            s += "Question: is the sky green? Answer: " + sgl.gen("a", choices=choices, choices_method=method)

        state = pick.run(backend=lang_backend)
        return state["a"], state.get_meta_info("a")

    greedy, meta = run(sgl.greedy_token_selection)
    assert greedy == choices[max(range(3), key=lambda i: tuple(meta["greedy_logprob_matrix"][i]))]
    uncond, meta = run(sgl.unconditional_likelihood_normalized)
    values = meta["normalized_unconditional_prompt_logprobs"]
    assert uncond == choices[max(range(3), key=values.__getitem__)]
    assert [len(u) for u in meta["unconditional_token_logprobs"]] == [len(c) for c in meta["input_token_logprobs"]]


# ------------------------------------------------------------------------ constraints
class Item(BaseModel):
    label: Annotated[str, Field(max_length=8)]
    count: Annotated[int, Field(ge=0, le=99)]
    fragile: bool


SCHEMA = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["k", "n"], "additionalProperties": False}


@sgl.function
def structured(s):
    s += "Date: " + sgl.gen("date", regex=r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])") + "\n"
    s += "Item: " + sgl.gen("item", json_schema=Item, max_tokens=96) + "\n"
    s += "Pair: " + sgl.gen("pair", json_schema=json.dumps(SCHEMA), max_tokens=48) + "\n"
    s += "Count: " + sgl.gen_int("count") + " Ratio: " + sgl.gen("ratio", dtype=float)
    s += " Flag: " + sgl.gen("flag", dtype=bool) + " Name: " + sgl.gen_string("name", max_tokens=1024)


def test_regex_json_and_dtype_outputs_validate(lang_backend):
    state = structured.run(backend=lang_backend, temperature=0.8, max_new_tokens=32)
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])", state["date"])
    Item.model_validate_json(state["item"])
    jsonschema.validate(json.loads(state["pair"]), SCHEMA)
    assert str(int(state["count"])) == state["count"]
    float(state["ratio"])
    assert state["flag"] in ("True", "False")
    assert isinstance(json.loads(state["name"]), str)


# ----------------------------------------------------------------- fork, nesting, batch
PREAMBLE = "Radix trees share prefixes; caches reuse keys and values. " * 4


@sgl.function
def three_ideas(s):
    s += PREAMBLE + "Three ideas:\n"
    forks = s.fork(3)
    forks += lambda i: f"{i + 1}." + sgl.gen("idea", max_tokens=4, ignore_eos=True)
    forks.join()


def test_fork_branches_hit_the_shared_prefix_and_join_gathers_lists(lang_backend):
    state = three_ideas.run(backend=lang_backend, temperature=1.0)
    ideas = state["idea"]
    assert isinstance(ideas, list) and len(ideas) == 3 and all(isinstance(i, str) for i in ideas)
    prefix_tokens = _tokens(lang_backend, PREAMBLE + "Three ideas:\n")
    for meta in state.get_meta_info("idea")["branches"]:
        assert meta["cached_tokens"] >= prefix_tokens - 1  # only the boundary token may be recomputed
    assert state.text() == PREAMBLE + "Three ideas:\n"  # branches do not write into the source


@sgl.function
def topic_fact(s, topic):
    s += "Topic: " + topic + ". Fact:" + sgl.gen("fact", max_tokens=4, ignore_eos=True, temperature=0)


@sgl.function
def facts(s):
    s += "Facts.\n"
    topic_fact(s, "radix trees")  # inline, on this state
    separate = topic_fact(topic="caches")  # its own program, on the default backend
    s += "\nElsewhere: " + separate["fact"]


def test_nested_functions_run_inline_or_as_their_own_program(lang_backend, monkeypatch):
    monkeypatch.setattr(sgl.global_config, "default_backend", lang_backend)
    state = facts.run(temperature=0)
    alone = topic_fact.run(topic="caches", temperature=0)
    assert state.text() == "Facts.\nTopic: radix trees. Fact:" + state["fact"] + "\nElsewhere: " + alone["fact"]


def test_run_batch_of_16_prefills_the_traced_prefix_once(lang_backend):
    _flush(lang_backend)
    questions = [f"what is {i} plus {i}?" for i in range(10, 26)]
    states = few_shot_qa.run_batch([{"question": q} for q in questions], backend=lang_backend, temperature=0, progress_bar=True)
    assert len(states) == 16 and all(st.error() is None for st in states)
    shared = _tokens(lang_backend, few_shot_qa.trace(backend=lang_backend).prefix)
    assert shared >= _tokens(lang_backend, SHOTS)
    for st in states:
        assert st.get_meta_info("answer")["cached_tokens"] >= shared - 1
    alone = few_shot_qa.run(question=questions[5], backend=lang_backend, temperature=0)
    assert states[5]["answer"] == alone["answer"]  # batching does not change greedy outputs


def test_cache_prefills_the_prefix_for_later_runs(lang_backend):
    @sgl.function
    def long_intro(s, name):
        s += PREAMBLE + "Name: " + name + "\n" + sgl.gen("x", max_tokens=2)

    _flush(lang_backend)
    found = long_intro.cache(lang_backend)
    assert found.prefix == PREAMBLE + "Name: " and found.stopped_at == "argument 'name'"
    state = long_intro.run(name="Ada", backend=lang_backend)
    assert state.get_meta_info("x")["cached_tokens"] >= _tokens(lang_backend, found.prefix) - 1


@sgl.function
def scoped(s, name):
    s += "Name: "
    with s.var_scope("who"):
        s += name + sgl.gen("suffix", max_tokens=2, ignore_eos=True)
    s += "\n"
    copy = s.copy()
    copy += "Copy only."
    forks = s.fork(2)
    forks += ["A:" + sgl.gen("x", max_tokens=2, ignore_eos=True), "B:" + sgl.gen("x", max_tokens=2, ignore_eos=True)]
    forks.join("concate_and_append")
    s["copy_text"] = copy.text()


def test_var_scope_copy_and_concatenating_join(lang_backend):
    state = scoped.run(name="Ada", backend=lang_backend, temperature=0)
    assert state["who"] == "Ada" + state["suffix"]
    head = "Name: " + state["who"] + "\n"
    assert state["copy_text"] == head + "Copy only."
    assert state.text().startswith(head + "A:") and "B:" in state.text() and "Copy only." not in state.text()


def test_bind_fixes_arguments_and_gen_returns_logprobs(lang_backend):
    bound = few_shot_qa.bind(question="what is 9 plus 9?")
    assert bound.trace(backend=lang_backend).complete is False  # stops at the gen, not at the argument
    assert bound.trace(backend=lang_backend).stopped_at.startswith("gen('answer'")

    @sgl.function
    def scored(s):
        s += "Once upon a time" + sgl.gen("x", max_tokens=3, ignore_eos=True, return_logprob=True, top_logprobs_num=2)

    meta = scored.run(backend=lang_backend, temperature=0).get_meta_info("x")
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 3
    assert all(len(tops) == 2 for tops in meta["output_top_logprobs"])
    assert bound.run(backend=lang_backend, temperature=0)["answer"] == few_shot_qa.run(question="what is 9 plus 9?", backend=lang_backend, temperature=0)["answer"]


def test_set_default_backend_accepts_an_engine(lang_engine_backend, monkeypatch):
    monkeypatch.setattr(sgl.global_config, "default_backend", None)
    sgl.set_default_backend(lang_engine_backend.engine)
    assert sgl.get_default_backend().engine is lang_engine_backend.engine
    assert story.run(temperature=0).text() == story.run(backend=lang_engine_backend, temperature=0).text()
    with pytest.raises(TypeError, match="a backend must be"):
        sgl.set_default_backend("http://localhost:30000")


# ------------------------------------------------------------------------- streaming
@sgl.function
def story(s):
    s += "Once upon a time"
    s += sgl.gen("story", max_tokens=12, ignore_eos=True)


@sgl.function
def long_story(s):
    s += "Once upon a time"
    s += sgl.gen("story", max_tokens=96, ignore_eos=True)


def test_streaming_yields_the_text_as_it_grows(lang_backend):
    assert story.run(backend=lang_backend, stream=True, temperature=0).text() == story.run(backend=lang_backend, temperature=0).text()
    state = story.run(backend=lang_backend, stream=True, temperature=0)
    chunks = list(state.text_iter())
    assert "".join(chunks) == state.text()
    # pieces arrive as the text grows; a reader sees as many as it is fast enough to (a long story,
    # so a reader slowed by a loaded machine still sees several)
    long = long_story.run(backend=lang_backend, stream=True, temperature=0)
    pieces = list(long.text_iter())
    assert len(pieces) >= 3 and "".join(pieces) == long.text()
    by_var = story.run(backend=lang_backend, stream=True, temperature=0)
    assert "".join(by_var.text_iter("story")) == by_var["story"]

    async def collect():
        return [chunk async for chunk in story.run(backend=lang_backend, stream=True, temperature=0)]

    assert "".join(asyncio.run(collect())) == state.text()


def test_a_streamed_gen_keeps_every_logprob(lang_backend):
    streamed = story.run(backend=lang_backend, stream=True, temperature=0, return_logprob=True, top_logprobs_num=2)
    streamed.text()  # wait for the end
    whole = story.run(backend=lang_backend, temperature=0, return_logprob=True, top_logprobs_num=2)
    got, want = streamed.get_meta_info("story"), whole.get_meta_info("story")
    assert len(got["output_token_logprobs"]) == 12
    assert [t[1] for t in got["output_token_logprobs"]] == [t[1] for t in want["output_token_logprobs"]]
    assert len(got["output_top_logprobs"]) == 12


# ------------------------------------------------------------------------ tool agent
@sgl.tool
def population(city: Literal["Paris", "Tokyo", "Lima"]) -> int:
    """Population of a city, in thousands."""
    return {"Paris": 2100, "Tokyo": 14000, "Lima": 10000}[city]


@sgl.tool
def add(a: Annotated[int, Field(ge=0, le=99)], b: Annotated[int, Field(ge=0, le=99)]) -> int:
    """Add two small numbers."""
    return a + b


TOOLS = [population, add]


@sgl.function
def agent(s, question, steps=3):
    s += sgl.system("Answer with the tools.\n" + sgl.describe_tools(TOOLS))
    s += sgl.user(question)
    for i in range(steps):
        s += sgl.assistant(sgl.gen("call", tools=TOOLS, max_tokens=128))
        s += sgl.call_tool(s["call"], TOOLS, name=f"result{i}")


def test_tool_agent_makes_valid_calls_and_reads_their_results(lang_backend):
    state = agent.run(question="How many people live in Paris and Lima?", backend=lang_backend, temperature=1.0)
    assert state.error() is None
    schema = calls_schema(TOOLS)
    template = lang_backend.get_chat_template()
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "tool"] * 3
    for i in range(3):
        call = json.loads(messages[2 + 2 * i]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
        jsonschema.validate(call, schema)
        result = {"population": population, "add": add}[call["name"]](**call["arguments"])
        assert state[f"result{i}"] == result
        assert template.prefix("tool") + str(result) + template.suffix("tool") in state.text()
    assert state["call"] == call


# ---------------------------------------------------------------------------- errors
def test_a_call_the_runtime_refuses_raises_naming_the_call_and_its_line(lang_backend):
    @sgl.function
    def bad(s):
        s += "Say: " + sgl.gen("x", regex="(?=a)b", max_tokens=4)
        s += sgl.gen("y", max_tokens=2)

    state = bad.run(backend=lang_backend)
    error = state.error()
    assert isinstance(error, sgl.ProgramError)
    assert "gen('x', max_tokens=4, regex='(?=a)b')" in str(error) and "test_lang_programs.py" in str(error)
    assert "look-around" in str(error)  # the runtime's reason
    for name in ("x", "y"):  # the failed call, and what was queued after it
        with pytest.raises(sgl.ProgramError, match=r"regex='\(\?=a\)b'"):
            state[name]


def test_a_failing_fork_branch_does_not_leave_the_others_waiting(lang_backend):
    @sgl.function
    def branches(s):
        s += "Start. "
        forks = s.fork(3)
        forks += [sgl.gen("v", max_tokens=3, ignore_eos=True), sgl.gen("v", regex="(?<=x)y"), sgl.gen("v", max_tokens=3, ignore_eos=True)]
        try:
            forks.join()
        except sgl.ProgramError as exc:
            s["error"] = str(exc)
            s["others"] = [forks[0]["v"], forks[2]["v"]]

    result = {}
    worker = threading.Thread(target=lambda: result.update(state=branches.run(backend=lang_backend)))
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "the program hung on a failed branch"
    state = result["state"]
    assert "regex='(?<=x)y'" in state["error"]
    assert all(isinstance(v, str) for v in state["others"])


def test_an_exception_in_the_program_propagates_from_run(lang_backend):
    @sgl.function
    def broken(s):
        s += "x" + sgl.gen("a", max_tokens=2)
        raise KeyError("program bug")

    with pytest.raises(KeyError, match="program bug"):
        broken.run(backend=lang_backend)
