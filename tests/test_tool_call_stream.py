"""Streamed tool calls: the streamer's deltas for every chunking, and the OpenAI client's assembly of them."""

from __future__ import annotations

import json

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState

from radixlm.runtime.entrypoints.openai import tool_calls
from radixlm.runtime.entrypoints.openai.tool_call_stream import ToolCallStreamer
from radixlm.runtime.entrypoints.openai.tool_formats import (
    FORMATS,
    HERMES,
    LLAMA3,
    MISTRAL,
    ToolFormat,
)
from radixlm.runtime.entrypoints.openai.tool_markers import CLOSE, OPEN


# ---------------------------------------------------------------- helpers
def _parse(mode: str, text: str, name: str | None = None, fmt: ToolFormat = HERMES) -> tuple[str | None, list[dict]]:
    """The non-streamed message (what openai.chat.chat_choice returns)."""
    return tool_calls.parse_output(mode, text, name, fmt)


def _stream(mode: str, text: str, cuts: list[int], name: str | None = None, fmt: ToolFormat = HERMES) -> list[dict]:
    """All deltas of ``text`` fed at the prefix lengths ``cuts``, then finished."""
    streamer = ToolCallStreamer(mode, name, fmt)
    deltas = []
    for n in cuts:
        deltas += streamer.feed(text[:n])
    content, calls = _parse(mode, text, name, fmt)
    return deltas + streamer.finish(text, content, calls)


def _assemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    """Content and calls from deltas, checking the OpenAI shape: an id, type and whole name once
    per call and first, then argument pieces only; indexes 0, 1, ... in order; one entry a delta."""
    content, calls = "", []
    for d in deltas:
        assert set(d) <= {"content", "tool_calls"} and len(d) == 1
        content += d.get("content", "")
        for entry in d.get("tool_calls", []):
            assert len(d["tool_calls"]) == 1
            i = entry["index"]
            if "id" in entry:
                assert i == len(calls), "calls open in order, once each"
                assert entry["id"].startswith("call_") and len(entry["id"]) == 29 and entry["type"] == "function"
                assert entry["function"]["name"] and entry["function"]["arguments"] == ""
                calls.append({"id": entry["id"], "name": entry["function"]["name"], "arguments": ""})
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                assert i < len(calls) and entry["function"]["arguments"]
                calls[i]["arguments"] += entry["function"]["arguments"]
    return content, calls


def _check_whole(mode: str, text: str, cuts: list[int], name: str | None = None, fmt: ToolFormat = HERMES) -> None:
    content, calls = _assemble(_stream(mode, text, cuts, name, fmt))
    want_content, want_calls = _parse(mode, text, name, fmt)
    assert content == (want_content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]


# ---------------------------------------------------------------- strategies
TRICKY = ["}", "]", "{", "[", '"', "\\", ",", ":", OPEN, CLOSE, "<tool_", "é", "\n", " ", "\u2028", "😀"]
strings = st.lists(st.sampled_from(TRICKY) | st.text(max_size=3), max_size=5).map("".join)
scalars = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(allow_nan=False, allow_infinity=False) | strings
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(strings, inner, max_size=3), max_leaves=8)
objects = st.dictionaries(strings, values, max_size=4)
names = st.sampled_from(["get_weather", "f", "a_b-c"]) | strings.filter(bool)
# how the model lays out JSON: the separators (with flexible whitespace) and the escaping
layouts = st.tuples(st.sampled_from([None, 0, 2]), st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :  ")]), st.booleans())


def _dump(value, layout) -> str:
    indent, seps, ascii_only = layout
    return json.dumps(value, indent=indent, separators=seps, ensure_ascii=ascii_only)


def _call_text(name: str, arguments, layout, args_first: bool = False, args_key: str = "arguments") -> str:
    _, (item, key), _ = layout
    parts = [f'"name"{key}{_dump(name, layout)}', f'"{args_key}"{key}{_dump(arguments, layout)}']
    return "{" + item.join(parts[::-1] if args_first else parts) + " }"


@st.composite
def chunkings(draw, text: str) -> list[int]:
    """Prefix lengths at which the growing text is fed (random token sizes)."""
    cuts, n = [], 0
    while n < len(text):
        n = min(len(text), n + draw(st.integers(1, 6)))
        cuts.append(n)
    return cuts


@st.composite
def required_outputs(draw) -> str:
    layout = draw(layouts)
    calls = draw(st.lists(st.tuples(names, objects | values, st.booleans()), min_size=1, max_size=3))
    ws = draw(st.sampled_from(["", " ", "\n  "]))
    return "[" + ws + ("," + ws).join(_call_text(n, a, layout, first) for n, a, first in calls) + ws + "]"


@st.composite
def auto_outputs(draw) -> str:
    text = draw(st.lists(st.sampled_from(["Sure", " ", "\n", "<", "<tool", "<tool_call", "</tool_call>", "a<b", "é"]), max_size=6).map("".join))
    text = text.replace(OPEN, "")
    if draw(st.booleans()):
        layout = draw(layouts)
        calls = draw(st.lists(st.tuples(names, objects), min_size=1, max_size=2))
        gap = draw(st.sampled_from(["", " ", "\n"]))
        text += gap.join(OPEN + gap + _call_text(n, a, layout) + gap + CLOSE for n, a in calls)
    return text


@st.composite
def family_outputs(draw, fmt: ToolFormat) -> str:
    """``auto`` output in a family's format: text, calls, or (where a marker opens them) both."""
    if fmt is HERMES:
        return draw(auto_outputs())
    text = draw(st.lists(st.sampled_from(["Sure", " ", "\n", "[", "[TOOL", "a;b", "é", "{"]), max_size=6).map("".join))
    text = text.replace(fmt.open, "") if fmt.open else text.lstrip(" \n").lstrip("{")
    if draw(st.booleans()):
        layout = draw(layouts)
        calls = [_call_text(n, a, layout, args_key=fmt.args_key) for n, a in draw(st.lists(st.tuples(names, objects), min_size=1, max_size=3))]
        gap = draw(st.sampled_from(["", " ", "\n"]))
        if fmt is MISTRAL:
            text += fmt.open + gap + "[" + ("," + gap).join(calls) + "]"
        else:  # Llama 3: the calls are the whole answer
            text = gap + (gap + ";" + gap).join(calls)
    return text


FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- unit tests
def test_required_output_fed_char_by_char_sends_each_name_once_and_arguments_in_pieces():
    text = '[{"name": "get_weather", "arguments": {"city": "}]\\"<tool_call>", "n": [1, {"x": null}]}}, {"name":"f\\u00e9","arguments":12}]'
    deltas = _stream("required", text, list(range(1, len(text) + 1)))
    content, calls = _assemble(deltas)
    assert content == "" and [c["name"] for c in calls] == ["get_weather", "fé"]
    assert calls[0]["arguments"] == '{"city": "}]\\"<tool_call>", "n": [1, {"x": null}]}' and calls[1]["arguments"] == "12"
    pieces = [d["tool_calls"][0]["function"]["arguments"] for d in deltas if "id" not in d["tool_calls"][0]]
    assert len(pieces) > 20, "arguments arrive as they are generated, not whole"


def test_auto_output_streams_the_text_then_the_call_never_the_markers():
    text = 'Hi <tool there\n<tool_call>\n{"name": "f", "arguments": {"q": "</tool_call> <tool_call>"}}\n</tool_call>'
    deltas = _stream("auto", text, list(range(1, len(text) + 1)))
    content, calls = _assemble(deltas)
    assert content == "Hi <tool there"
    assert [(c["name"], c["arguments"]) for c in calls] == [("f", '{"q": "</tool_call> <tool_call>"}')]
    assert all("<tool_call>" not in d.get("content", "") for d in deltas)


def test_auto_output_without_a_call_is_all_content_trailing_partial_marker_included():
    for text in ["just text  ", "ends with <tool_c", "  ", ""]:
        content, calls = _assemble(_stream("auto", text, list(range(1, len(text) + 1))))
        assert content == text and calls == []


def test_named_output_is_the_arguments_from_the_first_character():
    text = '{"city": "Pa\\"ris", "unit": "celsius"}'
    deltas = _stream("named", text, list(range(1, len(text) + 1)), "get_weather")
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}
    _, calls = _assemble(deltas)
    assert calls[0]["arguments"] == text


@FAST
@given(st.data())
def test_required_outputs_in_any_chunking_assemble_to_the_parsed_calls(data):
    text = data.draw(required_outputs())
    _check_whole("required", text, data.draw(chunkings(text)))


@FAST
@given(st.data())
def test_auto_outputs_in_any_chunking_assemble_to_the_parsed_message(data):
    text = data.draw(auto_outputs())
    _check_whole("auto", text, data.draw(chunkings(text)))


@FAST
@given(st.data())
def test_named_outputs_in_any_chunking_assemble_to_the_parsed_call(data):
    text = _dump(data.draw(objects), data.draw(layouts))
    _check_whole("named", text, data.draw(chunkings(text)), "get_weather")


@FAST
@given(st.data(), st.sampled_from(["named", "required", "auto"]))
def test_a_cut_output_never_fabricates_a_call(data, mode):
    """Cut by max_tokens: the streamed pieces are a prefix of what was generated, and the message
    ends like the non-streamed one: no call and no partial JSON as content (named, required), the
    text before the call as content (auto)."""
    whole = data.draw({"named": objects.map(lambda o: _dump(o, (None, (", ", ": "), False))), "required": required_outputs(), "auto": auto_outputs()}[mode])
    text = whole[: data.draw(st.integers(0, max(len(whole) - 1, 0)))]
    name = "get_weather" if mode == "named" else None
    content, calls = _assemble(_stream(mode, text, data.draw(chunkings(text)), name))
    want_content, want_calls = _parse(mode, text, name)
    _, full = _parse(mode, whole, name)
    for got, ref in zip(calls, full):  # what was sent of a call is the start of its arguments
        assert got["name"] == ref["function"]["name"] and ref["function"]["arguments"].startswith(got["arguments"])
    if want_calls:  # the calls before the cut are whole (auto); one cut after them may be open
        assert [(c["name"], c["arguments"]) for c in calls[: len(want_calls)]] == [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]
        assert len(calls) <= len(want_calls) + 1
    elif calls:  # opened, then cut: finish_reason "length" (the OpenAI routes), no content added
        assert content == ("" if mode != "auto" else text[: text.find(OPEN)].rstrip())
    elif mode != "auto":  # cut before a whole call: neither calls nor the partial JSON as content
        assert not content
    else:
        assert content == (want_content or "")


# ---------------------------------------------- the server's chunks, OpenAI client
def _client_assembles(mode: str, text: str, finish: str, name: str | None = None):
    """The OpenAI client's message from the chunks the OpenAI routes send for ``text`` arriving in 3-char steps."""
    from openai.types.chat import ChatCompletionChunk

    from radixlm.runtime.entrypoints.openai.chat import tool_pieces as _tool_pieces
    from radixlm.runtime.entrypoints.openai.plan import Plan as _Plan
    from radixlm.runtime.request import ReqOutput

    plan = _Plan(True, "m", [[1]], ["p"], {}, 1, True, False, None, tool_mode=mode, tool_name=name)
    streamer = ToolCallStreamer(mode, name)
    state = ChatCompletionStreamState()
    choices = [[{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]]
    cuts = list(range(3, len(text), 3))
    for n in cuts:
        choices += [[c] for c in _tool_pieces(plan, 0, ReqOutput("r", text[:n], [], {"finish_reason": None}, False), streamer)]
    end = ReqOutput("r", text, [], {"finish_reason": {"type": finish}}, True)
    choices += [[c] for c in _tool_pieces(plan, 0, end, streamer)]
    for cs in choices:
        state.handle_chunk(ChatCompletionChunk.model_validate({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": cs}))
    return state.current_completion_snapshot.choices[0]


def test_the_client_assembles_the_chunks_of_an_auto_call_and_its_finish_reason():
    text = 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "<tool_call>}\\"", "unit": "celsius"}}</tool_call>'
    got = _client_assembles("auto", text, "stop")
    assert got.finish_reason == "tool_calls" and got.message.content == "Let me look."
    assert _calls(got.message) == [("get_weather", '{"city": "<tool_call>}\\"", "unit": "celsius"}')]
    cut = _client_assembles("auto", text[:-30], "length")  # max_tokens inside the call
    assert cut.finish_reason == "length" and cut.message.content == "Let me look."
    assert _calls(cut.message) == [("get_weather", text[text.index('{"city"') : -30])]  # what was generated of it
    required = '[{"name": "a", "arguments": {"x": [1, "]"]}}, {"name": "b", "arguments": {}}]'
    got = _client_assembles("required", required, "stop")
    assert got.finish_reason == "tool_calls" and _calls(got.message) == [("a", '{"x": [1, "]"]}'), ("b", "{}")]


# ------------------------------------------------------- end to end, OpenAI client
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}, "h24": {"type": "boolean"}}, "required": ["zone", "h24"], "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def oai(tiny_server):
    return openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="unused", max_retries=0)


def _both(oai, **kw):
    """The non-streamed message and the client's assembly of the streamed one (same request)."""
    kw = {"model": "tiny", "messages": ASK, "temperature": 0, **kw}
    ref = oai.chat.completions.create(**kw).choices[0]
    state, chunks = ChatCompletionStreamState(), []
    for chunk in oai.chat.completions.create(**kw, stream=True):
        chunks.append(chunk)
        state.handle_chunk(chunk)
    got = state.current_completion_snapshot.choices[0]  # get_final_completion() refuses finish_reason "length"
    for chunk in chunks:  # the OpenAI shape: a call's first delta has its id and name, the rest only arguments
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                assert (d.id is not None) == (d.function.name is not None)
    return ref, got, chunks


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _assert_same(ref, got) -> None:
    assert got.finish_reason == ref.finish_reason
    assert (got.message.content or None) == (ref.message.content or None)
    assert _calls(got.message) == _calls(ref.message)
    for c in got.message.tool_calls or []:
        assert c.id.startswith("call_") and c.type == "function"


def test_streamed_required_calls_assemble_to_the_non_streamed_calls(oai):
    ref, got, chunks = _both(oai, tools=[WEATHER, TIME], tool_choice="required", max_tokens=300)
    assert ref.finish_reason == "tool_calls" and ref.message.tool_calls
    _assert_same(ref, got)
    pieces = sum(1 for ch in chunks for c in ch.choices for d in c.delta.tool_calls or [] if d.function.arguments)
    assert pieces > len(ref.message.tool_calls), "arguments arrive in pieces"


def test_streamed_named_call_assembles_to_the_non_streamed_call(oai):
    ref, got, _ = _both(oai, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=300)
    assert ref.finish_reason == "tool_calls" and _calls(ref.message)[0][0] == "get_time"
    _assert_same(ref, got)


@pytest.mark.parametrize("content", ["What is the weather in Paris?", "Call get_weather for Rome.", "<tool_call>"])
def test_streamed_auto_answer_assembles_to_the_non_streamed_answer(oai, content):
    ref, got, _ = _both(oai, messages=[{"role": "user", "content": content}], tools=[WEATHER], max_tokens=120)
    _assert_same(ref, got)


def test_a_call_cut_by_max_tokens_ends_with_length_and_no_fabricated_call(oai):
    ref, got, chunks = _both(oai, tools=[WEATHER], tool_choice="required", max_tokens=12)
    assert ref.finish_reason == got.finish_reason == "length" and not ref.message.tool_calls
    assert ref.message.content is None and not got.message.content, "no partial JSON passed off as content"
    for name, _ in _calls(got.message):  # a call the stream had opened is the one tool's
        assert name == WEATHER["function"]["name"]


# ------------------------------------------------------------- the other families' formats
@FAST
@given(st.data(), st.sampled_from([MISTRAL, LLAMA3]))
def test_family_auto_outputs_in_any_chunking_assemble_to_the_parsed_message(data, fmt):
    text = data.draw(family_outputs(fmt))
    _check_whole("auto", text, data.draw(chunkings(text)), fmt=fmt)


@FAST
@given(st.data(), st.sampled_from(list(FORMATS.values())))
def test_a_cut_family_output_streams_a_prefix_and_keeps_the_whole_calls(data, fmt):
    whole = data.draw(family_outputs(fmt))
    text = whole[: data.draw(st.integers(0, max(len(whole) - 1, 0)))]
    content, calls = _assemble(_stream("auto", text, data.draw(chunkings(text)), fmt=fmt))
    want_content, want_calls = _parse("auto", text, fmt=fmt)
    _, full = _parse("auto", whole, fmt=fmt)
    for got, ref in zip(calls, full):
        assert got["name"] == ref["function"]["name"] and ref["function"]["arguments"].startswith(got["arguments"])
    assert [(c["name"], c["arguments"]) for c in calls[: len(want_calls)]] == [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]
    assert len(calls) <= len(want_calls) + 1
    if not calls:
        assert content == (want_content or "")


def test_llama3_answer_is_content_unless_it_begins_with_a_brace():
    for text in ["The weather is fine; {ok}", "  ", "", " x {"]:
        content, calls = _assemble(_stream("auto", text, list(range(1, len(text) + 1)), fmt=LLAMA3))
        assert content == text and calls == []
    text = '\n{"name": "f", "parameters": {"a": "}; {"}} ; {"name": "g", "parameters": {}}'
    content, calls = _assemble(_stream("auto", text, list(range(1, len(text) + 1)), fmt=LLAMA3))
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [("f", '{"a": "}; {"}'), ("g", "{}")]


def test_mistral_marker_is_never_content_and_opens_the_call_list():
    text = 'Let me see. [TOOL_CALLS] [{"name": "f", "arguments": {"q": "[TOOL_CALLS]"}}, {"name": "g", "arguments": []}]'
    deltas = _stream("auto", text, list(range(1, len(text) + 1)), fmt=MISTRAL)
    content, calls = _assemble(deltas)
    assert content == "Let me see." and [(c["name"], c["arguments"]) for c in calls] == [("f", '{"q": "[TOOL_CALLS]"}'), ("g", "[]")]
    assert all("[TOOL" not in d.get("content", "") for d in deltas)


def test_a_cut_call_whose_string_holds_the_closing_marker_keeps_the_whole_call_before_it():
    first = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    text = first + '<tool_call>{"name": "g", "arguments": {"</tool_call>": "x'  # cut by max_tokens
    content, calls = _parse("auto", text)
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("f", "{}")]
    _, streamed = _assemble(_stream("auto", text, list(range(1, len(text) + 1))))
    assert [c["name"] for c in streamed][:1] == ["f"]
