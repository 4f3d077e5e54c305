"""Structured output through the OpenAI client against SmolLM2: JSON schema and tool calls."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from helpers import ServerProcess

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
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
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"], "additionalProperties": False},
    },
}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def oai(smollm2_path):
    srv = ServerProcess(smollm2_path, "--max-total-tokens", "16384")
    yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused")
    assert srv.stop() == 0


def test_response_format_json_schema_output_validates(oai):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False}
    res = oai.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Invent a person and give their name and age."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
        temperature=0.7,
        seed=3,
        max_tokens=64,
    )
    assert res.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(res.choices[0].message.content), schema)


def test_json_object_mode_returns_an_object(oai):
    res = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "A JSON object with a greeting."}], response_format={"type": "json_object"}, temperature=0, max_tokens=48)
    if res.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(res.choices[0].message.content), dict)
    else:
        assert res.choices[0].message.content.startswith("{")


def test_tool_choice_required_returns_valid_calls(oai):
    res = oai.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=96)
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_named_tool_choice_returns_that_function(oai):
    res = oai.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0, max_tokens=64)
    call = res.choices[0].message.tool_calls[0]
    assert res.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS["get_time"])


def test_streamed_tool_calls_arrive_as_deltas(oai):
    stream = oai.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=96, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), PARAMS[entry["name"]])


def test_auto_tool_choice_answers_with_text_or_a_valid_call(oai):
    res = oai.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=96)
    msg = res.choices[0].message
    if msg.tool_calls:
        assert res.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(msg.tool_calls[0].function.arguments), PARAMS["get_weather"])
    else:
        assert msg.content
