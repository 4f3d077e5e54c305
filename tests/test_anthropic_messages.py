"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official
``anthropic`` SDK, unmodified: messages, streams, forced and round-tripped tool calls, thinking,
token counts, errors in Anthropic's shape, the x-api-key header, and disconnects."""

from __future__ import annotations

import json
import socket
import time

import anthropic
import httpx
import jsonschema
import pytest

from helpers import API_KEY, ServerThread

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "age"]}

WEATHER = {
    "name": "get_weather",
    "description": "The weather forecast of a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
    },
}
TIME = {"name": "get_time", "description": "The time in a zone.", "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK (2.x) has no sampling arguments; the API still takes them
EVENTS = ("message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop")


@pytest.fixture(scope="module")
def client(tiny_server):
    return anthropic.Anthropic(base_url=tiny_server.base_url, api_key="unused", max_retries=0)


def _blocks(content) -> list[tuple]:
    """What a message's blocks say (streamed messages hold the SDK's parsed block classes)."""
    return [(b.type, getattr(b, "text", None), getattr(b, "thinking", None), getattr(b, "name", None), getattr(b, "input", None)) for b in content]


def _stats(tiny_client) -> dict:
    return tiny_client.get("/get_server_info").json()["stats"]


def _assert_clean(tiny_client) -> None:
    stats = _stats(tiny_client)
    assert stats["kv_invariant_holds"]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["running_slots"] == 0


def _raw_events(http: httpx.Client, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event of a streamed /v1/messages."""
    body = {**{k: v for k, v in body.items() if k != "extra_body"}, **body.get("extra_body", {})}
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}, headers=headers or {}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    events = []
    for chunk in text.split("\n\n"):
        if not chunk.strip():
            continue
        lines = chunk.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), chunk
        events.append((lines[0][len("event: ") :], json.loads(lines[1][len("data: ") :])))
    return events


def _check_order(events: list[tuple[str, dict]]) -> list[dict]:
    """Anthropic's event grammar; returns the content blocks the deltas build."""
    names = [n for n, _ in events]
    assert all(n == d["type"] for n, d in events), "each event is named by its data's type"
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"], names
    assert set(names) <= set(EVENTS)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    blocks: list[dict] = []
    open_index = None
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks), "blocks open in order, one at a time"
            open_index = data["index"]
            blocks.append({**data["content_block"], "_json": ""})
        elif name == "content_block_delta":
            assert data["index"] == open_index
            delta, block = data["delta"], blocks[open_index]
            kind = {"text_delta": "text", "input_json_delta": "tool_use", "thinking_delta": "thinking", "signature_delta": "thinking"}[delta["type"]]
            assert block["type"] == kind
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "input_json_delta":
                block["_json"] += delta["partial_json"]
        else:
            assert name == "content_block_stop" and data["index"] == open_index
            open_index = None
    assert open_index is None, "every block is closed before message_delta"
    final = events[-2][1]
    assert set(final["delta"]) == {"stop_reason", "stop_sequence"} and final["usage"]["output_tokens"] > 0
    return blocks


# ---------------------------------------------------------------- messages
def test_create_answers_a_message_with_usage_and_reads_the_radix_cache(client, tiny_client):
    messages = [{"role": "user", "content": "Radix trees share prefixes; caches reuse keys and values. " * 6}]
    first = client.messages.create(model="tiny", max_tokens=8, **GREEDY, messages=messages, system="Be brief.")
    assert first.type == "message" and first.role == "assistant" and first.model == "tiny" and first.id.startswith("msg_")
    assert first.stop_reason in ("end_turn", "max_tokens") and first.stop_sequence is None
    assert [b.type for b in first.content] in (["text"], [])
    assert 0 < first.usage.output_tokens <= 8 and first.usage.cache_creation_input_tokens == 0
    second = client.messages.create(model="tiny", max_tokens=8, **GREEDY, messages=messages, system="Be brief.")
    assert _blocks(second.content) == _blocks(first.content), "greedy decoding answers the same"
    total = client.messages.count_tokens(model="tiny", messages=messages, system="Be brief.").input_tokens
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == total
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total
    assert second.usage.cache_read_input_tokens > 0 and second.usage.cache_read_input_tokens >= total - 16, "the repeated prompt comes from the radix cache"
    _assert_clean(tiny_client)


def test_cache_control_hints_are_taken_where_anthropic_puts_them(client, tiny_client):
    ephemeral = {"type": "ephemeral", "ttl": "1h"}
    system = [{"type": "text", "text": "You are a weather bot. " * 4, "cache_control": ephemeral}]
    tools = [{**WEATHER, "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Paris?", "cache_control": {"type": "ephemeral"}}]}]
    res = client.messages.create(model="tiny", max_tokens=4, **GREEDY, system=system, tools=tools, messages=messages, cache_control={"type": "ephemeral"})
    again = client.messages.create(model="tiny", max_tokens=4, **GREEDY, system=system, tools=tools, messages=messages)
    assert res.type == again.type == "message" and again.usage.cache_read_input_tokens > 0
    _assert_clean(tiny_client)


def test_max_tokens_and_stop_sequence_stop_reasons(client, tiny_client):
    long = client.messages.create(model="tiny", max_tokens=24, **GREEDY, messages=ASK)
    text = long.content[0].text
    assert long.stop_reason == "max_tokens" or len(text) > 0
    stop = next((text[i : i + 3] for i in range(2, len(text) - 3) if text[i : i + 3].strip()), None)
    if stop is None:
        pytest.skip(f"the tiny model's answer is too short to pick a stop sequence from: {text!r}")
    res = client.messages.create(model="tiny", max_tokens=24, **GREEDY, messages=ASK, stop_sequences=["never-said", stop])
    assert res.stop_reason == "stop_sequence" and res.stop_sequence == stop
    assert (res.content[0].text if res.content else "") == text[: text.find(stop)]
    streamed = _raw_events(httpx.Client(base_url=str(client.base_url), timeout=120), {"model": "tiny", "max_tokens": 24, "temperature": 0, "messages": ASK, "stop_sequences": [stop]})
    assert streamed[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    _assert_clean(tiny_client)


def test_stream_final_message_matches_create(client, tiny_client):
    kw = dict(model="tiny", max_tokens=16, **GREEDY, messages=ASK)
    made = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == (made.content[0].text if made.content else "")
    assert _blocks(final.content) == _blocks(made.content) and final.stop_reason == made.stop_reason
    assert final.usage.output_tokens == made.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == made.usage.input_tokens + made.usage.cache_read_input_tokens
    _assert_clean(tiny_client)


def test_raw_sse_event_order(tiny_client):
    events = _raw_events(tiny_client, {"model": "tiny", "max_tokens": 12, "temperature": 0, "messages": ASK})
    blocks = _check_order(events)
    assert [b["type"] for b in blocks] in (["text"], [])
    assert events[-2][1]["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    _assert_clean(tiny_client)


# ---------------------------------------------------------------- tools
def test_forced_tool_choice_input_validates_against_its_schema(client, tiny_client):
    res = client.messages.create(model="tiny", max_tokens=200, **GREEDY, messages=ASK, tools=[WEATHER, TIME], tool_choice={"type": "tool", "name": "get_weather"})
    assert res.stop_reason == "tool_use"
    uses = [b for b in res.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    anyone = client.messages.create(model="tiny", max_tokens=200, **GREEDY, messages=ASK, tools=[WEATHER, TIME], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert anyone.stop_reason == "tool_use"
    calls = [b for b in anyone.content if b.type == "tool_use"]
    assert len(calls) == 1, "disable_parallel_tool_use: one call"
    schema = {t["name"]: t["input_schema"] for t in (WEATHER, TIME)}[calls[0].name]
    jsonschema.validate(calls[0].input, schema)
    _assert_clean(tiny_client)


def test_auto_tool_choice_answers_text_or_valid_calls_streamed_alike(client, tiny_client):
    kw = dict(model="tiny", max_tokens=160, **GREEDY, messages=ASK, tools=[WEATHER, TIME])
    made = client.messages.create(**kw)
    schemas = {t["name"]: t["input_schema"] for t in (WEATHER, TIME)}
    for block in made.content:
        if block.type == "tool_use":
            jsonschema.validate(block.input, schemas[block.name])
    assert (made.stop_reason == "tool_use") == any(b.type == "tool_use" for b in made.content) or made.stop_reason == "max_tokens"
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    if made.stop_reason != "max_tokens":  # a call cut by max_tokens: the stream has sent its start
        assert _blocks(final.content) == _blocks(made.content) and final.stop_reason == made.stop_reason
    _assert_clean(tiny_client)


def test_streamed_tool_use_builds_the_same_input(client, tiny_client):
    kw = dict(model="tiny", max_tokens=200, **GREEDY, messages=ASK, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    made = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert _blocks(final.content) == _blocks(made.content)
    jsonschema.validate(final.content[0].input, WEATHER["input_schema"])
    events = _raw_events(httpx.Client(base_url=str(client.base_url), timeout=120), {**kw})
    blocks = _check_order(events)
    assert [b["type"] for b in blocks] == ["tool_use"] and json.loads(blocks[0]["_json"]) == made.content[0].input
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    _assert_clean(tiny_client)


def test_output_config_format_constrains_the_answer_to_its_schema(client, tiny_client):
    res = client.messages.create(model="tiny", max_tokens=120, **GREEDY, messages=[{"role": "user", "content": "Invent a person."}], output_config={"format": {"type": "json_schema", "schema": PERSON}})
    assert [b.type for b in res.content] == ["text"] and res.stop_reason == "end_turn"
    jsonschema.validate(json.loads(res.content[0].text), PERSON)
    _assert_clean(tiny_client)


def test_tool_choice_none_forbids_calls(client, tiny_client):
    res = client.messages.create(model="tiny", max_tokens=24, **GREEDY, messages=ASK, tools=[WEATHER], tool_choice={"type": "none"})
    assert all(b.type == "text" for b in res.content) and res.stop_reason != "tool_use"
    _assert_clean(tiny_client)


def test_tool_use_then_tool_result_round_trip(client, tiny_client):
    kw = dict(model="tiny", max_tokens=200, **GREEDY, tools=[WEATHER])
    call = client.messages.create(messages=ASK, tool_choice={"type": "tool", "name": "get_weather"}, **kw)
    use = next(b for b in call.content if b.type == "tool_use")
    conversation = [
        *ASK,
        {"role": "assistant", "content": call.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 C."}, {"type": "text", "text": "Summarize."}]},
    ]
    answer = client.messages.create(messages=conversation, tool_choice={"type": "none"}, **{**kw, "max_tokens": 12})
    assert answer.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in answer.content)
    counted = client.messages.count_tokens(model="tiny", messages=conversation, tools=[WEATHER])
    assert counted.input_tokens > client.messages.count_tokens(model="tiny", messages=ASK, tools=[WEATHER]).input_tokens
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(messages=[*conversation[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}], **kw)
    assert "messages.2.content.0.tool_use_id" in exc.value.body["error"]["message"], "an answer to no call is refused, naming the field"
    _assert_clean(tiny_client)


# ---------------------------------------------------------------- errors
BAD = [
    ({"model": "tiny", "messages": ASK}, "max_tokens"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"model": "tiny", "max_tokens": 4, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_time"}}, "tool_choice.name"),
    ({"model": "tiny", "max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"model": "tiny", "max_tokens": 0, "messages": ASK}, "max_tokens"),
    ({"model": "tiny", "max_tokens": 4, "messages": ASK, "temperature": 1.5}, "temperature"),
    ({"model": "tiny", "max_tokens": 4, "messages": ASK, "container": "c"}, "container"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"model": "tiny", "max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": "The"}]}, "messages.1.role"),
    ({"model": "tiny", "max_tokens": 4, "messages": ASK, "tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, "tools.0.input_schema"),
    ({"model": "tiny", "max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 2}}, "thinking"),
    ({"model": "tiny", "max_tokens": 10**7, "messages": ASK}, "max_tokens"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text: Field required"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages.0.content.0: Input tag 'video'"),
    ({"model": "tiny", "max_tokens": 4, "messages": ASK, "tools": [WEATHER, WEATHER]}, "tools.1.name"),
    ({"model": "tiny", "max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"model": "tiny", "max_tokens": 4, "messages": ASK, "tool_choice": {"type": "auto", "name": "get_weather"}}, "tool_choice.name"),
]


@pytest.mark.parametrize(("body", "field"), BAD, ids=[f.split(":")[0] for _, f in BAD])
def test_bad_input_is_a_400_in_anthropics_shape_naming_the_field(tiny_client, body, field):
    r = tiny_client.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert set(err) == {"type", "error"} and err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["message"].startswith(field), err


def test_sdk_raises_its_errors_and_other_routes_keep_their_shape(client, tiny_client):
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "robot", "content": "x"}])
    assert exc.value.status_code == 400 and exc.value.body["error"]["message"].startswith("messages.0.role")
    r = tiny_client.post("/v1/messages/count_tokens", json={"model": "tiny"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages")
    r = tiny_client.post("/v1/messages", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error" and "malformed JSON" in r.json()["error"]["message"]
    r = tiny_client.get("/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    r = tiny_client.post("/v1/messages/batches", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = tiny_client.post("/v1/chat/completions", json={"model": "tiny"})
    assert r.status_code == 400 and r.json()["object"] == "error", "the OpenAI routes keep the OpenAI shape"
    _assert_clean(tiny_client)


# ---------------------------------------------------------------- keys, disconnects
def test_x_api_key_is_accepted_and_a_wrong_one_refused(keyed_server):
    url = keyed_server.base_url
    ok = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0)
    assert ok.messages.create(model="tiny", max_tokens=2, messages=ASK).type == "message"
    assert ok.messages.count_tokens(model="tiny", messages=ASK).input_tokens > 0
    for headers in ({"x-api-key": "wrong"}, {}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url + "/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": ASK}, headers=headers)
        assert r.status_code == 401 and r.json() == {"type": "error", "error": {"type": "authentication_error", "message": r.json()["error"]["message"]}}, r.text
        assert "x-api-key" in r.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(model="tiny", max_tokens=2, messages=ASK)
    assert httpx.get(url + "/v1/models", headers={"x-api-key": API_KEY}).status_code == 200, "the header opens the other routes too"
    r = httpx.get(url + "/v1/models", headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["object"] == "error", "other routes keep the OpenAI shape"


def test_client_disconnecting_mid_stream_aborts_its_request(tiny_client, tiny_server):
    # greedy: a sampled first token of the random tiny model was once its end token (CI, stop 56)
    body = json.dumps({"model": "tiny", "max_tokens": 2000, "messages": ASK, "stream": True, "temperature": 0}).encode()
    sock = socket.create_connection(("127.0.0.1", tiny_server.port))
    sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    received = b""
    while b"content_block_delta" not in received and b"message_stop" not in received:  # streaming has started
        chunk = sock.recv(4096)
        assert chunk, "the server closed the stream"
        received += chunk
    assert b"message_stop" not in received, "the request ended before the client left"
    before = _stats(tiny_client)["forward_passes"]
    sock.close()
    for _ in range(300):
        stats = _stats(tiny_client)
        if stats["num_running"] == 0:
            break
        time.sleep(0.02)
    assert stats["num_running"] == 0 and stats["running_slots"] == 0
    assert stats["forward_passes"] - before <= 100, "the aborted request kept decoding"
    _assert_clean(tiny_client)


# ---------------------------------------------------------------- thinking (and browsers)
APP_ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def thinker(thinker_model):
    """An Anthropic client of an in-process server whose tiny model's template opens a reasoning section."""
    from radixlm.runtime.engine import Engine
    from radixlm.runtime.entrypoints.http.server import create_app

    engine = Engine(model_path=thinker_model, max_total_tokens=4096)
    server = ServerThread(create_app(engine, served_model_name="thinker", allowed_origins=[APP_ORIGIN])).start()
    yield anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0), server.url
    server.stop()
    engine.shutdown()


def test_thinking_blocks_come_first_streamed_or_not(thinker):
    client, url = thinker
    kw = dict(model="thinker", max_tokens=40, **GREEDY, messages=ASK, thinking={"type": "enabled", "budget_tokens": 6})
    made = client.messages.create(**kw)
    assert made.content[0].type == "thinking" and made.content[0].thinking and "</think>" not in made.content[0].thinking
    assert all(b.type == "text" for b in made.content[1:]) and made.content[0].signature == ""
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert _blocks(final.content) == _blocks(made.content)
    with httpx.Client(base_url=url, timeout=120) as http:
        blocks = _check_order(_raw_events(http, kw))
    assert blocks[0]["type"] == "thinking" and blocks[0]["thinking"] == made.content[0].thinking
    forced = client.messages.create(**{**kw, "max_tokens": 200}, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert forced.content[0].type == "thinking" and forced.content[-1].type == "tool_use" and forced.stop_reason == "tool_use"
    jsonschema.validate(forced.content[-1].input, WEATHER["input_schema"])
    omitted = client.messages.create(**{**kw, "thinking": {"type": "enabled", "budget_tokens": 6, "display": "omitted"}})
    assert omitted.content[0].type == "thinking" and omitted.content[0].thinking == "" and _blocks(omitted.content[1:]) == _blocks(made.content[1:])
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(**{**kw, "thinking": {"type": "enabled", "budget_tokens": 40}})
    assert exc.value.body["error"]["message"].startswith("thinking.budget_tokens")


def test_browsers_may_send_x_api_key_only_from_allowed_origins(thinker):
    _, url = thinker
    ask = {"origin": APP_ORIGIN, "access-control-request-method": "POST", "access-control-request-headers": "content-type,x-api-key,anthropic-version"}
    ok = httpx.options(url + "/v1/messages", headers=ask)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == APP_ORIGIN
    assert {"x-api-key", "anthropic-version"} <= {h.strip().lower() for h in ok.headers["access-control-allow-headers"].split(",")}
    evil = httpx.options(url + "/v1/messages", headers={**ask, "origin": "https://evil.example"})
    assert "access-control-allow-origin" not in evil.headers
    body = {"model": "thinker", "max_tokens": 2, "messages": ASK}
    r = httpx.post(url + "/v1/messages", json=body, headers={"origin": "https://evil.example", "x-api-key": "k"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
    r = httpx.post(url + "/v1/messages", content=json.dumps(body), headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_cases_generated_from_the_openapi_document_get_no_5xx_and_anthropic_shaped_4xx(tiny_server, tiny_client):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    ops = schemathesis.openapi.from_url(tiny_server.base_url + "/openapi.json").include(path_regex="^/v1/messages")
    failures: list[str] = []
    for result in ops.get_all_operations():
        operation = result.ok()

        @settings(max_examples=60, derandomize=True, deadline=None, phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck), database=None)
        @given(case=st.one_of(operation.as_strategy(schemathesis.GenerationMode.POSITIVE), operation.as_strategy(schemathesis.GenerationMode.NEGATIVE)))
        def check(case) -> None:
            if isinstance(case.body, dict) and "max_tokens" in case.body:
                case.body["max_tokens"] = 2  # this hunts errors, not output
            r = case.call(base_url=tiny_server.base_url, timeout=120)
            if r.status_code >= 500 or (r.status_code >= 400 and r.json().get("type") != "error"):
                failures.append(f"{case.operation.path} {r.status_code} {case.body!r:.300} -> {r.text[:200]}")

        check()
    assert not failures, "\n".join(failures[:20])
    _assert_clean(tiny_client)
