"""The frontend language without a model: argument checks, dtype regexes, choice rules, chat-template
probing, tools and tracing."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import jinja2
import jsonschema
import pytest
from pydantic import BaseModel, Field

import radixlm as sgl
from radixlm.lang import ir
from radixlm.lang.api import DTYPE_REGEX
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.choices import (
    ChoiceScores,
    choice_spans,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.lang.program import _shared_values
from radixlm.lang.tools import call_tool, calls_schema
from radixlm.lang.tracer import trace_program
from radixlm.lang.transcript import Transcript


# ------------------------------------------------------------------ gen / select arguments
def test_invalid_regex_is_refused_naming_gen_and_the_regex():
    with pytest.raises(ValueError, match=r"gen\('num'.*invalid regex '\[0-9'"):
        sgl.gen("num", regex="[0-9")


def test_bad_sampling_argument_is_refused_where_gen_is_written():
    with pytest.raises(ValueError, match=r"gen\('x', temperature=-1\): temperature must be >= 0"):
        sgl.gen("x", temperature=-1)


def test_gen_takes_one_constraint_at_most():
    with pytest.raises(ValueError, match="at most one of regex, json_schema, dtype, tools"):
        sgl.gen("x", regex="a+", dtype=int)


def test_json_schema_accepts_a_dict_a_json_string_and_a_pydantic_model():
    class Person(BaseModel):
        name: str
        age: int

    from_model = json.loads(sgl.gen("p", json_schema=Person).json_schema)
    assert from_model["required"] == ["name", "age"]
    assert from_model["additionalProperties"] is False  # only the model's fields
    assert json.loads(sgl.gen("p", json_schema={"type": "object"}).json_schema) == {"type": "object"}
    assert sgl.gen("p", json_schema='{"type": "integer"}').json_schema == '{"type": "integer"}'
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        sgl.gen("p", json_schema="{nope")
    with pytest.raises(ValueError, match="json_schema must be"):
        sgl.gen("p", json_schema=42)


@pytest.mark.parametrize(
    "dtype, good, bad",
    [
        (int, ["0", "-12", "42"], ["012", "1.5", "", "+3", "1" * 19]),
        (float, ["3.25", "-0.5", "7"], ["1.", ".5", "1e5"]),
        (bool, ["True", "False"], ["true", "1"]),
        (str, ['"hi there"', '""'], ['"a"b"', "hi", '"\n"']),
    ],
)
def test_dtype_becomes_a_bounded_regex(dtype, good, bad):
    rx = sgl.gen("v", dtype=dtype).regex
    assert rx == sgl.gen("v", dtype=dtype.__name__).regex == DTYPE_REGEX[dtype]
    assert all(re.fullmatch(rx, g) for g in good)
    assert not any(re.fullmatch(rx, b) for b in bad)


def test_gen_int_and_gen_string_are_dtype_shorthands():
    assert sgl.gen_int("n", 8).regex == DTYPE_REGEX[int]
    assert sgl.gen_string("s").regex == DTYPE_REGEX[str]
    with pytest.raises(ValueError, match="dtype must be int, float, bool or str"):
        sgl.gen("v", dtype=list)


def test_gen_with_choices_is_a_select():
    expr = sgl.gen("c", choices=["a", "b"])
    assert isinstance(expr, ir.Select)
    assert expr.method is token_length_normalized and expr.temperature == 0.0


def test_select_checks_its_arguments():
    with pytest.raises(ValueError, match="non-empty list of non-empty strings"):
        sgl.select("c", [])
    with pytest.raises(ValueError, match="non-empty list of non-empty strings"):
        sgl.select("c", ["a", ""])
    with pytest.raises(ValueError, match="greedy_token_selection cannot sample"):
        sgl.select("c", ["a", "b"], temperature=0.5, choices_method=greedy_token_selection)


def test_expressions_concatenate_with_strings():
    expr = "Q: " + sgl.gen("a") + "\n"
    assert [type(x).__name__ for x in expr.flatten()] == ["Constant", "Gen", "Constant"]
    assert [type(x).__name__ for x in sgl.user("hi").flatten()] == ["RoleBegin", "Constant", "RoleEnd"]
    with pytest.raises(TypeError, match="strings and expressions"):
        sgl.gen("a") + 5


def test_run_without_a_backend_says_how_to_set_one(monkeypatch):
    monkeypatch.setattr(sgl.global_config, "default_backend", None)

    @sgl.function
    def prog(s):
        s += "x"

    with pytest.raises(RuntimeError, match="set_default_backend"):
        prog.run()
    with pytest.raises(TypeError, match=r"prog\(\): got an unexpected keyword argument 'y'"):
        prog.run(y=1, backend=object.__new__(sgl.EngineBackend))


# ------------------------------------------------------------------------- choice rules
def _lp(*values):
    return [(v, i, None) for i, v in enumerate(values)]


def test_token_length_normalized_picks_the_best_mean():
    scores = ChoiceScores(["a", "b"], [_lp(-0.5, -5.0), _lp(-1.0, -0.1)])
    index, meta = token_length_normalized.decide(scores)
    assert index == 1 and meta["normalized_prompt_logprobs"] == pytest.approx([-2.75, -0.55])


def test_greedy_token_selection_follows_the_first_token_and_pads_short_choices():
    scores = ChoiceScores(["Donald Duck", "Millard Fillmore"], [_lp(-0.5, -5.0), _lp(-1.0, -0.1)])
    assert greedy_token_selection.decide(scores)[0] == 0  # the attractive first token wins
    prefix = ChoiceScores(["organ", "organism"], [_lp(-0.2), _lp(-0.2, -0.1)])
    index, meta = greedy_token_selection.decide(prefix)
    assert index == 1 and meta["greedy_logprob_matrix"][0] == [-0.2, -0.2]


def test_unconditional_likelihood_normalized_subtracts_the_prompt_free_logprobs():
    scores = ChoiceScores(["common", "rare"], [_lp(-1.0, -1.0), _lp(-2.0, -2.0)], unconditional=[_lp(None, -0.1), _lp(None, -3.0)])
    index, meta = unconditional_likelihood_normalized.decide(scores)
    assert index == 1  # rare overall, but the prompt made it much likelier
    assert meta["normalized_unconditional_prompt_logprobs"] == pytest.approx([-0.95, -0.5])
    assert token_length_normalized.decide(scores)[0] == 0


def test_choice_spans_start_at_the_first_token_that_differs_from_the_prompt():
    assert choice_spans([1, 2, 3], [[1, 2, 3, 4], [1, 2, 9, 8]], ["x", "y"]) == [3, 2]  # 3 merged into 9
    with pytest.raises(ValueError, match="adds no tokens"):
        choice_spans([1, 2, 3], [[1, 2, 3]], ["z"])
    with pytest.raises(ValueError, match="needs text before it"):
        choice_spans([], [[5]], ["z"])


# ------------------------------------------------------------------ chat-template probing
CHATML_WITH_DEFAULT = (
    "{% for m in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful bot.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)
BOS = "<|begin_of_text|>"


def _renderer(source: str):
    def fail(message):
        raise ValueError(message)

    template = jinja2.Environment().from_string(source)
    return lambda messages, gen: template.render(messages=messages, add_generation_prompt=gen, bos_token=BOS, raise_exception=fail)


def _bos_tokenizer(texts, add_special_tokens):
    """A toy tokenizer that adds BOS (id 0) itself and reads the BOS text as that one token."""
    out = []
    for text in texts:
        ids = [0] if add_special_tokens else []
        i = 0
        while i < len(text):
            if text.startswith(BOS, i):
                ids.append(0)
                i += len(BOS)
            else:
                ids.append(ord(text[i]) + 1)
                i += 1
        out.append(ids)
    return out


def _build(template: ChatTemplate, messages: list[dict]) -> Transcript:
    t = Transcript(lambda: template)
    for m in messages:
        t.begin_role(m["role"])
        t.append(m["content"])
        t.end_role(m["role"])
    return t


CONVERSATION = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]


def test_probing_finds_role_markers_and_the_default_system_prompt():
    render = _renderer(CHATML_WITH_DEFAULT)
    template = ChatTemplate.probe(render)
    assert template.roles["user"] == ("<|im_start|>user\n", "<|im_end|>\n")
    assert template.generation_prompt == "<|im_start|>assistant\n"
    assert template.default_system == "You are a helpful bot."
    built = _build(template, CONVERSATION)
    assert built.text == render(CONVERSATION, False)  # same text as the template renders
    assert built.messages[0] == {"role": "system", "content": "You are a helpful bot."}
    with_system = [{"role": "system", "content": "Be terse."}, *CONVERSATION]
    assert _build(template, with_system).text == render(with_system, False)


def test_probing_drops_a_bos_the_tokenizer_adds_itself():
    render = _renderer(LLAMA3_LIKE)
    template = ChatTemplate.probe(render, _bos_tokenizer)
    assert not template.prefix("system").startswith(BOS)
    messages = [{"role": "system", "content": "Be terse."}, *CONVERSATION]
    assert _build(template, messages).text == render(messages, False).removeprefix(BOS)
    kept = ChatTemplate.probe(render, lambda texts, special: [[1] * len(t) for t in texts])  # no auto BOS
    assert kept.prefix("system").startswith(BOS)


def test_a_template_without_a_system_role_refuses_system_messages():
    render = _renderer(NO_SYSTEM)
    template = ChatTemplate.probe(render)
    assert "system" not in template.roles
    assert _build(template, CONVERSATION).text == render(CONVERSATION, False)
    with pytest.raises(ValueError, match="no 'system' role"):
        _build(template, [{"role": "system", "content": "x"}])


def test_roles_must_nest_properly():
    t = Transcript(lambda: ChatTemplate.probe(_renderer(CHATML_WITH_DEFAULT)))
    t.begin_role("user")
    with pytest.raises(ValueError, match="assistant\\(\\) begins while user\\(\\) is still open"):
        t.begin_role("assistant")
    with pytest.raises(ValueError, match="assistant_end\\(\\) without a matching"):
        t.end_role("assistant")


# ---------------------------------------------------------------------------------- tools
class Address(BaseModel):
    city: str
    country: Literal["FR", "JP"]


@sgl.tool
def ship(item: str, qty: Annotated[int, Field(ge=1, le=9)] = 1, to: Address | None = None) -> dict:
    """Ship an item.

    Args:
        item: what to ship
        qty: how many
            (at most nine)
    """
    return {"item": item, "qty": qty}


@sgl.tool(name="divide")
def div(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


def test_tool_schema_comes_from_the_signature_and_docstring():
    assert ship.name == "ship" and ship.description == "Ship an item."
    props = ship.parameters["properties"]
    assert ship.parameters["required"] == ["item"]
    assert props["qty"] == {"default": 1, "maximum": 9, "minimum": 1, "type": "integer", "description": "how many (at most nine)"}
    assert props["item"]["description"] == "what to ship"
    assert ship.invoke({"item": "pen", "qty": "3"}) == {"item": "pen", "qty": 3}  # validated, coerced
    with pytest.raises(TypeError, match="parameters must be named"):
        sgl.tool(lambda *a: a)
    with pytest.raises(ValueError, match="'no spaces allowed' is not a valid OpenAI tool"):
        sgl.tool(div.fn, name="no spaces allowed")


def test_calls_schema_accepts_exactly_the_valid_calls():
    schema = calls_schema([ship, div])
    valid = [{"name": "ship", "arguments": {"item": "pen", "to": {"city": "Lyon", "country": "FR"}}}, {"name": "divide", "arguments": {"a": 1, "b": 2}}]
    for call in valid:
        jsonschema.validate(call, schema)  # refs into the lifted $defs resolve
    invalid = [{"name": "ship", "arguments": {"qty": 2}}, {"name": "divide", "arguments": {"a": 1}}, {"name": "nope", "arguments": {}}, {"name": "ship", "arguments": {"item": "x", "qty": 10}}]
    for call in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call, schema)


def test_call_tool_appends_the_result_as_a_tool_message():
    expr = call_tool({"name": "divide", "arguments": {"a": 6, "b": 4}}, [ship, div], name="r")
    kinds = [type(x).__name__ for x in expr.flatten()]
    assert kinds == ["RoleBegin", "Constant", "RoleEnd", "SetVar"]
    assert expr.flatten()[0].role == "tool" and expr.flatten()[1].text == "1.5" and expr.flatten()[3].value == 1.5
    failed = call_tool({"name": "divide", "arguments": {"a": 1, "b": 0}}, [div])
    assert failed.flatten()[1].text.startswith("error: ZeroDivisionError")
    with pytest.raises(ZeroDivisionError):
        call_tool({"name": "divide", "arguments": {"a": 1, "b": 0}}, [div], raise_errors=True)
    with pytest.raises(ValueError, match="does not call one of"):
        call_tool({"name": "nope", "arguments": {}}, [div])


def test_describe_tools_lists_every_tool_and_the_call_format():
    text = sgl.describe_tools([ship, div])
    assert '"name": "ship"' in text and '"name": "divide"' in text and "<tool_call>" in text


# -------------------------------------------------------------------------------- tracing
class _TemplateOnly:
    """Just enough backend for the tracer: a chat template."""

    def get_chat_template(self) -> ChatTemplate:
        return ChatTemplate.probe(_renderer(CHATML_WITH_DEFAULT))


def test_trace_stops_at_the_first_argument_with_roles_rendered():
    def qa(s, question, style):
        s += sgl.system("Answer " + style + ".")
        s += sgl.user("Question: " + question)
        s += sgl.assistant(sgl.gen("answer"))

    found = trace_program(qa, {}, _TemplateOnly())
    assert found.prefix == "<|im_start|>system\nAnswer " and found.stopped_at == "argument 'style'"
    bound = trace_program(qa, {"style": "briefly"}, _TemplateOnly())
    assert bound.prefix == "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nQuestion: "
    assert not bound.complete


def test_trace_stops_where_python_needs_a_value():
    def formatted(s, q):
        s += "Intro. "
        s += f"Q: {q}"

    def method(s, q):
        s += "Intro. "
        s += q.upper()

    def generated(s):
        s += "A" + sgl.gen("x", max_tokens=2) + "B"

    def constant(s):
        with s.user():
            s += "fixed"

    assert trace_program(formatted, {}, None).prefix == "Intro. "
    assert trace_program(method, {}, None).prefix == "Intro. "
    gen_trace = trace_program(generated, {}, None)
    assert gen_trace.prefix == "A" and gen_trace.stopped_at.startswith("gen('x'")
    done = trace_program(constant, {}, _TemplateOnly())
    assert done.complete and done.prefix.endswith("<|im_start|>user\nfixed<|im_end|>\n")


def test_run_batch_traces_arguments_that_every_instance_shares():
    batch = [{"shots": "Q1 A1", "q": "x", "n": 1}, {"shots": "Q1 A1", "q": "y", "n": 1}]
    assert _shared_values(batch) == {"shots": "Q1 A1", "n": 1}


def test_a_stream_error_event_from_the_server_raises_backend_error():
    import httpx

    from radixlm.lang.backend.base import BackendError
    from radixlm.lang.backend.endpoint import RuntimeEndpoint

    def handler(request: httpx.Request) -> httpx.Response:
        body = 'data: {"text": "a", "meta_info": {}}\n\ndata: {"error": {"message": "forward pass failed", "code": 500}}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    backend = RuntimeEndpoint("http://test")
    backend.client = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://test")
    events = backend.generate_stream("x", {"max_new_tokens": 2})
    assert next(events)["text"] == "a"
    with pytest.raises(BackendError, match="forward pass failed"):
        next(events)
