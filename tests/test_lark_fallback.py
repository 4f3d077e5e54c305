"""Under --grammar-backend outlines, Lark grammars (tool_choice "auto", ebnf, reasoning sections)
are compiled by llguidance instead of being refused per request."""

from __future__ import annotations

import json

import openai
import pytest

from helpers import ServerThread
from radixlm.runtime.constrained.llguidance_backend import LLGuidanceGrammar
from radixlm.runtime.constrained.outlines_backend import OutlinesGrammar

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def outlines_engine(tiny_llama):
    from radixlm.runtime.engine import Engine

    engine = Engine(model_path=tiny_llama, max_total_tokens=2048, grammar_backend="outlines")
    yield engine
    engine.shutdown()


def test_outlines_keeps_regex_and_schema_and_hands_ebnf_to_llguidance(outlines_engine):
    grammars = outlines_engine.grammars
    assert isinstance(grammars.compile("regex", "[0-9]{3}"), OutlinesGrammar)
    assert isinstance(grammars.compile("json_schema", json.dumps({"type": "integer"})), OutlinesGrammar)
    assert isinstance(grammars.compile("ebnf", 'start: "yes" | "no"'), LLGuidanceGrammar)
    out = outlines_engine.generate("Answer:", {"ebnf": 'start: "yes" | "no"', "max_new_tokens": 4, "temperature": 1.0})
    assert out["text"] in ("yes", "no")
    outlines_engine.check_accounting()


def test_tool_choice_auto_works_on_the_outlines_backend(outlines_engine):
    from radixlm.runtime.entrypoints.http.server import create_app

    server = ServerThread(create_app(outlines_engine, served_model_name="tiny")).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        res = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER], max_tokens=60, temperature=1.0, seed=3, n=6)
        for choice in res.choices:
            for call in choice.message.tool_calls or []:  # a call the model opened is a valid one
                assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
            assert "<tool_call>" not in (choice.message.content or "") or choice.finish_reason == "length"
    finally:
        server.stop()
    outlines_engine.check_accounting()
