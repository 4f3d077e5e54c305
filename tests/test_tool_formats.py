"""Tool-call formats by model family (Hermes/Qwen, Mistral, Llama 3): chosen from the chat
template, constrained by the ``auto`` grammar, parsed, streamed, and served end to end with
templates of those families (tokenizer files built here, from the tiny model's)."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from transformers import AutoTokenizer

from helpers import ServerThread, accepts_text, tokenizer_parts
from radixlm.runtime.constrained.llguidance_backend import LLGuidanceBackend
from radixlm.runtime.entrypoints.openai import tool_calls, tool_formats
from radixlm.runtime.entrypoints.openai.protocol import Tool
from radixlm.runtime.entrypoints.openai.tool_formats import HERMES, LLAMA3, MISTRAL

# Templates in each family's style (written for these tests): tools in the prompt, assistant
# calls in the family's format, tool results in its own role or markers.
QWEN_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one inside <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}[INST] {% if loop.last and tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS] {% endif %}"
    "{{ m.content }} [/INST]{% elif m.role == 'assistant' %}{% if m.tool_calls %}[TOOL_CALLS] ["
    '{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]'
    "{% else %}{{ m.content }}{% endif %}<|endoftext|>{% elif m.role == 'tool' %}[TOOL_RESULTS] {{ m.content }} [/TOOL_RESULTS]{% endif %}{% endfor %}"
)
LLAMA3_TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nAnswer with a JSON call "
    '{"name": function name, "parameters": arguments} of one of: {% for t in tools %}{{ t | tojson }} {% endfor %}<|eot_id|>{% endif %}'
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    '{% if m.tool_calls %}{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}{% endfor %}'
    "{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TEMPLATES = {"hermes": QWEN_TEMPLATE, "mistral": MISTRAL_TEMPLATE, "llama3": LLAMA3_TEMPLATE}

WEATHER = Tool.model_validate(
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}
)
TIME = Tool.model_validate({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}})


def _family_model(tiny_llama: str, folder, family: str) -> str:
    """The tiny model with a family's chat template; its markers are tokens of their own as in
    those families' vocabularies (Qwen's tags as added tokens, Mistral's as a special token)."""
    shutil.copytree(tiny_llama, folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    if family == "mistral":
        tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    elif family == "hermes":
        tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = TEMPLATES[family]
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def families(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {f: _family_model(tiny_llama, root / f, f) for f in TEMPLATES}


# ------------------------------------------------------------- choosing the format
def test_the_format_is_chosen_from_the_chat_template(families):
    for family, path in families.items():
        assert tool_formats.detect(AutoTokenizer.from_pretrained(path)) is tool_formats.FORMATS[family]

    class Plain:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    assert tool_formats.detect(Plain()) is HERMES and tool_formats.detect(object()) is HERMES


def test_markers_that_are_tokens_of_their_own_are_found_by_id(families):
    mistral, qwen = AutoTokenizer.from_pretrained(families["mistral"]), AutoTokenizer.from_pretrained(families["hermes"])
    assert tool_formats.marker_ids(mistral, MISTRAL) == {"[TOOL_CALLS]": mistral.convert_tokens_to_ids("[TOOL_CALLS]")}
    assert tool_formats.marker_ids(qwen, HERMES) == {m: qwen.convert_tokens_to_ids(m) for m in ("<tool_call>", "</tool_call>")}
    assert tool_formats.marker_ids(AutoTokenizer.from_pretrained(families["llama3"]), HERMES) == {}
    assert tool_formats.marker_ids(mistral, LLAMA3) == {}


# ------------------------------------------------------------- the auto grammar
def _accepts(path: str, fmt, text: str, parallel: bool = True, tools=(WEATHER, TIME)) -> bool:
    tok, vocab, ends = tokenizer_parts(path)
    grammar = tool_calls.auto_grammar(list(tools), fmt=fmt, parallel=parallel, marker_ids=tool_formats.marker_ids(tok, fmt))
    return accepts_text(LLGuidanceBackend(tok, vocab, ends), tok, vocab, ends, "ebnf", grammar, text)


CALL_TEXTS = {
    "hermes": ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', '\n<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'),
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}', ', {"name": "get_time", "arguments": {"zone": "utc"}}'),
    "llama3": ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', '; {"name": "get_time", "parameters": {"zone": "utc"}}'),
}


def _calls_text(family: str, n: int) -> str:
    first, second = CALL_TEXTS[family]
    return first + (second if n == 2 else "") + ("]" if family == "mistral" else "")


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_auto_grammar_takes_text_or_valid_calls_in_the_family_format(families, family):
    path, fmt = families[family], tool_formats.FORMATS[family]
    assert _accepts(path, fmt, "It is sunny.")
    assert _accepts(path, fmt, _calls_text(family, 1))
    assert _accepts(path, fmt, _calls_text(family, 2)), "parallel calls"
    assert not _accepts(path, fmt, _calls_text(family, 2), parallel=False), "parallel_tool_calls false: one call"
    assert not _accepts(path, fmt, _calls_text(family, 1).replace('"Oslo"}', '"Oslo", "days": 2}')), "no undeclared argument"
    assert not _accepts(path, fmt, _calls_text(family, 1).replace("get_weather", "get_wether")), "only the tools' names"
    other = {"hermes": "arguments", "mistral": "arguments", "llama3": "parameters"}[family]
    assert not _accepts(path, fmt, _calls_text(family, 1).replace(f'"{other}"', '"args"'))


def test_text_before_a_call_is_content_where_the_format_has_a_marker(families):
    assert _accepts(families["hermes"], HERMES, "Let me check. " + _calls_text("hermes", 1))
    assert _accepts(families["mistral"], MISTRAL, "Let me check. " + _calls_text("mistral", 1))
    assert not _accepts(families["llama3"], LLAMA3, ' {"city": "Oslo"}'), "a Llama 3 answer that begins with '{' is a call"


# ------------------------------------------------------------- parsing
@pytest.mark.parametrize("family", list(TEMPLATES))
def test_parse_auto_reads_the_family_format_and_keeps_the_raw_arguments(family):
    fmt = tool_formats.FORMATS[family]
    text = "Sure. " + _calls_text(family, 2) if fmt.open else _calls_text(family, 2)
    content, calls = tool_calls.parse_auto(text, fmt)
    assert content == ("Sure." if fmt.open else None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "utc"}')]
    assert tool_calls.parse_auto("No call here.", fmt) == ("No call here.", [])
    cut_content, cut_calls = tool_calls.parse_auto(text[:-8], fmt)  # max_tokens inside the second call
    assert [c["function"]["name"] for c in cut_calls] == ["get_weather"], "the whole call before the cut"
    assert cut_content == content


# ------------------------------------------------------------- served, OpenAI client
@pytest.fixture(scope="module")
def served(families):
    """family -> (OpenAI client, tokenizer) of in-process servers of the family models."""
    from radixlm.runtime.engine import Engine
    from radixlm.runtime.entrypoints.http.server import create_app

    running, out = [], {}
    for family, path in families.items():
        engine = Engine(model_path=path, max_total_tokens=4096)
        server = ServerThread(create_app(engine, served_model_name=family)).start()
        running.append((server, engine))
        out[family] = (openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0), engine.tokenizer)
    yield out
    for server, engine in running:
        server.stop()
        engine.shutdown()


def _opening_bias(family: str, tok) -> dict[str, float]:
    """A logit bias that makes the random model open a call (the marker, or Llama 3's '{')."""
    opener = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "{"}[family]
    ids = tok.encode(opener, add_special_tokens=False)
    return {str(ids[0]): 100.0}


TOOLS = [WEATHER.model_dump(exclude_none=True), TIME.model_dump(exclude_none=True)]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_auto_calls_in_each_family_format_are_parsed_and_streamed_alike(served, family):
    client, tok = served[family]
    kw = dict(model=family, messages=ASK, tools=TOOLS, temperature=0, max_tokens=160, logit_bias=_opening_bias(family, tok), parallel_tool_calls=False)
    ref = client.chat.completions.create(**kw).choices[0]
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**kw, stream=True):
        state.handle_chunk(chunk)
    got = state.current_completion_snapshot.choices[0]
    assert got.finish_reason == ref.finish_reason
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls or []] == [(c.function.name, c.function.arguments) for c in ref.message.tool_calls or []]
    assert (got.message.content or None) == (ref.message.content or None)
    assert ref.finish_reason == "tool_calls" and len(ref.message.tool_calls) == 1, ref.message
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in ref.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
    assert not ref.message.content, "the marker and the call are not content"


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_parallel_auto_calls_cut_by_max_tokens_keep_the_whole_ones_and_end_with_length(served, family):
    client, tok = served[family]
    bias = _opening_bias(family, tok)
    if family == "mistral":  # the greedy model closes the list after one call: favour the ',' to another
        bias[str(tok.encode(",", add_special_tokens=False)[0])] = 30.0
    kw = dict(model=family, messages=ASK, tools=TOOLS, temperature=0, max_tokens=400, logit_bias=bias)
    natural = client.chat.completions.create(**kw)
    assert len(natural.choices[0].message.tool_calls) >= 2, natural.choices[0]
    kw["max_tokens"] = natural.usage.completion_tokens - 4  # inside the last call
    ref = client.chat.completions.create(**kw).choices[0]
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**kw, stream=True):
        state.handle_chunk(chunk)
    got = state.current_completion_snapshot.choices[0]
    assert ref.finish_reason == got.finish_reason == "length"
    whole = [(c.function.name, c.function.arguments) for c in ref.message.tool_calls or []]
    assert whole and whole == [(c.function.name, c.function.arguments) for c in natural.choices[0].message.tool_calls][: len(whole)]
    streamed = [(c.function.name, c.function.arguments) for c in got.message.tool_calls or []]
    assert streamed[: len(whole)] == whole and len(streamed) <= len(whole) + 1, "a stream keeps what it sent of the cut call"


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_a_conversation_with_calls_and_results_renders_in_each_family_template(served, family):
    client, _ = served[family]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    res = client.chat.completions.create(model=family, messages=history, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0)
    assert res.choices[0].finish_reason == "tool_calls"
    assert res.choices[0].message.tool_calls[0].function.name in ("get_weather", "get_time")
