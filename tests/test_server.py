"""The HTTP server as a real subprocess: native and OpenAI routes, bad input, disconnects, drain."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from helpers import API_KEY, ServerProcess


@pytest.fixture(scope="module")
def oai(tiny_server):
    return openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="unused")


def _stats(tiny_client) -> dict:
    return tiny_client.get("/get_server_info").json()["stats"]


def _assert_clean(tiny_client) -> None:
    stats = _stats(tiny_client)
    assert stats["kv_invariant_holds"]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["running_slots"] == 0


GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_server_info_reports_the_kv_cache_dtype_and_its_bytes_per_token(tiny_client):
    info = tiny_client.get("/get_server_info").json()
    assert info["kv_cache_dtype"] == "auto"  # the option as given
    assert info["stats"]["kv_cache_dtype"] == "float32"  # what auto resolved to on this CPU
    assert info["stats"]["kv_bytes_per_token"] > 0


def test_native_generate_single_batch_and_stream(tiny_client):
    one = tiny_client.post("/generate", json={"text": "The quick brown", "sampling_params": GREEDY}).json()
    assert len(one["output_ids"]) == 6 and one["meta_info"]["finish_reason"]["type"] == "length"
    batch = tiny_client.post("/generate", json={"text": ["The quick brown", "Radix"], "sampling_params": GREEDY}).json()
    assert batch[0]["output_ids"] == one["output_ids"] and len(batch) == 2
    ids = tiny_client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": GREEDY, "rid": "my-id"}).json()
    assert ids["meta_info"]["id"] == "my-id"
    with tiny_client.stream("POST", "/generate", json={"text": "The quick brown", "sampling_params": GREEDY, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["output_ids"] == one["output_ids"] and chunks[-1]["text"] == one["text"]
    _assert_clean(tiny_client)


def test_prefill_only_request_returns_prompt_logprobs(tiny_client):
    out = tiny_client.post("/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0}).json()
    assert out["output_ids"] == []
    lps = out["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in lps] == [5, 6, 7, 8] and lps[0][0] is None and all(t[0] <= 0 for t in lps[1:])


def test_openai_completions_with_n_stop_and_logprobs(oai):
    res = oai.completions.create(model="tiny", prompt="The quick brown", max_tokens=8, temperature=0, n=2, logprobs=2, extra_body={"ignore_eos": True})
    assert len(res.choices) == 2 and res.choices[0].text == res.choices[1].text
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == res.usage.completion_tokens // 2 == 8
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    text = res.choices[0].text
    # 8 tokens of a byte-level BPE decode to at least 4 characters unless most are partial bytes
    assert len(text) >= 4, text
    stop = text[2:4]
    cut = oai.completions.create(model="tiny", prompt="The quick brown", max_tokens=8, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert len(cut.choices[0].text) < len(text)


def test_openai_chat_stream_with_usage_and_cached_tokens(oai):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    full = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True})
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == full.choices[0].message.content and finish == "length"
    assert usage.completion_tokens == 6 and usage.prompt_tokens_details.cached_tokens > 0


def test_chat_logprobs_and_seed(oai):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=1.0, seed=7)
    a = oai.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
    b = oai.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    content = a.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)


def test_models_health_and_info_routes(tiny_client):
    assert tiny_client.get("/health").status_code == 200
    assert tiny_client.get("/health_generate").status_code == 200
    models = tiny_client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny"
    info = tiny_client.get("/get_model_info").json()
    assert info["architecture"] == "llama" and info["context_length"] == 4096


def test_metrics_scrape_counts_requests_and_tokens(tiny_client):
    tiny_client.post("/generate", json={"text": "metrics", "sampling_params": GREEDY})
    text = tiny_client.get("/metrics").text
    for name in ("radixlm_num_running_requests", "radixlm_prompt_tokens_total", "radixlm_generation_tokens_total", "radixlm_cached_tokens_total", "radixlm_kv_cache_usage_ratio", "radixlm_time_to_first_token_seconds_bucket", "radixlm_inter_token_latency_seconds_bucket", "radixlm_e2e_request_latency_seconds_bucket"):
        assert name in text, name
    gen = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("radixlm_generation_tokens_total"))
    assert gen >= 6


def test_flush_cache_and_abort_request(tiny_client):
    tiny_client.post("/generate", json={"text": "flush me", "sampling_params": GREEDY})
    assert _stats(tiny_client)["tree_slots"] > 0
    assert tiny_client.post("/flush_cache").status_code == 200
    assert _stats(tiny_client)["tree_slots"] == 0
    assert tiny_client.post("/abort_request", json={"rid": "nobody"}).json()["aborted"] is False
    assert tiny_client.post("/abort_request", json={"rid": 3}).status_code == 400


LONG = "word " * 4200
BAD_INPUTS = [
    ("/generate", {"text": "x", "sampling_params": {"top_k": 2.5}}, "top_k"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ("/generate", {"text": "x", "sampling_params": {"bogus": 1}}, "bogus"),
    ("/generate", {"text": "x", "sampling_params": {"top_p": 0}}, "top_p"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "(unclosed"}}, "regex"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{not json"}}, "json"),
    ("/generate", {"text": "", "sampling_params": {}}, "prompt"),
    ("/generate", {"input_ids": [1, 10**9]}, "input_ids"),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {"text": "x", "input_ids": [1]}, "exactly one"),
    ("/generate", {"text": "x", "top_logprobs_num": -1}, "top_logprobs_num"),
    ("/generate", {"text": "x", "unknown_field": 1}, "unknown_field"),
    ("/generate", {"text": LONG}, "context length"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "top_k": 1.5}, "top_k"),
    ("/v1/completions", {"prompt": "x", "n": 1000}, "n"),
    ("/v1/completions", {"prompt": "x", "temperature": 5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": LONG}, "maximum context length"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10000}, "maximum context length"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "x", "regex": "[a-"}, "regex"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": "ten"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, "json_schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#/nowhere"}}}}, "$ref"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": [1, 2]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, "presence_penalty"),
]


@pytest.mark.parametrize("path, body, needle", BAD_INPUTS, ids=[f"{i}-{p.rsplit('/', 1)[-1]}-{n}" for i, (p, _, n) in enumerate(BAD_INPUTS)])
def test_bad_input_is_a_4xx_with_a_useful_message(tiny_client, path, body, needle):
    r = tiny_client.post(path, json=body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()
    assert err["object"] == "error" and needle.lower() in (err["message"] + str(err.get("param"))).lower(), err


def test_malformed_and_huge_bodies(tiny_client):
    r = tiny_client.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["message"]
    r = tiny_client.post("/generate", content=b"x" * (17 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_the_server_still_serves_and_leaks_nothing_after_bad_input(tiny_client):
    for path, body, _ in BAD_INPUTS:
        tiny_client.post(path, json=body)
    assert tiny_client.post("/generate", json={"text": "still alive", "sampling_params": GREEDY}).status_code == 200
    _assert_clean(tiny_client)


def test_streaming_client_disconnect_aborts_within_a_step(tiny_client, tiny_server):
    body = json.dumps({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", tiny_server.port))
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    received = b""
    while b"data: " not in received:  # wait until streaming has started
        chunk = sock.recv(4096)
        assert chunk, "the server closed the stream"
        received += chunk
    before = _stats(tiny_client)["forward_passes"]
    sock.close()
    for _ in range(200):
        stats = _stats(tiny_client)
        if stats["num_running"] == 0:
            break
        time.sleep(0.02)
    assert stats["num_running"] == 0 and stats["running_slots"] == 0
    # The abort lands at the first step boundary after the server sees the socket close; the
    # tiny model steps every few ms, so this bound leaves room for a busy event loop noticing.
    assert stats["forward_passes"] - before <= 50, "the aborted request kept decoding"
    _assert_clean(tiny_client)


def test_non_streaming_client_disconnect_aborts(tiny_client, tiny_server):
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    before = _stats(tiny_client)["forward_passes"]
    with httpx.Client(base_url=tiny_server.base_url, timeout=0.5) as c2:
        with pytest.raises(httpx.ReadTimeout):
            c2.post("/generate", json=body)
    # Wait on the condition with a deadline generous for a loaded 2-core machine; the abort
    # lands within a second of the server noticing the disconnect (it polls every 0.25 s).
    deadline = time.monotonic() + 60
    while _stats(tiny_client)["num_running"] != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    stats = _stats(tiny_client)
    assert stats["num_running"] == 0
    # 3000 tokens take ~3000 steps: an aborted request stops long before
    assert stats["forward_passes"] - before < 2000, "the request ran on after its client left"
    _assert_clean(tiny_client)


def test_api_key_is_required_when_set(keyed_server):
    srv = keyed_server
    assert httpx.get(srv.base_url + "/health").status_code == 200
    r = httpx.post(srv.base_url + "/generate", json={"text": "x", "sampling_params": GREEDY})
    assert r.status_code == 401 and r.json()["object"] == "error"
    for path in ("/metrics", "/get_server_info", "/v1/models"):
        assert httpx.get(srv.base_url + path).status_code == 401, path
        assert httpx.get(srv.base_url + path, headers={"Authorization": "Bearer sekreu"}).status_code == 401, path
    assert httpx.get(srv.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    ok = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY)
    assert ok.completions.create(model="m", prompt="x", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.base_url + "/v1", api_key="wrong").completions.create(model="m", prompt="x", max_tokens=2)


def test_full_queue_answers_429_and_sigterm_drains(tiny_llama):
    srv = ServerProcess(tiny_llama, "--max-total-tokens", "2048", "--max-running-requests", "1", "--max-queued-requests", "1")
    codes: dict[str, int] = {}

    def post(name: str, max_new_tokens: int) -> None:
        body = {"text": "x", "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
        codes[name] = httpx.post(srv.base_url + "/generate", json=body, timeout=120).status_code

    def wait_for(what: str, cond) -> None:
        deadline = time.monotonic() + 60
        while not cond(httpx.get(srv.base_url + "/get_server_info", timeout=10).json()["stats"]):
            assert time.monotonic() < deadline, f"{what} never happened"
            time.sleep(0.05)

    # One request runs (long: it must outlast the next steps), one waits in the queue (short: it
    # only has to be queued), then the queue is full: two more are refused with 429.
    threads = [threading.Thread(target=post, args=("running", 1000))]
    threads[0].start()
    wait_for("the first request running", lambda s: s["num_running"] == 1 and s["in_flight"] == 1)
    threads.append(threading.Thread(target=post, args=("queued", 8)))
    threads[1].start()
    wait_for("the second request queued", lambda s: s["in_flight"] == 2)
    post("refused 1", 8)
    post("refused 2", 8)
    srv.proc.send_signal(signal.SIGTERM)  # drain: running requests finish, new ones are refused
    for t in threads:
        t.join()
    assert srv.proc.wait(timeout=60) == 0
    assert codes == {"running": 200, "queued": 200, "refused 1": 429, "refused 2": 429}, codes
    srv.log.close()


def test_sse_event_stays_one_line_whatever_characters_the_text_holds():
    """Text with characters that splitlines() breaks on (model output can hold any) is escaped."""
    import json as _json

    from radixlm.runtime.entrypoints.http.common import sse_line

    text = "a\u2028b\u2029c\x85d\x1ce\x1df\x1eg\x0bh\x0ci\nj\rk"
    line = sse_line({"text": text})
    assert line.endswith("\n\n") and len(line[:-2].splitlines()) == 1
    assert _json.loads(line[len("data: ") : -2]) == {"text": text}
