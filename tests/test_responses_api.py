"""OpenAI's Responses API against ``radixlm serve`` with the official ``openai`` SDK, unmodified:
blocking and streamed answers, function tools, ``previous_response_id`` over the radix cache,
the store (retrieve, delete, tenants, eviction), JSON-schema output, bad input and disconnects.
Every scenario ends with the KV accounting checked."""

from __future__ import annotations

import json
import socket
import time
import uuid

import httpx
import jsonschema
import openai
import pytest
from conftest import RESPONSES_STORED

from helpers import API_KEY
from radixlm.runtime.entrypoints.responses.store import ResponseStore

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current temperature of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"enum": [1, 2, 3]}}, "required": ["city", "days"]},
    "strict": True,
}


@pytest.fixture(scope="module")
def client(responses_server):
    return openai.OpenAI(base_url=responses_server.base_url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(responses_server):
    with httpx.Client(base_url=responses_server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def _assert_clean(http: httpx.Client) -> None:
    """Nothing runs, nothing waits, every KV slot is accounted for (free, in the tree, or held)."""
    deadline = time.monotonic() + 30
    while True:
        stats = http.get("/get_server_info").json()["stats"]
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["running_slots"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, stats
    assert stats["kv_invariant_holds"], stats


@pytest.fixture(autouse=True)
def kv_clean(http):
    """Every scenario ends with the KV accounting checked."""
    yield
    _assert_clean(http)


def _fresh(text: str) -> str:
    """A prompt no earlier test sent (so cache hits come from this test alone)."""
    return f"{text} [{uuid.uuid4().hex[:8]}]"


def _events(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events))), "sequence numbers count up from 0"
    return events


# ------------------------------------------------------------------ answers
def test_create_blocking_and_streamed_give_the_same_answer(client):
    kw = dict(model="tiny", input="The quick brown", instructions="Be brief.", max_output_tokens=8, **GREEDY)
    full = client.responses.create(**kw)
    assert full.object == "response" and full.status == "incomplete" and full.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in full.output] == ["message"] and full.output_text
    assert full.usage.output_tokens == 8 and full.usage.input_tokens > 0 and full.instructions == "Be brief."
    events = _events(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1].response
    assert deltas == full.output_text == last.output_text
    assert events[0].response.id == last.id and last.usage.output_tokens == 8
    assert client.responses.retrieve(last.id).output_text == deltas, "a streamed response is stored as it ended"


def test_the_sdk_stream_helper_assembles_the_events(client):
    named = {"type": "function", "name": "get_weather"}
    with client.responses.stream(model="tiny", input="Weather in Oslo?", tools=[WEATHER], tool_choice=named, max_output_tokens=60, temperature=0) as stream:
        pieces = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()  # needs response.completed: the call closed within the budget
    assert final.status == "completed" and final.output[0].arguments == pieces
    jsonschema.validate(json.loads(pieces), WEATHER["parameters"])


# ------------------------------------------------------------------ tools
def test_function_tool_round_trip_with_function_call_output(client):
    ask = _fresh("How warm is Paris?")
    first = client.responses.create(model="tiny", input=ask, tools=[WEATHER], tool_choice="required", max_output_tokens=60, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    call = calls[0]
    args = json.loads(call.arguments)  # valid by construction: the tool's strict schema
    jsonschema.validate(args, WEATHER["parameters"])
    assert set(args) <= {"city", "days"} and call.name == "get_weather" and call.call_id.startswith("call_")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"celsius": 21})}
    chained = client.responses.create(model="tiny", previous_response_id=first.id, input=[result], tools=[WEATHER], max_output_tokens=6, **GREEDY)
    # ignore_eos keeps generating past EOS, but the chat template's end-of-turn token still ends a turn
    assert chained.output[0].type in ("message", "function_call") and chained.usage.output_tokens <= 6
    assert (chained.status == "incomplete") == (chained.incomplete_details is not None and chained.incomplete_details.reason == "max_output_tokens")
    assert chained.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # the same conversation sent whole (as a stateless client would): the same prompt
    whole = [{"role": "user", "content": ask}, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}, result]
    stateless = client.responses.create(model="tiny", input=whole, tools=[WEATHER], max_output_tokens=6, **GREEDY)
    assert stateless.usage.input_tokens == chained.usage.input_tokens
    assert stateless.output_text == chained.output_text


def test_streamed_function_call_arguments_assemble_to_the_done_event(client):
    named = {"type": "function", "name": "get_weather"}
    events = _events(client.responses.create(model="tiny", input="Weather in Rome?", tools=[WEATHER], tool_choice=named, max_output_tokens=60, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert pieces == done.arguments == events[-1].response.output[0].arguments
    jsonschema.validate(json.loads(pieces), WEATHER["parameters"])
    assert events[-1].response.output[0].call_id == added.item.call_id


# ------------------------------------------------------------------ the store
def test_previous_response_id_continues_from_the_cached_prefix(client):
    first = client.responses.create(model="tiny", input=_fresh("Once upon a time"), max_output_tokens=8, **GREEDY)
    second = client.responses.create(model="tiny", input="And then?", previous_response_id=first.id, max_output_tokens=8, **GREEDY)
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens > 0, "the previous prompt is already in the radix tree"
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + 4, "the continuation carries the previous turn"
    third = client.responses.create(model="tiny", input="The end.", previous_response_id=second.id, max_output_tokens=4, **GREEDY)
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens


def test_input_items_list_every_item_that_led_to_a_response_newest_first(client):
    first = client.responses.create(model="tiny", input=_fresh("Once upon a time"), instructions="Be brief.", max_output_tokens=4, **GREEDY)
    second = client.responses.create(model="tiny", input=[{"role": "user", "content": [{"type": "input_text", "text": "And then?"}]}], previous_response_id=first.id, max_output_tokens=4, **GREEDY)
    listed = client.responses.input_items.list(second.id)
    kinds = [(item.type, getattr(item, "role", None)) for item in listed.data]
    assert kinds == [("message", "user"), ("message", "assistant"), ("message", "user")], "newest first: this input, the answer before, the first input"
    assert listed.data[1].id == first.output[0].id and listed.data[1].content[0].text == first.output_text
    assert listed.data[0].content[0].text == "And then?" and listed.data[2].content[0].type == "input_text"
    assert all(item.id for item in listed.data) and not listed.has_more
    oldest = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert [i.id for i in oldest.data] == [listed.data[2].id] and oldest.has_more
    rest = client.responses.input_items.list(second.id, order="asc", after=oldest.data[0].id)
    assert [i.id for i in rest.data] == [listed.data[1].id, listed.data[0].id]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.input_items.list(second.id, limit=0)
    assert err.value.param == "limit"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")


def test_store_false_keeps_nothing(client):
    gone = client.responses.create(model="tiny", input="not kept", store=False, max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="tiny", input="x", previous_response_id=gone.id, max_output_tokens=2)
    assert err.value.param == "previous_response_id"


def test_retrieve_and_delete(client):
    made = client.responses.create(model="tiny", input="keep me", metadata={"run": "7"}, max_output_tokens=3, **GREEDY)
    got = client.responses.retrieve(made.id)
    assert got.id == made.id and got.output_text == made.output_text and got.metadata == {"run": "7"}
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(made.id)


def test_another_tenant_can_neither_read_continue_from_nor_delete_a_response(client, responses_server):
    alice, bob = uuid.uuid4().hex, uuid.uuid4().hex
    as_alice = openai.OpenAI(base_url=responses_server.base_url + "/v1", api_key=API_KEY, max_retries=0, default_headers={"X-Cache-Salt": alice})
    as_bob = openai.OpenAI(base_url=responses_server.base_url + "/v1", api_key=API_KEY, max_retries=0, default_headers={"X-Cache-Salt": bob})
    made = client.responses.create(model="tiny", input="alice's secret", max_output_tokens=3, extra_body={"cache_salt": alice})
    for other in (as_bob, client):  # another salt, and the shared tenant of requests without one
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError) as err:
            other.responses.create(model="tiny", input="go on", previous_response_id=made.id, max_output_tokens=2)
        assert err.value.param == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            other.responses.input_items.list(made.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(made.id)
    assert as_alice.responses.retrieve(made.id).id == made.id, "the owner still has it"
    chained = as_alice.responses.create(model="tiny", input="go on", previous_response_id=made.id, max_output_tokens=2)
    assert chained.previous_response_id == made.id
    with pytest.raises(openai.BadRequestError) as err:
        as_alice.responses.create(model="tiny", input="x", max_output_tokens=2, extra_body={"cache_salt": bob})
    assert err.value.param == "cache_salt"


def test_the_store_evicts_the_least_recently_used_when_full(client):
    ids = [client.responses.create(model="tiny", input=f"r{i}", max_output_tokens=1).id for i in range(RESPONSES_STORED)]
    client.responses.retrieve(ids[0])  # now the most recently used: ids[1] goes first
    extra = client.responses.create(model="tiny", input="one more", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    for kept in (ids[0], *ids[2:], extra.id):
        assert client.responses.retrieve(kept).id == kept


def test_the_store_is_bounded_in_bytes_too():
    store = ResponseStore(max_count=100, max_bytes=3000)
    body = {"id": "x", "output": [{"text": "a" * 900}]}
    for i in range(5):
        assert store.put("t", f"r{i}", {**body, "id": f"r{i}"}, [])
    assert store.bytes <= 3000 and len(store) == 3 and store.get("t", "r0") is None and store.get("t", "r4") is not None
    assert not store.put("t", "huge", {"output": "a" * 5000}, []), "one response larger than the store is not kept"
    assert store.get("u", "r4") is None, "another tenant's id is absent"
    assert not store.delete("u", "r4") and store.delete("t", "r4") and store.get("t", "r4") is None


# ------------------------------------------------------------------ formats, bad input
def test_text_format_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}, "required": ["name", "age"]}
    res = client.responses.create(model="tiny", input="Invent a person.", text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}}, max_output_tokens=80, temperature=0)
    jsonschema.validate(json.loads(res.output_text), schema)
    assert res.text.format.type == "json_schema" and res.status == "completed"


BAD_INPUTS = [
    ({"model": "tiny"}, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input.0.content.0.type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}, "text.format"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "x", "temperature": 5}, "temperature"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "stream": "yes"}, "stream"),
]


@pytest.mark.parametrize(("body", "param"), BAD_INPUTS, ids=[p for _, p in BAD_INPUTS])
def test_bad_input_is_a_400_naming_the_field(http, body, param):
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["param"] == param and err["object"] == "error" and err["message"], err


def test_the_sdk_reads_the_field_of_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input=[{"type": "function_call_output", "output": "x"}])
    assert err.value.param == "input.0.call_id"


def test_the_routes_need_the_api_key(responses_server):
    base = responses_server.base_url
    assert httpx.post(base + "/v1/responses", json={"input": "x"}).status_code == 401
    assert httpx.get(base + "/v1/responses/resp_x").status_code == 401
    assert httpx.delete(base + "/v1/responses/resp_x").status_code == 401


def test_cases_generated_from_the_openapi_document_get_no_5xx(responses_server):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    auth = {"Authorization": f"Bearer {API_KEY}"}
    schema = schemathesis.openapi.from_url(responses_server.base_url + "/openapi.json", headers=auth)
    failures: list[str] = []
    for result in schema.include(path_regex="^/v1/responses").get_all_operations():
        operation = result.ok()

        @settings(max_examples=30, derandomize=True, deadline=None, phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck), database=None)
        @given(case=st.one_of(operation.as_strategy(schemathesis.GenerationMode.POSITIVE), operation.as_strategy(schemathesis.GenerationMode.NEGATIVE)))
        def check(case) -> None:
            if isinstance(case.body, dict):  # short generations: this hunts errors, not output
                case.body["max_output_tokens"] = 2
            r = case.call(base_url=responses_server.base_url, headers=auth, timeout=60)
            if r.status_code >= 500:
                failures.append(f"{case.method} {case.operation.path} {r.status_code} {case.body!r:.300} -> {r.text[:200]}")

        check()
    assert not failures, "\n".join(failures[:10])


# ------------------------------------------------------------------ disconnects
def test_a_client_that_leaves_mid_stream_aborts_its_request(http, responses_server):
    body = json.dumps({"model": "tiny", "input": "Once upon a time", "max_output_tokens": 2000, "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", responses_server.port))
    head = f"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    received = b""
    while b"response.output_text.delta" not in received:  # generating
        chunk = sock.recv(4096)
        assert chunk, "the server closed the stream"
        received += chunk
    created = json.loads(next(line for line in received.decode(errors="replace").split("\n") if line.startswith("data: ") and "response.created" in line)[6:])
    before = http.get("/get_server_info").json()["stats"]["forward_passes"]
    sock.close()
    deadline = time.monotonic() + 30
    while (stats := http.get("/get_server_info").json()["stats"])["num_running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stats["num_running"] == 0 and stats["running_slots"] == 0
    assert stats["forward_passes"] - before <= 200, "the aborted request kept decoding"
    assert http.get(f"/v1/responses/{created['response']['id']}").status_code == 404, "an unfinished response is not stored"


# ------------------------------------------------------------------ reasoning models
def test_a_thinking_model_answers_with_a_reasoning_item_then_its_constrained_message(thinker_url):
    thinker = openai.OpenAI(base_url=thinker_url + "/v1", api_key="unused", max_retries=0)
    schema = {"type": "object", "properties": {"age": {"enum": [1, 2, 3]}}, "required": ["age"]}
    kw = dict(model="thinker", input="Invent a person.", text={"format": {"type": "json_schema", "name": "p", "schema": schema}}, max_output_tokens=60, temperature=0, extra_body={"max_reasoning_tokens": 5})
    res = thinker.responses.create(**kw)
    assert [item.type for item in res.output] == ["reasoning", "message"], res.output
    assert res.output[0].content[0].type == "reasoning_text" and res.output[0].content[0].text
    assert 0 < res.usage.output_tokens_details.reasoning_tokens < res.usage.output_tokens
    jsonschema.validate(json.loads(res.output_text), schema)
    events = _events(thinker.responses.create(stream=True, **kw))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == res.output[0].content[0].text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == res.output_text
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
    # a client may send the reasoning item back with the rest of the conversation
    items = [{"role": "user", "content": "Invent a person."}, *(item.model_dump(exclude_none=True) for item in res.output), {"role": "user", "content": "Another."}]
    assert thinker.responses.create(model="thinker", input=items, max_output_tokens=4, temperature=0).status == "incomplete"
    with httpx.Client(base_url=thinker_url, timeout=60) as c:
        _assert_clean(c)


# ------------------------------------------------------------------ the event stream, unit
def test_streamed_text_then_calls_become_a_message_then_function_call_items():
    import asyncio

    from radixlm.runtime.entrypoints.openai.plan import Plan
    from radixlm.runtime.entrypoints.responses.plan import ResponsePlan
    from radixlm.runtime.entrypoints.responses.protocol import ResponsesRequest
    from radixlm.runtime.entrypoints.responses.streaming import response_events

    def delta(d: dict, finish: str | None = None) -> dict:
        return {"choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]}

    def opening(i: int, call_id: str, name: str) -> dict:
        return delta({"tool_calls": [{"index": i, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}]})

    def args(i: int, piece: str) -> dict:
        return delta({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})

    chunks = [delta({"role": "assistant", "content": ""}), delta({"content": "Let me "}), delta({"content": "check."}), opening(0, "call_a", "f"), args(0, '{"x":'), args(0, " 1}"), opening(1, "call_b", "g"), args(1, "{}"), delta({}, "tool_calls")]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 2}}})

    async def source():
        for chunk in chunks:
            yield chunk

    async def collect() -> list:
        return [e async for e in response_events(rp, source(), stored.append, None)]

    rp = ResponsePlan(Plan(True, "tiny", [[1]], ["x"], {}, 1, True, True, None, id="resp_1"), ResponsesRequest(input="x", stream=True), None, [])
    stored: list = []
    events = asyncio.run(collect())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    final = events[-1]["response"]
    assert [(i["type"], i.get("call_id"), i.get("arguments")) for i in final["output"]] == [("message", None, None), ("function_call", "call_a", '{"x": 1}'), ("function_call", "call_b", "{}")]
    assert final["output"][0]["content"][0]["text"] == "Let me check." and final["usage"]["input_tokens_details"]["cached_tokens"] == 2
    assert stored == [final], "the finished response is handed over to be stored"
