"""The router: its prefix tree (property tests), policies, proxying, retries, disconnects,
metrics, prefill/decode dispatch, and end to end over real engines (in-process and
``radixlm serve --dp-size 2``).

Fake workers (tests/helpers.py ``FakeWorker``) are small FastAPI apps in uvicorn threads that
record what they get and when their client went away.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from helpers import FakeWorker, ServerThread, wait_until
from radixlm.runtime.entrypoints.router import RouterConfig, create_router_app
from radixlm.runtime.entrypoints.router.policy import (
    CacheAware,
    CacheAwareSettings,
    RoundRobin,
    ShortestQueue,
)
from radixlm.runtime.entrypoints.router.prefix_tree import PrefixTree
from radixlm.runtime.entrypoints.router.text_key import routing_text
from radixlm.runtime.entrypoints.router.workers import Worker


# ------------------------------------------------------------ prefix tree
def _lcp(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


_ops = st.lists(
    st.tuples(st.sampled_from(["insert", "match"]), st.text(alphabet="abc", max_size=12), st.sampled_from(["w0", "w1", "w2"])),
    max_size=60,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, bound=st.integers(min_value=1, max_value=30))
def test_prefix_tree_match_never_exceeds_a_real_prefix_and_eviction_keeps_the_bound(ops, bound):
    tree = PrefixTree(bound)
    seen: dict[str, list[str]] = {}
    for op, text, worker in ops:
        if op == "insert":
            tree.insert(text, worker)
            seen.setdefault(worker, []).append(text)
        else:
            got, n = tree.match(text)
            assert 0 <= n <= len(text)
            if got is None:
                assert n == 0
            else:
                assert n <= max(_lcp(text, s) for s in seen[got]), "matched more than any text that worker saw"
            only, m = tree.match(text, workers=[worker])
            assert only in (None, worker)
            assert m <= max((_lcp(text, s) for s in seen.get(worker, [])), default=0)
        tree.check_integrity()
        for w in seen:
            assert tree.size(w) <= bound


@settings(max_examples=200, deadline=None)
@given(ops=_ops)
def test_prefix_tree_without_eviction_matches_exactly_the_longest_prefix(ops):
    tree = PrefixTree(10_000)
    seen: dict[str, list[str]] = {}
    for op, text, worker in ops:
        if op == "insert":
            tree.insert(text, worker)
            seen.setdefault(worker, []).append(text)
            continue
        best = max((_lcp(text, s) for texts in seen.values() for s in texts), default=0)
        got, n = tree.match(text)
        assert n == best
        if n:
            assert max(_lcp(text, s) for s in seen[got]) == n
        tree.check_integrity()
    for w, texts in seen.items():  # the size is the characters of the worker's distinct prefixes
        assert tree.size(w) == len({t[:i] for t in texts for i in range(1, len(t) + 1)})


def test_prefix_tree_evicts_the_least_recently_used_leaf_first():
    tree = PrefixTree(20)
    tree.insert("system: old question", "w")  # 20 characters
    tree.insert("system: new", "w")  # shares "system: " and touches it
    tree.insert("system: old question", "v")  # another worker's size is its own
    assert tree.size("w") <= 20 and tree.size("v") == 20
    tree.check_integrity()
    assert tree.match("system: new", ["w"]) == ("w", 11), "the most recent text was evicted"
    assert tree.match("system: old question", ["w"])[1] < 20
    tree.remove_worker("v")
    assert tree.size("v") == 0 and tree.match("system: old question", ["v"]) == (None, 0)
    tree.check_integrity()


# ------------------------------------------------------------ policies (no HTTP)
def test_routing_text_of_each_route():
    assert routing_text("/generate", {"text": "hi"}) == "hi"
    assert routing_text("/generate", {"text": ["a", "b"]}) == "a"
    assert routing_text("/generate", {"input_ids": [1, 2, 3]}) == "1,2,3,"
    assert routing_text("/v1/completions", {"prompt": "p"}) == "p"
    assert routing_text("/v1/completions", {"prompt": [5, 6]}) == "5,6,"
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]}
    assert routing_text("/v1/chat/completions", chat) == "system: S\nuser: U"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert routing_text("/v1/chat/completions", {**chat, "tools": tools}).startswith(json.dumps(tools, sort_keys=True) + "\n")
    messages = {"system": "S", "messages": [{"role": "user", "content": [{"type": "text", "text": "U"}]}]}
    assert routing_text("/v1/messages", messages) == routing_text("/v1/messages/count_tokens", messages) == "system: S\nuser: U"
    assert routing_text("/v1/embeddings", {"input": ["doc one", "doc two"]}) == "doc one"
    assert routing_text("/v1/rerank", {"query": "Q", "documents": ["d"]}) == routing_text("/v1/score", {"text_1": "Q", "text_2": ["d"]}) == "Q"


def test_anthropic_messages_and_pooling_routes_go_through_the_router_by_prefix(fakes):
    system = "You are a coding agent with a long system prompt. " * 4
    with router_over(fakes) as (url, _), httpx.Client(base_url=url, timeout=10) as c:
        owner = _served_by(c.post("/v1/messages", json={"system": system, "messages": [{"role": "user", "content": "turn 1"}], "max_tokens": 4}))
        _served_by(c.post("/v1/messages", json={"system": "A different agent entirely. " * 4, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}))
        for turn in range(2, 5):
            assert _served_by(c.post("/v1/messages", json={"system": system, "messages": [{"role": "user", "content": f"turn {turn}"}], "max_tokens": 4})) == owner
        assert _served_by(c.post("/v1/messages/count_tokens", json={"system": system, "messages": []})) == owner
        doc = "A document about radix trees and prefix caches. " * 3
        first = _served_by(c.post("/v1/embeddings", json={"input": doc + "1"}))
        assert _served_by(c.post("/v1/embeddings", json={"input": [doc + "2"]})) == first
        for path in ("/v1/rerank", "/v1/score"):
            assert _served_by(c.post(path, json={"query": doc, "text_1": doc, "documents": ["d"], "text_2": ["d"]})) in ("a", "b")


def test_cache_aware_prefers_the_match_then_the_smallest_tree_and_balances_when_imbalanced():
    a, b = Worker("a", healthy=True), Worker("b", healthy=True)
    policy = CacheAware(CacheAwareSettings(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5))
    assert policy.choose("the long shared system prompt, q1", [a, b]) is a
    assert policy.choose("something else entirely", [a, b]) is b  # no match: the smaller tree
    assert policy.choose("the long shared system prompt, q2", [a, b]) is a  # the match
    assert policy.choose("the lazy dog sleeps all day", [a, b]) is b, "a short match (< cache_threshold) must not win"
    a.in_flight, b.in_flight = 5, 0  # 5 - 0 > 4 and 5 > 1.5 * 0: imbalanced
    assert policy.choose("the long shared system prompt, q3", [a, b]) is b
    a.in_flight, b.in_flight = 6, 3  # 6 - 3 <= 4: balanced again, the match wins
    assert policy.choose("the long shared system prompt, q1 again", [a, b]) is a
    assert policy.tree_chars(b) > 0 and policy.choose("x", [b]) is b


def test_cache_aware_sends_a_prefix_that_several_hold_to_the_least_loaded_of_them():
    a, b, c = (Worker(u, healthy=True) for u in "abc")
    policy = CacheAware(CacheAwareSettings(cache_threshold=0.5, balance_abs_threshold=100))
    system = "You are a helpful assistant. Answer in one short sentence. "
    policy.tree.insert(system + "1", "a")
    policy.tree.insert(system + "2", "b")  # b used it last
    a.in_flight, b.in_flight, c.in_flight = 1, 3, 0  # balanced by the thresholds; c holds nothing
    assert policy.choose(system + "3", [a, b, c]) is a, "a and b hold the system prompt: the less loaded of them"
    a.in_flight = 5
    assert policy.choose(system + "4", [a, b, c]) is b


def test_round_robin_and_shortest_queue():
    a, b = Worker("a", healthy=True), Worker("b", healthy=True)
    rr = RoundRobin()
    assert [rr.choose("", [a, b]).url for _ in range(4)] == ["a", "b", "a", "b"]
    a.in_flight = 2
    assert ShortestQueue().choose("", [a, b]) is b


# ------------------------------------------------------------ the router over fake workers
@pytest.fixture
def fakes():
    workers = [FakeWorker("a").start(), FakeWorker("b").start()]
    yield workers
    for w in workers:
        w.release.set()
        w.http.begin_stop()
    for w in workers:
        w.http.join()


@contextlib.contextmanager
def router_over(workers, **options):
    """A router over ``workers`` in a uvicorn thread: (its URL, its RouterState)."""
    if not options.get("pd_disaggregation"):
        options.setdefault("worker_urls", [w.url for w in workers])
    options.setdefault("health_check_interval", 0.2)
    app = create_router_app(RouterConfig(**options))
    server = ServerThread(app).start()
    try:
        yield server.url, app.state.router
    finally:
        server.stop(force=False)


def _served_by(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.json()["worker"]


def test_shared_prefix_requests_go_to_the_replica_that_holds_the_prefix(fakes):
    a, b = fakes
    sys_a, sys_b = "You are a pirate. Answer in rhymes. " * 3, "Translate into French, formally. " * 3
    with router_over(fakes) as (url, state), httpx.Client(base_url=url, timeout=10) as c:
        first = _served_by(c.post("/generate", json={"text": sys_a + "q0"}))
        second = _served_by(c.post("/generate", json={"text": sys_b + "q0"}))
        assert {first, second} == {"a", "b"}, "two new prefixes should land on both workers"
        for i in range(1, 5):
            assert _served_by(c.post("/v1/completions", json={"prompt": sys_a + f"q{i}"})) == first
            assert _served_by(c.post("/generate", json={"text": sys_b + f"question {i}"})) == second
        chat = {"messages": [{"role": "system", "content": sys_a}, {"role": "user", "content": "hi"}]}
        owner = _served_by(c.post("/v1/chat/completions", json=chat))
        assert _served_by(c.post("/v1/chat/completions", json={"messages": [*chat["messages"], {"role": "assistant", "content": "ahoy"}, {"role": "user", "content": "more"}]})) == owner


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_load_spreads_when_prefixes_differ(fakes, policy):
    a, b = fakes
    with router_over(fakes, policy=policy) as (url, _), httpx.Client(base_url=url, timeout=10) as c:
        served = [_served_by(c.post("/generate", json={"text": f"{chr(65 + i)} distinct prompt number {i}"})) for i in range(8)]
    assert served.count("a") == 4 and served.count("b") == 4, served


def _hold(url: str, body: dict, pool: ThreadPoolExecutor):
    """Send a request that the fake worker holds until released (in a thread)."""
    return pool.submit(lambda: httpx.post(url + "/generate", json={**body, "fake": {"hang": True}}, timeout=30))


def test_imbalance_falls_back_to_the_least_loaded_worker(fakes):
    a, b = fakes
    prefix = "a very long shared prefix that every request starts with, "
    with router_over(fakes, balance_abs_threshold=2, balance_rel_threshold=1.5) as (url, state), ThreadPoolExecutor(4) as pool, httpx.Client(base_url=url, timeout=10) as c:
        held = []
        try:
            for i in range(3):
                held.append(_hold(url, {"text": prefix + str(i)}, pool))
                wait_until(lambda n=i + 1: state.registry.workers[0].in_flight == n, what=f"{i + 1} requests held on a")
            assert [p for p, _ in b.requests] == []
            # a holds 3, b 0: 3 - 0 > 2 and 3 > 1.5 * 0, so the prefix no longer decides
            assert _served_by(c.post("/generate", json={"text": prefix + "next"})) == "b"
        finally:
            a.release.set()
        assert all(f.result().status_code == 200 for f in held)
        wait_until(lambda: state.registry.workers[0].in_flight == 0, what="a's requests to finish")
        assert _served_by(c.post("/generate", json={"text": prefix + "0, again"})) == "a", "balanced again: the prefix decides"


def test_shortest_queue_sends_to_the_worker_with_fewest_in_flight(fakes):
    a, b = fakes
    with router_over(fakes, policy="shortest_queue") as (url, state), ThreadPoolExecutor(1) as pool, httpx.Client(base_url=url, timeout=10) as c:
        held = _hold(url, {"text": "x"}, pool)
        try:
            wait_until(lambda: state.registry.workers[0].in_flight == 1, what="a request held on a")
            assert [_served_by(c.post("/generate", json={"text": f"y{i}"})) for i in range(3)] == ["b", "b", "b"]
        finally:
            a.release.set()
        assert held.result().status_code == 200


def test_a_killed_worker_is_routed_around_marked_unhealthy_and_comes_back(fakes):
    a, b = fakes
    with router_over(fakes, policy="round_robin", health_check_interval=0.5) as (url, state), httpx.Client(base_url=url, timeout=10) as c:
        wa = state.registry.workers[0]
        a.stop()  # killed: its port refuses connections
        wa.healthy = True  # as the router believes until it learns otherwise
        for stream in (False, True):
            wa.healthy = True
            resp = c.post("/generate", json={"text": "hello", "stream": stream})
            assert resp.status_code == 200, resp.text
            assert "b" in resp.text  # round robin chose a; the retry went to b
            assert not wa.healthy, "a connection error must mark the worker unhealthy at once"
        assert state.metrics.retries._value.get() == 2
        served = [_served_by(c.post("/generate", json={"text": f"t{i}"})) for i in range(4)]
        assert served == ["b"] * 4, "an unhealthy worker must get no requests"
        a.start()  # back on the same port
        wait_until(lambda: wa.healthy, 10, "the health check to bring a back")
        served = [_served_by(c.post("/generate", json={"text": f"u{i}"})) for i in range(4)]
        assert served.count("a") == 2


def test_a_5xx_before_the_first_byte_is_retried_and_a_4xx_is_passed_through(fakes):
    a, b = fakes
    a.status = 503  # draining
    with router_over(fakes, policy="round_robin", health_check_interval=30) as (url, state), httpx.Client(base_url=url, timeout=10) as c:
        resp = c.post("/generate", json={"text": "hello", "stream": True})
        assert resp.status_code == 200 and "b-0" in resp.text
        assert a.paths() == ["/generate"], "round robin should have tried a first"
        assert not state.registry.workers[0].healthy, "a 503 marks the worker unhealthy"
        a.status, b.status = 400, 400
        state.registry.workers[0].healthy = True
        resp = c.post("/generate", json={"text": "x"})
        assert resp.status_code == 400 and resp.json()["message"].endswith("says 400"), "a 4xx must come back unchanged"
        assert len(a.requests) + len(b.requests) == 3, "a 4xx must not be retried"
        bad = c.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["message"]
        assert c.post("/v1/completions", json=[1, 2]).json()["message"].startswith("the request body must be a JSON object")


def test_all_workers_5xx_returns_the_last_error(fakes):
    a, b = fakes
    a.status = b.status = 500
    with router_over(fakes, max_retries=1) as (url, state), httpx.Client(base_url=url, timeout=10) as c:
        resp = c.post("/generate", json={"text": "x"})
        assert resp.status_code == 500 and "says 500" in resp.json()["message"]
        assert len(a.requests) + len(b.requests) == 2
        assert all(w.healthy for w in state.registry.workers), "a 500 (not 503) does not take a worker out"


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_disconnect_through_the_router_closes_the_upstream(fakes, stream):
    a, b = fakes
    with router_over(fakes, policy="round_robin") as (url, state):
        if stream:
            with httpx.Client(timeout=10) as c, c.stream("POST", url + "/generate", json={"text": "x", "stream": True, "fake": {"chunks": 500, "delay": 0.02}}) as resp:
                assert next(resp.iter_lines()).startswith("data:")
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/generate", json={"text": "x", "fake": {"hang": True}}, timeout=0.5)
        wait_until(lambda: a.disconnects == ["/generate"], 5, "the fake worker to see its client go")
        wait_until(lambda: state.registry.workers[0].in_flight == 0, 5, "the router to count the request finished")


def test_a_stream_that_breaks_mid_way_ends_with_an_sse_error_event(fakes):
    a, b = fakes
    a.break_after = 2
    with router_over(fakes, policy="round_robin", health_check_interval=30) as (url, state), httpx.Client(base_url=url, timeout=10) as c:
        resp = c.post("/v1/chat/completions", json={"messages": [], "stream": True})
        events = [line.removeprefix("data: ") for line in resp.text.splitlines() if line.startswith("data: ")]
        assert [json.loads(e)["text"] for e in events[:2]] == ["a-0", "a-1"]
        assert "error" in json.loads(events[2]) and events[3] == "[DONE]" and len(events) == 4
        assert b.requests == [], "bytes had reached the client: no retry"
        assert not state.registry.workers[0].healthy


def test_metrics_aggregate_every_worker_with_a_worker_label(fakes):
    a, b = fakes
    with router_over(fakes) as (url, state), httpx.Client(base_url=url, timeout=10) as c:
        c.post("/generate", json={"text": "x"})
        families = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
    running = {s.labels["worker"]: s.value for s in families["radixlm_num_running_requests"].samples}
    assert running == {a.url: len(a.requests), b.url: len(b.requests)}
    assert {s.labels["worker"] for s in families["radixlm_requests"].samples if s.name.endswith("_total")} == {a.url, b.url}
    assert families["radixlm_router_healthy_workers"].samples[0].value == 2
    sent = {s.labels["worker"]: s.value for s in families["radixlm_router_requests"].samples if s.name.endswith("_total")}
    assert sum(sent.values()) == 1


def test_health_is_503_when_every_worker_is_down(fakes):
    a, b = fakes
    with router_over(fakes) as (url, state), httpx.Client(base_url=url, timeout=10) as c:
        assert c.get("/health").status_code == 200
        a.health_status = b.health_status = 503
        wait_until(lambda: c.get("/health").status_code == 503, 10, "the router's health to turn 503")
        body = c.get("/health").json()
        assert body["object"] == "error" and body["code"] == 503 and body["param"] is None and body["message"]
        assert c.post("/generate", json={"text": "x"}).status_code == 503
        b.health_status = 200
        wait_until(lambda: c.get("/health").status_code == 200, 10, "one worker back: the router healthy")


def test_info_routes_and_broadcasts(fakes):
    a, b = fakes
    with router_over(fakes) as (url, state), httpx.Client(base_url=url, timeout=10) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] in ("model-a", "model-b")
        c.post("/generate", json={"text": "some text to remember"})
        assert sum(state.policy.tree_chars(w) for w in state.registry.workers) > 0
        assert c.post("/flush_cache").status_code == 200 and a.flushes == b.flushes == 1
        assert sum(state.policy.tree_chars(w) for w in state.registry.workers) == 0, "a flush empties the router's tree"
        assert c.post("/abort_request", json={"rid": "r1"}).json() == {"rid": "r1", "aborted": True}
        assert ("/abort_request", {"rid": "r1"}) in a.requests and ("/abort_request", {"rid": "r1"}) in b.requests
        info = c.get("/get_server_info").json()
        assert info["policy"] == "cache_aware" and [w["info"]["name"] for w in info["workers"]] == ["a", "b"]
        assert {"healthy", "in_flight", "tree_chars"} <= set(info["workers"][0])


def test_an_api_key_is_required_of_clients_and_sent_on_the_routers_own_calls(fakes):
    a, b = fakes
    with router_over(fakes, api_key="k") as (url, state), httpx.Client(base_url=url, timeout=10) as c:
        assert c.get("/health").status_code == 200
        for method, path in (("POST", "/generate"), ("GET", "/metrics"), ("GET", "/get_server_info")):
            resp = c.request(method, path, json={"text": "x"})
            assert resp.status_code == 401 and resp.json()["code"] == 401, path
        assert a.requests == b.requests == []
        key = {"Authorization": "Bearer k"}
        assert c.post("/generate", json={"text": "x"}, headers=key).status_code == 200
        assert c.post("/v1/messages", json={"messages": []}, headers={"x-api-key": "k"}).status_code == 200, "Anthropic's clients send the key as x-api-key"
        assert c.post("/v1/messages", json={"messages": []}, headers={"x-api-key": "wrong"}).status_code == 401
        assert c.post("/v1/messages", json={"messages": []}, headers={"x-api-key": "k", "Authorization": "Bearer wrong"}).status_code == 401, "a Bearer header, when sent, decides"
        assert c.get("/metrics", headers=key).status_code == 200
        assert a.metrics_auth == b.metrics_auth == "Bearer k"


# ------------------------------------------------------------ prefill/decode dispatch
@contextlib.contextmanager
def pd_router(fakes):
    prefill, decode = fakes
    with router_over([], pd_disaggregation=True, prefill_url=prefill.url, decode_url=decode.url) as (url, state), httpx.Client(base_url=url, timeout=10) as c:
        yield c, state


@pytest.mark.parametrize("stream", [False, True])
def test_pd_sends_both_workers_the_same_bootstrap_room(fakes, stream):
    prefill, decode = fakes
    with pd_router(fakes) as (c, _):
        resp = c.post("/v1/completions", json={"prompt": "hi", "stream": stream})
        assert resp.status_code == 200, resp.text
        assert ("b-0" in resp.text) if stream else (resp.json()["worker"] == "b"), "the client gets the decode worker's answer"
    (ppath, pbody), (dpath, dbody) = prefill.requests[0], decode.requests[0]
    assert ppath == dpath == "/v1/completions"
    assert pbody["bootstrap_room"] == dbody["bootstrap_room"] and 0 <= pbody["bootstrap_room"] < 2**63
    assert pbody["stream"] is False and dbody["stream"] is stream


@pytest.mark.parametrize("stream", [False, True])
def test_pd_prefill_error_reaches_the_client_and_cancels_decode(fakes, stream):
    prefill, decode = fakes
    prefill.status, prefill.answer_after = 500, 0.2
    decode.hang = True  # waiting for a KV hand-over that never comes
    with pd_router(fakes) as (c, state):
        resp = c.post("/generate", json={"text": "hi", "stream": stream})
        assert resp.status_code == 500 and resp.json()["message"] == "a says 500"
        wait_until(lambda: decode.disconnects == ["/generate"], 5, "the decode call to be cancelled")
        wait_until(lambda: all(w.in_flight == 0 for w in state.registry.workers), 5, "both counted finished")


def test_pd_prefill_error_after_the_stream_began_ends_it_with_an_sse_error(fakes):
    prefill, decode = fakes
    prefill.status, prefill.answer_after = 500, 0.3
    decode.chunks, decode.delay = 100, 0.02
    with pd_router(fakes) as (c, _):
        resp = c.post("/generate", json={"text": "hi", "stream": True})
        events = [line.removeprefix("data: ") for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[0] == json.dumps({"text": "b-0", "worker": "b"}) and events[-1] == "[DONE]"
    assert "a says 500" in json.loads(events[-2])["error"]["message"]
    wait_until(lambda: decode.disconnects == ["/generate"], 5, "the decode stream to be closed")


@pytest.mark.parametrize("stream", [False, True])
def test_pd_decode_error_cancels_prefill(fakes, stream):
    prefill, decode = fakes
    prefill.hang = True
    decode.status = 400
    with pd_router(fakes) as (c, _):
        resp = c.post("/generate", json={"text": "hi", "stream": stream})
        assert resp.status_code == 400 and resp.json()["message"] == "b says 400"
        wait_until(lambda: prefill.disconnects == ["/generate"], 5, "the prefill call to be cancelled")


def test_pd_refuses_pooling_routes_with_a_400_and_sends_nothing(fakes):
    prefill, decode = fakes
    with pd_router(fakes) as (c, _):
        for path in ("/v1/embeddings", "/v1/rerank", "/v1/score"):
            resp = c.post(path, json={"input": "x"})
            assert resp.status_code == 400 and path in resp.json()["message"], resp.text
        assert prefill.requests == decode.requests == []
        resp = c.post("/v1/messages", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert resp.status_code == 200 and resp.json()["bootstrap_room"] is not None, "Anthropic messages go to the pair like chat"


def test_pd_refuses_while_a_worker_is_unhealthy(fakes):
    prefill, decode = fakes
    with pd_router(fakes) as (c, state):
        decode.health_status = 503
        wait_until(lambda: c.get("/health").status_code == 503, 10, "the router to see decode unhealthy")
        resp = c.post("/generate", json={"text": "hi"})
        assert resp.status_code == 503 and "decode worker" in resp.json()["message"]
        assert prefill.requests == [] and decode.requests == []


def test_pd_client_disconnect_cancels_both(fakes):
    prefill, decode = fakes
    prefill.hang = decode.hang = True
    with pd_router(fakes) as (c, state):
        with pytest.raises(httpx.ReadTimeout):
            c.post("/generate", json={"text": "hi"}, timeout=0.5)
        wait_until(lambda: prefill.disconnects == ["/generate"] and decode.disconnects == ["/generate"], 5, "both calls cancelled")


def test_pd_client_disconnect_after_prefill_answers_mid_chunk_closes_decode(fakes):
    # the router then waits on decode's next chunk alone: the client going must still close it
    prefill, decode = fakes
    prefill.answer_after = 0.3  # answers after the first chunk reached the client
    decode.chunks, decode.delay = 50, 3.0
    with pd_router(fakes) as (c, state):
        with c.stream("POST", "/generate", json={"text": "hi", "stream": True}) as resp:
            lines = resp.iter_lines()  # (kept: a dropped iterator closes the connection)
            assert next(lines).startswith("data:")
            wait_until(lambda: prefill.answered == ["/generate"], 5, "the prefill call to answer")
            time.sleep(0.2)  # for the router to read that answer (no state shows it); late only hides the case
        # left open, decode would stream on for its 50 chunks (150 s): any wait far below that tells
        wait_until(lambda: decode.disconnects == ["/generate"], 10, "the decode stream to be closed")
        wait_until(lambda: all(w.in_flight == 0 for w in state.registry.workers), 5, "both counted finished")


# ------------------------------------------------------------ the command line
def test_the_router_command_imports_neither_torch_nor_the_engine():
    out = subprocess.run([sys.executable, "-P", "-X", "importtime", "-m", "radixlm", "router", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--worker-urls" in out.stdout
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert not {m for m in imported if m == "torch" or m.startswith("torch.") or m == "radixlm.runtime.engine"}
    code = "import sys, radixlm.runtime.entrypoints.router.app, radixlm.runtime.entrypoints.router.launch; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m == 'radixlm.runtime.engine'))"
    assert subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60).stdout.strip() == "[]"


def test_serve_dp_passes_every_other_option_to_its_workers():
    import argparse

    from radixlm.runtime.entrypoints.cli import main as cli
    from radixlm.runtime.entrypoints.router.launch import passed_options

    parser = argparse.ArgumentParser()
    serve = cli._serve_parser(parser.add_subparsers(dest="command"))
    argv = ["serve", "--dp-size", "2", "--port", "9", "--host", "0.0.0.0", "--model-path", "m", "--max-total-tokens", "2048", "--disable-radix-cache", "--api-key", "k", "--drain-timeout", "5"]
    args = passed_options(parser.parse_args(argv), serve)
    assert args == ["--drain-timeout", "5.0", "--model-path", "m", "--max-total-tokens", "2048", "--disable-radix-cache"]  # the key goes by environment
    assert serve.parse_args(args).max_total_tokens == 2048, "what the workers get must parse back"


# ------------------------------------------------------------ end to end over real engines
def test_end_to_end_over_two_in_process_engines(tiny_llama):
    import openai

    from radixlm.runtime.engine import Engine
    from radixlm.runtime.entrypoints.http.server import create_app

    engines = [Engine(model_path=tiny_llama, max_total_tokens=2048) for _ in range(2)]
    servers = [ServerThread(create_app(e, served_model_name="tiny")).start() for e in engines]
    try:
        with router_over(servers) as (url, state):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Radix trees share prefixes"}], max_tokens=8, stream=True))
            assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
            prompt = "The quick brown fox jumps over the lazy dog. " * 4
            first = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
            again = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
            assert first.choices[0].text == again.choices[0].text
            assert again.usage.prompt_tokens_details.cached_tokens > 0, "the repeat must reach the worker that cached it"
            import anthropic

            claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
            turn = {"model": "tiny", "system": prompt, "max_tokens": 4, "extra_body": {"temperature": 0}}  # the SDK (2.x) has no sampling arguments
            claude.messages.create(**turn, messages=[{"role": "user", "content": "first"}])
            again_m = claude.messages.create(**turn, messages=[{"role": "user", "content": "second"}])
            assert again_m.usage.cache_read_input_tokens > 0, "an agent's next turn must reach the worker holding its prefix"
            vectors = client.embeddings.create(model="tiny", input=[prompt, "another"])
            assert len(vectors.data) == 2 and len(vectors.data[0].embedding) == engines[0].config.hidden_size
            # the tiny model makes ~1000 tokens/s: the steps taken, not the time, tell an abort
            steps = lambda: sum(e.get_stats()["forward_passes"] for e in engines)  # noqa: E731
            before = steps()
            body = {"text": "Once upon a time", "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
            with httpx.Client(timeout=30) as c, c.stream("POST", url + "/generate", json=body) as resp:
                assert next(resp.iter_lines()).startswith("data:")
            wait_until(lambda: sum(e.get_stats()["num_running"] for e in engines) == 0, 30, "the request to end upstream")
            assert steps() - before < 1000, f"the request ran on for {steps() - before} steps: the disconnect did not abort it upstream"
            for e in engines:
                e.check_accounting()
    finally:
        for s in servers:
            s.stop(force=False)
        for e in engines:
            e.shutdown()


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                kids.append(int(stat.parent.name))
    return kids


def test_serve_dp_size_2_serves_and_exits_cleanly_on_sigterm(tiny_llama):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(Path(sys.executable).parent / "radixlm"), "serve", "--dp-size", "2", "--model-path", tiny_llama, "--max-total-tokens", "2048", "--port", str(port)]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"radixlm-dp-{port}.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RADIXLM_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert proc.poll() is None, f"exited {proc.returncode}: {log.seek(0) or log.read()}"
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(url + "/health", timeout=2).status_code == 200
            return False

        wait_until(healthy, 180, "serve --dp-size 2 to become healthy")
        resp = httpx.post(url + "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}}, timeout=60)
        assert resp.status_code == 200 and resp.json()["meta_info"]["completion_tokens"] >= 1
        workers = _children(proc.pid)
        assert len(workers) == 2
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        assert all(w["healthy"] for w in info["workers"]) and len(info["workers"]) == 2
        # a stream running at SIGTERM finishes (the workers drain); new requests get 503 meanwhile
        lines: list[str] = []
        body = {"text": "Once", "stream": True, "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}

        def read_stream() -> None:
            with httpx.stream("POST", url + "/generate", json=body, timeout=60) as resp:
                lines.extend(line for line in resp.iter_lines() if line)

        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(read_stream)
            wait_until(lambda: lines, 30, "the stream to start")
            proc.send_signal(signal.SIGTERM)
            refused = httpx.post(url + "/generate", json={"text": "late"}, timeout=10)
            assert not streaming.done(), "the stream ended before the check: make it longer"
            assert refused.status_code == 503 and "shutting down" in refused.json()["message"]
            streaming.result(timeout=60)
        assert lines[-1] == "data: [DONE]" and all("error" not in json.loads(line[6:]) for line in lines[:-1])
        assert json.loads(lines[-2][6:])["meta_info"]["completion_tokens"] == 600
        assert proc.wait(timeout=60) == 0, log.seek(0) or log.read()
        assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "a worker outlived the launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()

