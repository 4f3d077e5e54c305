"""Reasoning models: the reasoning section comes apart in ``reasoning_content`` (streamed or
not), constraints apply to the answer after it, ``max_reasoning_tokens`` bounds it."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import (
    CHAT_TEMPLATE,
    THINK_TEMPLATE,
    ServerThread,
    accepts_text,
    grammar_backends,
    tokenizer_parts,
)
from radixlm.runtime.entrypoints.openai import reasoning
from radixlm.runtime.entrypoints.openai.reasoning import ReasoningFormat

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "age"]}
OPENED, CLOSED = ReasoningFormat(started=True), ReasoningFormat()


def test_detect_needs_both_markers_in_the_template_and_none_turns_it_off():
    class Tok:
        chat_template = THINK_TEMPLATE

    assert reasoning.detect(Tok, "auto") == ReasoningFormat()
    assert reasoning.detect(Tok, "none") is None
    Tok.chat_template = CHAT_TEMPLATE
    assert reasoning.detect(Tok, "auto") is None
    assert reasoning.for_prompt(ReasoningFormat(), "<|im_start|>assistant\n<think>\n").started


def test_split_separates_reasoning_and_answer():
    assert reasoning.split(OPENED, "\nweigh it\n</think>\n\n{}") == ("weigh it", "{}")
    assert reasoning.split(CLOSED, "<think>a</think>b") == ("a", "b")
    assert reasoning.split(CLOSED, "no reasoning here") == (None, "no reasoning here")
    assert reasoning.split(OPENED, "cut while think") == ("cut while think", ""), "cut inside the reasoning: no answer"
    assert reasoning.split(OPENED, "hm </thi", final=False) == ("hm", ""), "a piece of the marker is held back"
    assert reasoning.split(CLOSED, "<thi", final=False) == (None, "")


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([OPENED, CLOSED]), st.text(alphabet="ab <>/think\n{}", max_size=30), st.text(alphabet="ab \n{}<", max_size=12), st.data())
def test_streamed_parts_only_grow_and_end_as_the_final_split(fmt, thought, answer, data):
    thought = thought.replace("</think>", "")
    text = ("" if fmt.started else "<think>") + thought + "</think>" + answer
    final = reasoning.split(fmt, text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    before = ("", "")
    for cut in [*cuts, len(text)]:
        part = reasoning.split(fmt, text[:cut], final=cut == len(text))
        got = (part[0] or "", part[1])
        assert got[0].startswith(before[0]) and got[1].startswith(before[1]), (text[:cut], before, got)
        before = got
    assert before == (final[0] or "", final[1])


# ------------------------------------------------------------------ grammar
@pytest.fixture(scope="module")
def llg(smollm2_path):
    tok, vocab, ends = tokenizer_parts(smollm2_path)
    return grammar_backends(tok, vocab, ends)["llguidance"], tok, vocab, ends


def test_the_reasoning_grammar_frees_the_reasoning_and_constrains_the_answer(llg):
    backend, tok, vocab, ends = llg
    closed = reasoning.grammar(CLOSED, reasoning.json_answer(PERSON))
    opened = reasoning.grammar(OPENED, reasoning.json_answer(PERSON), max_tokens=6)
    for grammar, text, ok in [
        (closed, '<think>she is young</think>\n{"name":"Ann","age":7}', True),
        (closed, '{"name":"Ann","age":7}', True),  # reasoning is optional when the prompt did not open it
        (closed, '<think>x</think>{"name":"Ann"}', False),  # the answer is constrained
        (closed, '<think>a <b> c</think>{"name":"Ann","age":7}', False),  # no '<' inside the reasoning
        (opened, 'short</think>{"name":"Ann","age":7}', True),
        (opened, '{"name":"Ann","age":7}', False),  # the prompt opened it: it must close
        (opened, "a b c d e f g h i j k l</think>{\"name\":\"Ann\",\"age\":7}", False),  # over max_tokens
    ]:
        assert accepts_text(backend, tok, vocab, ends, "ebnf", grammar, text) == ok, (text, grammar)


def test_max_reasoning_tokens_forces_the_closing_marker(llg):
    backend, tok, *_ = llg
    m = backend.compile("ebnf", reasoning.grammar(OPENED, reasoning.json_answer(PERSON), max_tokens=4)).matcher()
    ids = tok.encode(" one two three four", add_special_tokens=False)
    assert m.accept_many(ids) == len(ids) == 4
    assert m.forced_text().startswith("</think>")


# ------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def thinker(thinker_model):
    """An OpenAI client of an in-process server whose tiny model's template opens a reasoning section."""
    from radixlm.runtime.engine import Engine
    from radixlm.runtime.entrypoints.http.server import create_app

    engine = Engine(model_path=thinker_model, max_total_tokens=4096)
    server = ServerThread(create_app(engine, served_model_name="thinker")).start()
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0), engine.tokenizer
    server.stop()
    engine.shutdown()


ASK = [{"role": "user", "content": "Invent a person."}]


def _streamed(client, **kw) -> tuple[str, str, list]:
    thought, content, calls = "", "", []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            thought += extra.get("reasoning_content") or ""
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
    return thought, content, calls


def test_response_format_constrains_the_answer_after_a_bounded_reasoning(thinker):
    client, _ = thinker
    kw = dict(model="thinker", messages=ASK, max_tokens=120, temperature=0, extra_body={"max_reasoning_tokens": 6}, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    res = client.chat.completions.create(**kw)
    message = res.choices[0].message
    thought = message.model_extra["reasoning_content"]
    assert isinstance(thought, str) and "<" not in thought and "</think>" not in (message.content or "")
    answer = json.loads(message.content)
    jsonschema.validate(answer, PERSON)
    assert set(answer) <= {"name", "age"}, "strict generation holds after the reasoning too"
    assert res.choices[0].finish_reason == "stop"
    tokens = [e.token for e in client.chat.completions.create(**kw, logprobs=True).choices[0].logprobs.content]
    in_reasoning = next(i for i, t in enumerate(tokens) if "<" in t)  # the reasoning holds no '<': the marker starts there
    assert in_reasoning <= 6, f"the reasoning ran {in_reasoning} tokens past max_reasoning_tokens 6: {tokens}"
    assert _streamed(client, **kw)[:2] == (thought, message.content)


def test_tool_calls_follow_the_reasoning(thinker):
    client, _ = thinker
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 6}}, "required": ["q"]}}}
    kw = dict(model="thinker", messages=ASK, max_tokens=240, temperature=0, tools=[tool], tool_choice="required", extra_body={"max_reasoning_tokens": 5})
    res = client.chat.completions.create(**kw)
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"] is not None
    (call,) = choice.message.tool_calls
    assert call.function.name == "lookup" and set(json.loads(call.function.arguments)) == {"q"}
    thought, _, calls = _streamed(client, **kw)
    assert thought == choice.message.model_extra["reasoning_content"]
    assert "".join(c.function.arguments or "" for c in calls) == call.function.arguments


def test_free_text_with_a_reasoning_budget_splits_reasoning_and_content(thinker):
    client, _ = thinker
    kw = dict(model="thinker", messages=ASK, max_tokens=30, temperature=0, extra_body={"max_reasoning_tokens": 4})
    message = client.chat.completions.create(**kw).choices[0].message
    assert message.model_extra["reasoning_content"] is not None and "</think>" not in (message.content or "")
    assert _streamed(client, **kw)[:2] == (message.model_extra["reasoning_content"], message.content or "")


def test_max_reasoning_tokens_is_refused_by_name_without_a_reasoning_template(tiny_server):
    r = httpx.post(tiny_server.base_url + "/v1/chat/completions", json={"model": "tiny", "messages": ASK, "max_reasoning_tokens": 4}, timeout=60)
    assert r.status_code == 400 and r.json()["param"] == "max_reasoning_tokens", r.text
