"""Strict structured outputs over HTTP: undeclared properties are not generated unless asked for,
``parallel_tool_calls: false`` makes one call, ignored formats are reported, overlapping
``oneOf`` is refused by name. The tiny random model at temperature 1 is the sampler: it takes
any path the grammar leaves open."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from radixlm.runtime.entrypoints.openai.protocol import Tool
from radixlm.runtime.entrypoints.openai.tool_calls import arguments_schema
from radixlm.runtime.sampling_params import SamplingParams

CITY = {  # what pydantic writes for City(name, country, population): additionalProperties unset
    "properties": {
        "name": {"maxLength": 12, "title": "Name", "type": "string"},
        "country": {"maxLength": 12, "title": "Country", "type": "string"},
        "population": {"maximum": 100000, "minimum": 0, "title": "Population", "type": "integer"},
    },
    "required": ["name"],
    "title": "City",
    "type": "object",
}
SAMPLES = dict(n=12, temperature=1.0, seed=7, max_tokens=80)


@pytest.fixture(scope="module")
def oai(tiny_server):
    return openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="unused", max_retries=0)


def _objects(res) -> list[dict]:
    """The choices' JSON objects (each closes within max_tokens: constrained/budget.py)."""
    return [json.loads(c.message.content) for c in res.choices]


def _city_format(strict: bool | None) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, **({"strict": strict} if strict is not None else {})}}


def test_response_format_generates_only_declared_properties_by_default(oai):
    ask = [{"role": "user", "content": "Describe the city Tokyo."}]
    strict = _objects(oai.chat.completions.create(model="tiny", messages=ask, response_format=_city_format(None), **SAMPLES))
    for obj in strict:
        jsonschema.validate(obj, CITY)
        assert set(obj) <= set(CITY["properties"]), obj
    loose = _objects(oai.chat.completions.create(model="tiny", messages=ask, response_format=_city_format(False), **SAMPLES))
    for obj in loose:
        jsonschema.validate(obj, CITY)
    assert any(set(obj) - set(CITY["properties"]) for obj in loose), "strict: false lets the same samples add keys"


def test_tool_arguments_are_strict_and_parallel_tool_calls_false_makes_one_call(oai):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city"]}}}
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    res = oai.chat.completions.create(model="tiny", messages=ask, tools=[tool], tool_choice="required", parallel_tool_calls=False, **{**SAMPLES, "max_tokens": 120})
    made = [c for c in res.choices if c.finish_reason == "tool_calls"]
    assert len(made) >= len(res.choices) // 2, [c.finish_reason for c in res.choices]
    for choice in made:
        calls = choice.message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
        args = json.loads(calls[0].function.arguments)
        jsonschema.validate(args, tool["function"]["parameters"])
        assert set(args) <= {"city", "days"}, args
    named = oai.chat.completions.create(model="tiny", messages=ask, tools=[tool], tool_choice={"type": "function", "function": {"name": "get_weather"}}, **SAMPLES)
    for choice in named.choices:
        if choice.finish_reason == "tool_calls":
            assert set(json.loads(choice.message.tool_calls[0].function.arguments)) <= {"city", "days"}


def test_strictness_is_an_option_per_request_and_per_tool():
    closed = SamplingParams.from_dict({"json_schema": CITY})
    assert json.loads(closed.json_schema)["additionalProperties"] is False
    assert json.loads(SamplingParams.from_dict({"json_schema": CITY, "json_schema_strict": False}).json_schema) == CITY
    with pytest.raises(ValueError, match="json_schema_strict must be a boolean"):
        SamplingParams.from_dict({"json_schema": CITY, "json_schema_strict": "no"})
    tool = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": CITY}})
    assert arguments_schema(tool)["additionalProperties"] is False
    loose = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": CITY, "strict": False}})
    assert arguments_schema(loose) == CITY


def test_an_unknown_format_is_reported_in_meta_info_and_a_keyword_nothing_enforces_is_refused(tiny_server):
    with httpx.Client(base_url=tiny_server.base_url, timeout=120) as c:
        schema = {"type": "object", "properties": {"v": {"type": "string", "format": "semver", "maxLength": 6}}, "required": ["v"]}
        r = c.post("/generate", json={"text": "version:", "sampling_params": {"json_schema": schema, "max_new_tokens": 30, "temperature": 0}})
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["constraint_warnings"] == ["format 'semver' at /properties/v is not enforced: the grammar backend does not know it"]
        unenforceable = {"type": "object", "properties": {"x": {"$dynamicRef": "#/$defs/y"}}}
        r = c.post("/generate", json={"text": "n:", "sampling_params": {"json_schema": unenforceable, "max_new_tokens": 8}})
        assert r.status_code == 400 and "'$dynamicRef' at /properties/x" in r.json()["message"], r.text
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": unenforceable}}
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "n?"}], "response_format": fmt, "max_tokens": 8})
        assert r.status_code == 400 and "$dynamicRef" in r.json()["message"] and r.json()["param"] == "response_format", r.text
        overlapping = {"type": "object", "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 5}]}}, "required": ["n"]}
        r = c.post("/generate", json={"text": "n:", "sampling_params": {"json_schema": overlapping, "max_new_tokens": 24, "temperature": 0}})
        assert r.status_code == 200, r.text  # enforced beside the grammar (tests/test_semantic_checks.py)
        jsonschema.validate(json.loads(r.json()["text"]), overlapping)


def test_openai_choices_carry_the_constraint_warnings_streamed_or_not(oai):
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": "semver", "maxLength": 6}}, "required": ["v"]}
    kw = dict(model="tiny", messages=[{"role": "user", "content": "version?"}], max_tokens=30, temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": schema}})
    want = ["format 'semver' at /properties/v is not enforced: the grammar backend does not know it"]
    assert oai.chat.completions.create(**kw).choices[0].model_extra["constraint_warnings"] == want
    finals = [c for chunk in oai.chat.completions.create(**kw, stream=True) for c in chunk.choices if c.finish_reason]
    assert [c.model_extra.get("constraint_warnings") for c in finals] == [want]
    assert "constraint_warnings" not in oai.chat.completions.create(**{**kw, "response_format": {"type": "json_object"}}).choices[0].model_extra


def test_auto_tool_arguments_get_the_schema_rewrites_and_their_warnings(oai):
    """The auto grammar embeds the arguments schemas in Lark (%json): they are rewritten too."""
    params = {
        "type": "object",
        "properties": {"v": {"type": "string", "format": "semver", "maxLength": 6}, "n": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}},
        "required": ["v", "n"],
    }
    tool = {"type": "function", "function": {"name": "bump", "parameters": params}}
    res = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Bump it."}], tools=[tool], max_tokens=40, temperature=0)
    assert res.choices[0].model_extra["constraint_warnings"] == ["format 'semver' at /properties/arguments/properties/v is not enforced: the grammar backend does not know it"]  # in the call
    overlapping = {**params, "properties": {**params["properties"], "n": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Bump it."}], tools=[{"type": "function", "function": {"name": "bump", "parameters": overlapping}}], max_tokens=8)
    assert err.value.body["param"] == "tools" and "oneOf" in err.value.body["message"]
