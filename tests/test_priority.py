"""Priority classes (``--schedule-policy priority``): admission by class, preemption of less urgent
running requests when the batch or the pool is full (their tokens unchanged), aging against
starvation, and the per-request ``priority`` on the Engine, ``/generate`` and the OpenAI routes.

Schedulers are driven by hand, step by step; aging reads a virtual clock, so nothing here
depends on how fast the machine is.
"""

from __future__ import annotations

import types

import httpx
import openai
import pytest

from helpers import API_KEY, Driver, ServerProcess
from radixlm import ServerArgs
from radixlm.runtime.engine import build_parts
from radixlm.runtime.entrypoints.http.metrics import class_label
from radixlm.runtime.scheduler import priority as priority_module

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _prompt(seed: int, n: int = 12) -> list[int]:
    """A prompt of ``n`` tokens sharing nothing with other seeds' prompts."""
    return [(seed * 131 + i * 17) % 350 + 20 for i in range(n)]


def _driver(model_path: str, **options) -> Driver:
    args = dict(model_path=model_path, max_total_tokens=4096, page_size=1, schedule_policy="priority", priority_aging_s=0.0)
    return Driver(build_parts(ServerArgs(**{**args, **options})))


def _alone(model_path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    d = _driver(model_path)
    rid = d.add(prompt, max_new_tokens=max_new_tokens, **GREEDY)
    d.run()
    return d.results[rid].output_ids


def _find(d: Driver, rid: str):
    return next(r for r in d.sched.running + d.sched.waiting if r.rid == rid)


def _find_any(d: Driver, rid: str):
    return next((r for r in d.sched.running + d.sched.waiting if r.rid == rid), None)


def _finish_order(d: Driver) -> list[str]:
    order: list[str] = []
    d.run(on_step=lambda _: order.extend(rid for rid in d.results if rid not in order))
    order.extend(rid for rid in d.results if rid not in order)
    return order


def test_waiting_requests_are_admitted_by_class_most_urgent_first(tiny_llama):
    d = _driver(tiny_llama, max_running_requests=1)
    d.add(_prompt(0), rid="first", priority=-5, max_new_tokens=3, **GREEDY)
    d.step()
    for rid, cls in (("low", 5), ("mid", 1), ("high", -1), ("mid2", 1)):
        d.add(_prompt(len(rid) * 7 + cls), rid=rid, priority=cls, max_new_tokens=3, **GREEDY)
    assert _finish_order(d) == ["first", "high", "mid", "mid2", "low"]
    assert d.sched.total_preempted == 0, "the running request was the most urgent: nothing to preempt"


def test_a_more_urgent_request_preempts_a_full_batch_and_the_preempted_finish_with_their_alone_tokens(tiny_llama):
    d = _driver(tiny_llama, max_running_requests=2)
    lows = {"low_a": _prompt(10, 20), "low_b": _prompt(11, 20)}
    for rid, prompt in lows.items():
        d.add(prompt, rid=rid, priority=1, max_new_tokens=24, **GREEDY)
    while min(len(_find(d, rid).output_ids) for rid in lows) < 6:
        d.step()
    high = _prompt(12, 16)
    d.add(high, rid="high", priority=0, max_new_tokens=4, **GREEDY)
    d.step()
    victim = _find(d, "low_b")  # the newest of the least urgent class gives way
    assert victim in d.sched.waiting and victim.kv is None and victim.preemptions == 1
    assert _find(d, "high") in d.sched.running and _find(d, "low_a") in d.sched.running
    assert d.sched.stats.num_preempted == 1
    order = _finish_order(d)
    assert order.index("high") < order.index("low_b")
    assert d.results["low_b"].meta_info["preemptions"] == 1 and "preemptions" not in d.results["low_a"].meta_info
    for rid, prompt in lows.items():
        assert d.results[rid].output_ids == _alone(tiny_llama, prompt, 24), f"{rid} lost or changed tokens"
    assert d.results["high"].output_ids == _alone(tiny_llama, high, 4)
    assert d.sched.kv.tree.evictable_size() == d.sched.kv.tree.total_size(), "a finished request still locks the tree"


def test_a_more_urgent_request_preempts_when_the_kv_pool_is_full(tiny_llama):
    d = _driver(tiny_llama, max_total_tokens=128)
    low = _prompt(20, 30)
    d.add(low, rid="low", priority=2, max_new_tokens=80, **GREEDY)
    while len(_find(d, "low").output_ids) < 40:
        d.step()
    high = _prompt(21, 40)
    d.add(high, rid="high", priority=0, max_new_tokens=8, **GREEDY)
    d.step()
    assert _find(d, "low") in d.sched.waiting and _find(d, "high") in d.sched.running
    order = _finish_order(d)
    assert order == ["high", "low"]
    assert d.results["low"].output_ids == _alone(tiny_llama, low, 80)
    assert d.results["high"].output_ids == _alone(tiny_llama, high, 8)


def test_when_decoding_outgrows_the_pool_the_least_urgent_request_is_retracted_not_the_newest(tiny_llama):
    d = _driver(tiny_llama, max_total_tokens=100)
    d.add(_prompt(35, 10), rid="low", priority=2, max_new_tokens=70, **GREEDY)
    d.step()
    d.sched.new_token_ratio = 0.1  # admit the second at once: the pool runs short later, while both decode
    d.add(_prompt(36, 10), rid="urgent", priority=0, max_new_tokens=70, **GREEDY)
    d.step()
    assert d.sched.total_preempted == 0 and len(d.sched.running) == 2
    while not d.sched.total_retracted:
        d.step()
    assert _find(d, "low") in d.sched.waiting and _find(d, "urgent") in d.sched.running
    assert _finish_order(d) == ["urgent", "low"]
    assert d.results["low"].output_ids == _alone(tiny_llama, _prompt(35, 10), 70)


def test_a_request_whose_adapter_does_not_fit_the_batch_preempts_for_its_adapter_slot(tiny_llama, tmp_path):
    from helpers import make_adapter

    paths = [f"{name}={make_adapter(tiny_llama, tmp_path / name, 4, 8, ['q_proj', 'v_proj'], seed=i)}" for i, name in enumerate(("a", "b"))]
    d = _driver(tiny_llama, lora_paths=paths, max_loras_per_batch=1)
    d.add(_prompt(37), rid="low", priority=1, max_new_tokens=30, **GREEDY)
    d.sched.waiting[-1].lora = "a"  # Driver builds Reqs directly: name the adapter and its cache key
    d.sched.waiting[-1].lora_key = d.rt.runner.lora.pool.cache_key("a")
    while len(_find(d, "low").output_ids) < 4:
        d.step()
    d.add(_prompt(38), rid="urgent", priority=0, max_new_tokens=3, **GREEDY)
    d.sched.waiting[-1].lora = "b"
    d.sched.waiting[-1].lora_key = d.rt.runner.lora.pool.cache_key("b")
    d.step()  # the batch and the pool have room; the one adapter slot is a's
    assert _find(d, "low") in d.sched.waiting and _find(d, "urgent") in d.sched.running
    assert _finish_order(d) == ["urgent", "low"]


def test_a_request_never_preempts_its_own_class_or_a_more_urgent_one(tiny_llama):
    d = _driver(tiny_llama, max_running_requests=1)
    d.add(_prompt(30), rid="running", priority=0, max_new_tokens=6, **GREEDY)
    d.step()
    d.add(_prompt(31), rid="same", priority=0, max_new_tokens=2, **GREEDY)
    d.add(_prompt(32), rid="lower", priority=3, max_new_tokens=2, **GREEDY)
    assert _finish_order(d) == ["running", "same", "lower"]
    assert d.sched.total_preempted == 0


def test_nothing_is_preempted_when_even_every_candidate_would_not_make_room(tiny_llama):
    d = _driver(tiny_llama, max_total_tokens=160)
    d.add(_prompt(40, 90), rid="urgent", priority=-1, max_new_tokens=40, **GREEDY)  # not a candidate
    d.add(_prompt(41, 8), rid="low", priority=3, max_new_tokens=40, **GREEDY)
    while len(_find(d, "low").output_ids) < 4:
        d.step()
    d.add(_prompt(42, 60), rid="mid", priority=0, max_new_tokens=4, **GREEDY)  # low's share cannot hold it
    d.step()
    assert d.sched.total_preempted == 0 and _find(d, "low") in d.sched.running
    d.run()
    assert set(d.results) == {"urgent", "low", "mid"}


@pytest.fixture
def virtual_clock(monkeypatch):
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(priority_module, "time", types.SimpleNamespace(monotonic=lambda: clock.now))
    return clock


@pytest.mark.parametrize("aging_s", [0.0, 1.0])
def test_aging_admits_a_low_class_request_within_its_bound_under_a_stream_of_urgent_ones(tiny_llama, virtual_clock, aging_s):
    """One urgent request always waits (a fresh one joins as soon as the last is admitted) while
    the batch holds one. The low request (class 2) is admitted once it has aged past the fresh
    ones: after at most (2 + 1) aging periods plus one request's run; without aging, never."""
    d = _driver(tiny_llama, max_running_requests=1, priority_aging_s=aging_s)
    step_s, flood = 0.25, 40
    d.add(_prompt(50), rid="u0", priority=0, max_new_tokens=2, **GREEDY)
    d.step()
    d.add(_prompt(51), rid="low", priority=2, max_new_tokens=2, **GREEDY)
    sent, admitted_at = 1, None
    for _ in range(10 * flood):
        if not any(r.rid.startswith("u") for r in d.sched.waiting) and sent < flood:
            d.add(_prompt(100 + sent), rid=f"u{sent}", priority=0, max_new_tokens=2, **GREEDY)
            sent += 1
        if not d.sched.has_work():
            break
        d.step()
        virtual_clock.now += step_s
        low = _find_any(d, "low")
        if admitted_at is None and (low is None or low.kv is not None):
            admitted_at = virtual_clock.now
    assert "low" in d.results and d.sched.total_preempted == 0, "once admitted by aging, the low request keeps its place"
    finished = list(d.results)  # in the order they finished
    urgent_after_low = len(finished) - 1 - finished.index("low")
    if aging_s == 0:
        assert urgent_after_low == 0, "without aging the low request waits out the whole stream"
    else:
        run_s = 4 * step_s  # an urgent request's prefill and two tokens, with margin
        assert admitted_at <= 3 * aging_s + run_s + step_s, f"admitted only at {admitted_at}s of virtual time"
        assert urgent_after_low > flood // 2, "the low request should have overtaken most of the stream"


def test_class_labels_are_bounded():
    assert [class_label(p) for p in (-(2**31), -11, -10, 0, 10, 11, 2**31 - 1)] == ["<=-11", "<=-11", "-10", "0", "10", ">=11", ">=11"]


# ------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def priority_server(tiny_llama):
    server = ServerProcess(tiny_llama, "--schedule-policy", "priority", "--max-total-tokens", "2048", "--served-model-name", "tiny", env={"RADIXLM_API_KEY": API_KEY})
    yield server
    assert server.stop() == 0, "the priority server did not exit cleanly"


def test_generate_and_the_openai_routes_take_priority_and_the_metrics_count_per_class(priority_server, tiny_server):
    with httpx.Client(base_url=priority_server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        r = http.post("/generate", json={"input_ids": _prompt(60), "sampling_params": {"max_new_tokens": 2, **GREEDY}, "priority": -3})
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["priority"] == -3 and meta["queue_time"] >= 0
        bad = http.post("/generate", json={"input_ids": [1, 2], "priority": "high"})
        assert bad.status_code == 400 and "priority" in bad.text
        oai = openai.OpenAI(base_url=priority_server.base_url + "/v1", api_key=API_KEY, max_retries=0)
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"priority": 4})
        oai.completions.create(model="tiny", prompt="hello", max_tokens=2, extra_body={"priority": 4})
        metrics = http.get("/metrics").text
        assert 'radixlm_priority_queue_time_seconds_count{priority="-3"} 1.0' in metrics
        assert 'radixlm_priority_time_to_first_token_seconds_count{priority="4"} 2.0' in metrics
    plain = httpx.post(tiny_server.base_url + "/generate", json={"input_ids": [1, 2], "priority": 1}, timeout=60)
    assert plain.status_code == 400 and "--schedule-policy priority" in plain.text
