"""GPT-OSS's harmony format: channels read into reasoning, content and tool calls (streamed or
not, in the OpenAI, Responses and Anthropic routes), and constraints that apply to the answer
message after the reasoning."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import ServerThread, accepts_text, grammar_backends, tokenizer_parts
from radixlm.runtime.entrypoints.openai import harmony
from radixlm.runtime.entrypoints.openai.protocol import Tool

C, M, E, S, K = "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "age"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_person", "parameters": PERSON}},
]


# ------------------------------------------------------------------ reading
def test_analysis_is_reasoning_and_final_is_content():
    turn = harmony.read(f"{C}analysis{M}They want a city.{E}{S}assistant{C}final{M}Paris.")
    assert (turn.reasoning, turn.content, turn.calls) == ("They want a city.", "Paris.", [])


def test_a_call_is_read_with_its_recipient_in_the_channel_or_after_the_role():
    channel_first = harmony.read(f'{C}analysis{M}Look it up.{E}{S}assistant{C}commentary to=functions.get_weather {K}json{M}{{"city":"Oslo"}}')
    role_first = harmony.read(f' to=functions.get_weather{C}commentary json{M}{{"city":"Oslo"}}')
    assert channel_first.calls == role_first.calls == [("get_weather", '{"city":"Oslo"}')]
    assert channel_first.reasoning == "Look it up." and channel_first.content == role_first.content == ""


def test_preambles_are_content_and_builtin_recipients_keep_their_whole_name():
    text = f"{C}commentary{M}Checking. {E}{S}assistant{C}analysis to=browser.search{M}{{\"q\":\"x\"}}"
    turn = harmony.read(text)
    assert turn.content == "Checking. " and turn.calls == [("browser.search", '{"q":"x"}')] and turn.reasoning is None


def test_a_cut_call_is_left_out_and_a_cut_answer_kept():
    cut_call = harmony.read(f"{C}analysis{M}hm{E}{S}assistant{C}commentary to=functions.f {K}json{M}{{\"a\":", cut=True)
    assert cut_call.calls == [] and cut_call.reasoning == "hm"
    cut_answer = harmony.read(f"{C}final{M}Once upon a", cut=True)
    assert cut_answer.content == "Once upon a"


def test_text_without_a_header_is_content():
    assert harmony.read('{"name":"Ann"}').content == '{"name":"Ann"}'
    assert harmony.read("").content == "" and harmony.read("").reasoning is None


def test_detect_needs_the_channel_markers_and_none_turns_it_off():
    class Tok:
        chat_template = "{{ '<|start|>assistant<|channel|>final<|message|>' }}"

    assert harmony.detect(Tok, "auto") and not harmony.detect(Tok, "none")
    Tok.chat_template = "<|im_start|>{{ m }}"
    assert not harmony.detect(Tok, "auto")


_BODY = st.text(alphabet="ab {}\":,.", max_size=12)
_MESSAGE = st.one_of(
    st.tuples(st.just("analysis"), st.none(), _BODY),
    st.tuples(st.just("final"), st.none(), _BODY),
    st.tuples(st.just("commentary"), st.none(), _BODY),
    st.tuples(st.just("commentary"), st.sampled_from(["functions.f", "functions.g", "python"]), _BODY),
)


def _pieces(messages: list) -> list[str]:
    """An output in the pieces a stream gets: a marker or a few characters at a time."""
    out: list[str] = []
    for i, (channel, recipient, body) in enumerate(messages):
        if i:
            out += [E, S, "assistant"]
        out += [C, channel + (f" to={recipient} " if recipient else "")]
        if recipient:
            out += [K, "json"]
        out += [M, *(body[j : j + 3] for j in range(0, len(body), 3))]
    return out


@settings(max_examples=150, deadline=None)
@given(messages=st.lists(_MESSAGE, min_size=1, max_size=4), cut=st.booleans())
def test_streamed_deltas_add_up_to_the_finished_read(messages, cut):
    pieces = _pieces(messages)
    streamer = harmony.HarmonyStreamer()
    thought, content, calls = "", "", {}
    text = ""
    for i, piece in enumerate(pieces):
        text += piece
        final = i == len(pieces) - 1
        for d in streamer.feed(text, final=final, cut=cut and final):
            thought += d.get("reasoning_content", "")
            content += d.get("content", "")
            for c in d.get("tool_calls", []):
                if "id" in c:
                    calls[c["index"]] = [c["function"]["name"], ""]
                calls[c["index"]][1] += c["function"]["arguments"]
    turn = harmony.read(text, cut=cut)
    assert thought == (turn.reasoning or "") and content == turn.content
    sent = [tuple(calls[i]) for i in sorted(calls)]
    assert sent[: len(turn.calls)] == turn.calls, "the whole calls stream as read"
    assert len(sent) - len(turn.calls) == (1 if cut and messages[-1][1] else 0), "only a cut last call streams beyond the read"


# ------------------------------------------------------------------ grammars
@pytest.fixture(scope="module")
def llg(harmony_model):
    tok, vocab, ends = tokenizer_parts(harmony_model)
    return grammar_backends(tok, vocab, ends)["llguidance"], tok, vocab, ends


def _tools(*names: str) -> list[Tool]:
    return [Tool.model_validate(t) for t in TOOLS if t["function"]["name"] in names]


def test_the_answer_grammar_frees_the_analysis_and_constrains_the_final_message(llg):
    backend, tok, vocab, ends = llg
    ids = harmony.marker_ids(tok)
    assert set(ids) == set(harmony.MARKERS)
    free = harmony.grammar(ids, harmony.final_turn(ids, harmony.json_answer(PERSON)))
    bounded = harmony.grammar(ids, harmony.final_turn(ids, harmony.json_answer(PERSON)), max_reasoning_tokens=4)
    answer = f'{C}final{M}{{"name":"Ann","age":7}}'
    for grammar, text, ok in [
        (free, f"{C}analysis{M}She is <young>.{E}{S}assistant{answer}", True),
        (free, answer, True),  # the analysis is optional
        (free, f'{C}final{M}{{"name":"Ann"}}', False),  # the answer is constrained
        (free, f"{C}analysis{M}x{E}{S}assistant{C}analysis{M}y{E}{S}assistant{answer}", False),  # one analysis message
        (free, f'{C}commentary to=functions.get_weather {K}json{M}{{"city":"Oslo"}}', False),  # no calls without tools
        (bounded, f"{C}analysis{M}ab{E}{S}assistant{answer}", True),
        (bounded, f"{C}analysis{M}a b c d e f g h i j{E}{S}assistant{answer}", False),  # over max_reasoning_tokens
    ]:
        assert accepts_text(backend, tok, vocab, ends, "ebnf", grammar, text) == ok, text


def test_the_tool_grammar_constrains_each_calls_arguments_and_auto_allows_an_answer(llg):
    backend, tok, vocab, ends = llg
    ids = harmony.marker_ids(tok)
    tools = _tools("get_weather", "get_person")
    required = harmony.grammar(ids, harmony.call_turn(ids, tools, text_too=False))
    auto = harmony.grammar(ids, harmony.call_turn(ids, tools, text_too=True))
    call = f'{C}commentary to=functions.get_weather {K}json{M}{{"city":"Oslo"}}'
    for grammar, text, ok in [
        (required, f"{C}analysis{M}weather{E}{S}assistant{call}", True),
        (required, call, True),
        (required, f'{C}commentary to=functions.get_person {K}json{M}{{"name":"Al","age":3}}', True),
        (required, f'{C}commentary to=functions.get_weather {K}json{M}{{"town":"Oslo"}}', False),  # its own schema
        (required, f'{C}commentary to=functions.nope {K}json{M}{{"city":"Oslo"}}', False),  # only the tools given
        (required, f"{C}final{M}It rains.", False),  # required: a call
        (auto, f"{C}final{M}It rains.", True),
        (auto, call, True),
    ]:
        assert accepts_text(backend, tok, vocab, ends, "ebnf", grammar, text) == ok, text


# ------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def server(harmony_model):
    """An in-process server of the tiny harmony model."""
    from radixlm.runtime.engine import Engine
    from radixlm.runtime.entrypoints.http.server import create_app

    engine = Engine(model_path=harmony_model, max_total_tokens=4096)
    srv = ServerThread(create_app(engine, served_model_name="oss")).start()
    yield srv.url, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    srv.stop()
    engine.shutdown()


ASK = [{"role": "user", "content": "Invent a person."}]


def _streamed(client, **kw) -> tuple[str | None, str, dict, str | None]:
    thought, content, calls, reason = None, "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            piece = (c.delta.model_extra or {}).get("reasoning_content")
            if piece:
                thought = (thought or "") + piece
            content += c.delta.content or ""
            for call in c.delta.tool_calls or []:
                if call.id:
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
            reason = c.finish_reason or reason
    return thought, content, {i: tuple(v) for i, v in calls.items()}, reason


def test_response_format_is_the_final_message_after_a_bounded_analysis(server):
    _, client = server
    kw = dict(model="oss", messages=ASK, max_tokens=120, temperature=0, extra_body={"max_reasoning_tokens": 5}, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    res = client.chat.completions.create(**kw)
    choice = res.choices[0]
    thought = choice.message.model_extra.get("reasoning_content")
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert choice.finish_reason == "stop" and not any(m in (choice.message.content or "") + (thought or "") for m in harmony.MARKERS)
    tokens = [e.token for e in client.chat.completions.create(**kw, logprobs=True).choices[0].logprobs.content]
    if thought is not None:  # the analysis body lies between the first <|message|> and <|end|>
        assert tokens.index(E) - tokens.index(M) - 1 <= 5, tokens
    assert _streamed(client, **kw) == (thought, choice.message.content, {}, "stop")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_person"}}])
def test_a_commentary_message_to_a_function_is_a_tool_call(server, tool_choice):
    _, client = server
    kw = dict(model="oss", messages=ASK, max_tokens=200, temperature=0, tools=TOOLS, tool_choice=tool_choice, extra_body={"max_reasoning_tokens": 5})
    res = client.chat.completions.create(**kw)
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_person"
    jsonschema.validate(json.loads(call.function.arguments), schema)
    thought = choice.message.model_extra.get("reasoning_content")
    assert _streamed(client, **kw) == (thought, "", {0: (call.function.name, call.function.arguments)}, "tool_calls")


def test_auto_tools_answer_or_call_and_stream_the_same(server):
    _, client = server
    for seed in range(4):  # a short analysis, then a free answer or a call: the model picks
        kw = dict(model="oss", messages=ASK, max_tokens=160, temperature=1.0, seed=seed, tools=TOOLS, tool_choice="auto", extra_body={"max_reasoning_tokens": 2})
        choice = client.chat.completions.create(**kw).choices[0]
        calls = {i: (c.function.name, c.function.arguments) for i, c in enumerate(choice.message.tool_calls or [])}
        assert choice.finish_reason == ("tool_calls" if calls else choice.finish_reason)
        thought, content, streamed_calls, reason = _streamed(client, **kw)
        assert (thought, content, reason) == (choice.message.model_extra.get("reasoning_content"), choice.message.content or "", choice.finish_reason)
        assert streamed_calls == calls or (reason == "length" and list(streamed_calls.values())[: len(calls)] == list(calls.values()))


def test_a_call_cut_by_max_tokens_is_no_call_and_says_length(server):
    _, client = server
    kw = dict(model="oss", messages=ASK, max_tokens=4, temperature=0, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_person"}})
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls


def test_the_responses_and_anthropic_routes_read_the_channels(server):
    url, client = server
    fmt = {"type": "json_schema", "name": "p", "schema": PERSON}
    res = httpx.post(url + "/v1/responses", json={"model": "oss", "input": "Invent a person.", "max_output_tokens": 120, "temperature": 0, "max_reasoning_tokens": 5, "text": {"format": fmt}}, timeout=120).json()
    kinds = [item["type"] for item in res["output"]]
    assert kinds[-1] == "message" and set(kinds) <= {"reasoning", "message"}, res
    jsonschema.validate(json.loads(res["output"][-1]["content"][0]["text"]), PERSON)
    tool = {"name": "get_weather", "input_schema": WEATHER}
    msg = httpx.post(url + "/v1/messages", json={"model": "oss", "max_tokens": 200, "messages": ASK, "tools": [tool], "tool_choice": {"type": "any"}, "thinking": {"type": "enabled", "budget_tokens": 5}}, timeout=120).json()
    blocks = [b["type"] for b in msg["content"]]
    assert msg["stop_reason"] == "tool_use" and blocks[-1] == "tool_use" and set(blocks) <= {"thinking", "tool_use"}, msg
    jsonschema.validate(msg["content"][-1]["input"], WEATHER)
    thinking, args, stop = "", "", None
    with httpx.stream("POST", url + "/v1/messages", json={"model": "oss", "max_tokens": 200, "messages": ASK, "tools": [tool], "tool_choice": {"type": "any"}, "thinking": {"type": "enabled", "budget_tokens": 5}, "stream": True, "temperature": 0}, timeout=120) as r:
        for line in r.iter_lines():
            event = json.loads(line[len("data: ") :]) if line.startswith("data: ") else {}
            delta = event.get("delta", {})
            thinking += delta.get("thinking", "")
            args += delta.get("partial_json", "")
            stop = delta.get("stop_reason", stop)
    greedy = httpx.post(url + "/v1/messages", json={"model": "oss", "max_tokens": 200, "messages": ASK, "tools": [tool], "tool_choice": {"type": "any"}, "thinking": {"type": "enabled", "budget_tokens": 5}, "temperature": 0}, timeout=120).json()
    by_type = {b["type"]: b for b in greedy["content"]}
    assert (stop, json.loads(args)) == ("tool_use", by_type["tool_use"]["input"])
    assert thinking == by_type.get("thinking", {}).get("thinking", "")


def test_reasoning_effort_reaches_the_template(server, harmony_model):
    from transformers import AutoTokenizer

    url, client = server
    tok = AutoTokenizer.from_pretrained(harmony_model)
    counts = {}
    for effort in ("low", "high"):
        want = len(tok.encode(tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True, reasoning_effort=effort), add_special_tokens=False))
        got = client.chat.completions.create(model="oss", messages=ASK, max_tokens=1, reasoning_effort=effort).usage.prompt_tokens
        assert got == want, effort
        counts[effort] = got
        res = httpx.post(url + "/v1/responses", json={"model": "oss", "input": ASK[0]["content"], "max_output_tokens": 1, "reasoning": {"effort": effort}}, timeout=60).json()
        assert res["usage"]["input_tokens"] == want, res
    assert counts["low"] != counts["high"], "the efforts render differently"


def test_a_streamed_harmony_answer_carries_every_tokens_logprob(server):
    _, client = server
    kw = dict(model="oss", messages=ASK, max_tokens=40, temperature=0, logprobs=True, extra_body={"max_reasoning_tokens": 3}, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    whole = [e.token for e in client.chat.completions.create(**kw).choices[0].logprobs.content]
    streamed = [e.token for chunk in client.chat.completions.create(stream=True, **kw) for c in chunk.choices if c.logprobs for e in c.logprobs.content or []]
    assert streamed == whole and M in whole, "markers included, as the non-streamed answer lists them"
