"""Prefill/decode disaggregation: a prefill engine hands prompts' KV to a decode engine over gloo.

The pairs here live in one process (two engines, each its own loop thread, joined by a loopback
TCPStore and a two-rank gloo group), as ``radixlm serve --disaggregation-mode`` pairs do across
processes. Every engine checks its KV accounting after each step (conftest).
"""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers import wait_until
from radixlm.runtime.engine import Engine
from radixlm.runtime.server_args import ServerArgs

GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def start_pair(model: str, timeout: float = 30.0, decode_extra: dict | None = None, max_total_tokens: int = 1024, **common) -> tuple[Engine, Engine]:
    """A prefill engine and a decode engine joined on a fresh loopback address."""
    boot = free_address()
    prefill = Engine(model_path=model, max_total_tokens=max_total_tokens, disaggregation_mode="prefill", disaggregation_bootstrap=boot, disaggregation_timeout=timeout, **common)
    decode = Engine(model_path=model, max_total_tokens=max_total_tokens, disaggregation_mode="decode", disaggregation_bootstrap=boot, disaggregation_timeout=timeout, **common, **(decode_extra or {}))
    return prefill, decode


@contextlib.contextmanager
def paired(model: str, timeout: float = 30.0, decode_extra: dict | None = None, **common):
    """``start_pair`` for the length of a ``with`` block: both engines shut down after it."""
    prefill, decode = start_pair(model, timeout, decode_extra, **common)
    try:
        yield prefill, decode
    finally:
        decode.shutdown()
        prefill.shutdown()


def run_pair(prefill: Engine, decode: Engine, input_ids: list[int], room: int, params: dict = GREEDY, prefill_ids: list[int] | None = None) -> tuple[dict, dict]:
    """Both halves of one request at once (as the router sends them); (prefill out, decode out)."""
    with ThreadPoolExecutor(1) as pool:
        p = pool.submit(prefill.generate, input_ids=prefill_ids or input_ids, sampling_params=params, bootstrap_room=room)
        d = decode.generate(input_ids=input_ids, sampling_params=params, bootstrap_room=room)
        return p.result(timeout=120), d


def assert_clean(*engines: Engine) -> None:
    for e in engines:
        e.check_accounting()
        stats = e.get_stats()
        assert stats["num_running"] == stats["num_waiting"] == stats["running_slots"] == stats.get("pd_receiving", 0) == 0, stats


@pytest.fixture(scope="module")
def engines(tiny_llama: str):
    """A prefill/decode pair (page size 4) and a plain engine to compare with."""
    # room for a 4000-token request: the disconnect test tells an abort from a run to the end
    prefill, decode = start_pair(tiny_llama, page_size=4, debug_fault_injection=True, max_total_tokens=4096)
    single = Engine(model_path=tiny_llama, max_total_tokens=1024, page_size=4)
    yield prefill, decode, single
    for e in (prefill, decode, single):
        e.shutdown()


def test_pd_pair_greedy_output_equals_a_single_engine_and_sends_only_missing_kv(engines):
    prefill, decode, single = engines
    decode.flush_cache()
    system = list(range(3, 40))
    prompts = [system + [50 + i, 60 + i, 70 + i] for i in range(3)] + [list(range(100, 117))]
    held_by_prompt = []
    for i, ids in enumerate(prompts):
        p_out, d_out = run_pair(prefill, decode, ids, room=10 + i)
        ref = single.generate(input_ids=ids, sampling_params=GREEDY)
        assert d_out["output_ids"] == ref["output_ids"], f"prompt {i}"
        assert d_out["meta_info"]["finish_reason"]["type"] == "length"
        assert p_out["output_ids"] == [] and p_out["meta_info"]["finish_reason"]["type"] == "length"
        held = d_out["meta_info"]["cached_tokens"]
        sent = d_out["meta_info"]["pd"]["received_tokens"]
        assert sent == len(ids) - 1 - held, "only the positions the decode side lacks travel"
        assert p_out["meta_info"]["pd"]["sent_tokens"] == sent
        held_by_prompt.append(held)
    # the later prompts sharing the system prompt found its whole pages in the decode side's own tree
    assert held_by_prompt == [0, 36, 36, 0]
    assert decode.get_stats()["pd_transfer_bytes"] > 0
    assert_clean(prefill, decode)


def test_pd_concurrent_requests_in_one_batch_match_a_single_engine(engines):
    prefill, decode, single = engines
    prompts = [[7 + i] * 5 + list(range(200 + 3 * i, 230 + 3 * i)) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda a: run_pair(prefill, decode, a[1], room=100 + a[0]), enumerate(prompts)))
    refs = single.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [d["output_ids"] for _, d in outs] == [r["output_ids"] for r in refs]
    assert_clean(prefill, decode)


def test_pd_decode_abort_while_waiting_for_kv_frees_its_slots(engines):
    prefill, decode, _ = engines
    ids = [14] * 4 + list(range(300, 336))
    with ThreadPoolExecutor(1) as pool:  # no prefill half: the request waits in `receiving`
        fut = pool.submit(decode.generate, input_ids=ids, sampling_params=GREEDY, bootstrap_room=501)
        wait_until(lambda: decode.get_stats()["pd_receiving"] == 1, 60, "the decode request to hold its slots")
        assert decode.get_stats()["running_slots"] >= len(ids) - 1
        rid = decode._call(lambda: decode.scheduler.pd.requests()[0].rid)
        assert decode.abort(rid)
        out = fut.result(timeout=60)
    fr = out["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and "status" not in fr and fr["message"] == "aborted by request", fr  # not a time-out
    assert_clean(decode)
    _, d_out = run_pair(prefill, decode, ids, room=502)  # the link is still in step
    assert d_out["meta_info"]["finish_reason"]["type"] == "length"
    assert_clean(prefill, decode)


def test_pd_a_queued_hand_over_is_aborted_only_by_its_own_tenant(engines):
    prefill, decode, _ = engines
    q: queue.Queue = queue.Queue()  # no decode half: the computed prompt's hand-over waits
    req = prefill.make_request(q.put, input_ids=[14] * 4 + list(range(340, 376)), sampling_params=GREEDY, bootstrap_room=901, cache_salt="tenant-a", rid="pd-tenant-job")
    prefill.submit(req)
    wait_until(lambda: prefill._call(lambda: "pd-tenant-job" in prefill.scheduler.pd.sending_salts), 60, "the hand-over to be queued")
    assert not prefill.abort("pd-tenant-job", cache_salt="tenant-b")
    assert not prefill.abort("pd-tenant-job", cache_salt=None)
    assert prefill.abort("pd-tenant-job", cache_salt="tenant-a")
    while not (out := q.get(timeout=60)).finished:
        pass
    assert out.meta_info["finish_reason"]["type"] == "abort", out.meta_info
    assert prefill._call(lambda: "pd-tenant-job" not in prefill.scheduler.pd.sending_salts)
    _, d_out = run_pair(prefill, decode, [14] * 4 + list(range(300, 336)), room=902)  # the link is still in step
    assert d_out["meta_info"]["finish_reason"]["type"] == "length"
    assert_clean(prefill, decode)


def test_pd_prefill_failure_fails_the_decode_half_at_once(engines):
    prefill, decode, _ = engines
    ids = [11] * 4 + list(range(150, 206))
    with ThreadPoolExecutor(1) as pool:
        d = pool.submit(decode.generate, input_ids=ids, sampling_params=GREEDY, bootstrap_room=601)
        wait_until(lambda: decode.get_stats()["pd_receiving"] == 1, 60, "the decode half to wait")
        q: queue.Queue = queue.Queue()
        req = prefill.make_request(q.put, input_ids=ids, sampling_params=GREEDY, rid="fault-forward-601", bootstrap_room=601)
        prefill.submit(req)
        p_out = q.get(timeout=60)
        t0 = time.monotonic()
        out = d.result(timeout=60)
    assert p_out.meta_info["finish_reason"]["status"] == 500
    fr = out["meta_info"]["finish_reason"]
    assert fr["status"] == 502 and "prefill worker failed" in fr["message"] and time.monotonic() - t0 < 20, fr
    assert_clean(prefill, decode)


def test_pd_prompts_tokenized_differently_fail_both_halves_clearly(engines):
    prefill, decode, _ = engines
    p_out, d_out = run_pair(prefill, decode, [12] * 4 + list(range(250, 276)), room=701, prefill_ids=[12] * 4 + list(range(251, 277)))
    for out, status in ((p_out, 500), (d_out, 502)):
        fr = out["meta_info"]["finish_reason"]
        assert fr["type"] == "abort" and fr["status"] == status and "tokenized this prompt differently" in fr["message"]
    assert_clean(prefill, decode)


def test_pd_decode_half_without_a_prefill_half_times_out_and_frees(tiny_llama):
    with paired(tiny_llama, timeout=1.5) as (prefill, decode):
        t0 = time.monotonic()
        out = decode.generate(input_ids=list(range(10, 50)), sampling_params=GREEDY, bootstrap_room=1)
        fr = out["meta_info"]["finish_reason"]
        assert fr["status"] == 504 and "did not arrive" in fr["message"] and time.monotonic() - t0 < 30
        out = prefill.generate(input_ids=list(range(10, 50)), sampling_params=GREEDY, bootstrap_room=2)
        assert out["meta_info"]["finish_reason"]["status"] == 504  # nobody asked for it
        assert_clean(prefill, decode)


def test_pd_prefill_worker_gone_fails_waiting_requests_and_decode_keeps_serving(tiny_llama):
    with paired(tiny_llama, timeout=20) as (prefill, decode):
        with ThreadPoolExecutor(1) as pool:
            d = pool.submit(decode.generate, input_ids=list(range(10, 50)), sampling_params=GREEDY, bootstrap_room=3)
            wait_until(lambda: decode.get_stats()["pd_receiving"] == 1, 60, "the decode half to wait")
            prefill.shutdown()
            out = d.result(timeout=60)
        fr = out["meta_info"]["finish_reason"]
        assert fr["status"] == 503 and "prefill worker" in fr["message"], fr
        assert decode.is_alive()
        plain = decode.generate(input_ids=list(range(10, 50)), sampling_params=GREEDY)
        assert len(plain["output_ids"]) == GREEDY["max_new_tokens"]
        out = decode.generate(input_ids=list(range(10, 50)), sampling_params=GREEDY, bootstrap_room=4)
        assert out["meta_info"]["finish_reason"]["status"] == 503
        assert_clean(decode)
        assert decode.get_stats()["pd_link_up"] is False


def test_pd_a_restarted_decode_worker_joins_the_same_prefill_worker(tiny_llama):
    prefill, decode = start_pair(tiny_llama, timeout=20)
    try:
        decode.shutdown()
        boot = prefill.args.disaggregation_bootstrap
        decode = Engine(model_path=tiny_llama, max_total_tokens=1024, disaggregation_mode="decode", disaggregation_bootstrap=boot, disaggregation_timeout=20)
        ids = list(range(20, 45))
        wait_until(lambda: prefill.get_stats()["pd_link_up"], 60, "the prefill side to take the new decode worker")
        _, d_out = run_pair(prefill, decode, ids, room=9)
        assert d_out["meta_info"]["finish_reason"]["type"] == "length" and d_out["meta_info"]["pd"]["received_tokens"] == len(ids) - 1
        assert_clean(prefill, decode)
    finally:
        decode.shutdown()
        prefill.shutdown()


def test_pd_layouts_that_differ_are_refused_with_the_field_named(tiny_llama):
    with paired(tiny_llama, timeout=2, decode_extra={"kv_cache_dtype": "int8"}) as (prefill, decode):
        out = decode.generate(input_ids=list(range(10, 30)), sampling_params=GREEDY, bootstrap_room=5)
        fr = out["meta_info"]["finish_reason"]
        assert fr["status"] == 503 and "KV layouts differ" in fr["message"] and "kv_format" in fr["message"], fr
        assert_clean(decode)


def test_bootstrap_room_and_disaggregation_options_are_validated(engines):
    _, decode, single = engines
    with pytest.raises(ValueError, match="bootstrap_room applies only"):
        single.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, bootstrap_room=1)
    with pytest.raises(ValueError, match="bootstrap_room must be an integer"):
        decode.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, bootstrap_room=-1)
    with pytest.raises(ValueError, match="n must be 1"):
        decode.generate(input_ids=[1, 2, 3], sampling_params={**GREEDY, "n": 2}, bootstrap_room=1)
    for kwargs, match in [
        ({"disaggregation_mode": "prefill"}, "needs disaggregation_bootstrap"),
        ({"disaggregation_bootstrap": "127.0.0.1:1"}, "applies only with disaggregation_mode"),
        ({"disaggregation_mode": "decode", "disaggregation_bootstrap": "nohost"}, "HOST:PORT"),
        ({"disaggregation_mode": "decode", "disaggregation_bootstrap": "h:1", "tp_size": 2}, "tp_size"),
        ({"disaggregation_mode": "sideways", "disaggregation_bootstrap": "h:1"}, "disaggregation_mode"),
    ]:
        with pytest.raises(ValueError, match=match):
            ServerArgs.from_kwargs(**kwargs)


def test_pd_prompt_logprobs_are_computed_on_the_decode_side(engines):
    prefill, decode, single = engines
    ids = [13] * 4 + list(range(320, 346))
    params = {**GREEDY, "max_new_tokens": 3}
    with ThreadPoolExecutor(1) as pool:
        p = pool.submit(prefill.generate, input_ids=ids, sampling_params=params, bootstrap_room=801)
        d_out = decode.generate(input_ids=ids, sampling_params=params, bootstrap_room=801, return_logprob=True, logprob_start_len=0)
        p_out = p.result(timeout=60)
    ref = single.generate(input_ids=ids, sampling_params=params, return_logprob=True, logprob_start_len=0)
    assert d_out["output_ids"] == ref["output_ids"] and "pd" not in d_out["meta_info"]
    assert len(d_out["meta_info"]["input_token_logprobs"]) == len(ids)
    assert p_out["meta_info"]["finish_reason"]["type"] == "length"
    assert_clean(prefill, decode)


def test_pd_threads_end_with_their_engines(tiny_llama):
    before = {t.name for t in threading.enumerate()}
    prefill, decode = start_pair(tiny_llama)
    decode.shutdown()
    prefill.shutdown()
    wait_until(lambda: not ({t.name for t in threading.enumerate()} - before) & {"radixlm-kv-send", "radixlm-kv-recv"}, 30, "the link threads to end")


# ------------------------------------------------------------ through HTTP and the router
@contextlib.contextmanager
def pd_stack(engines):
    """The pair and the single engine served over HTTP, and a --pd-disaggregation router in front."""
    from helpers import ServerThread
    from radixlm.runtime.entrypoints.http.server import create_app
    from radixlm.runtime.entrypoints.router.app import create_router_app
    from radixlm.runtime.entrypoints.router.config import RouterConfig

    prefill, decode, single = engines
    servers = [ServerThread(create_app(e, served_model_name="tiny"), lifespan="off").start() for e in engines]
    router_app = create_router_app(RouterConfig(pd_disaggregation=True, prefill_url=servers[0].url, decode_url=servers[1].url, health_check_interval=0.2))
    router = ServerThread(router_app).start()
    try:
        yield router.url, servers[2].url
    finally:
        router.stop(force=False)
        for s in servers:
            s.stop(force=False)


def test_pd_through_the_router_matches_a_single_server_streamed_or_not(engines):
    import jsonschema
    import openai

    with pd_stack(engines) as (router_url, single_url):
        pd = openai.OpenAI(base_url=router_url + "/v1", api_key="none", max_retries=0)
        one = openai.OpenAI(base_url=single_url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a prime number."}]
        kw = dict(model="tiny", messages=messages, max_tokens=12, temperature=0)
        ref = one.chat.completions.create(**kw)
        got = pd.chat.completions.create(**kw)
        assert got.choices[0].message.content == ref.choices[0].message.content
        assert got.usage.prompt_tokens == ref.usage.prompt_tokens and got.usage.completion_tokens == ref.usage.completion_tokens
        again = pd.chat.completions.create(**kw)
        assert again.usage.prompt_tokens_details.cached_tokens > 0, "the decode side's own radix tree holds the repeat"
        streamed = "".join(c.choices[0].delta.content or "" for c in pd.chat.completions.create(**kw, stream=True) if c.choices)
        assert streamed == ref.choices[0].message.content
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        out = pd.chat.completions.create(**{**kw, "max_tokens": 40}, response_format=fmt)
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"], "additionalProperties": False}}}
        named = {"type": "function", "function": {"name": "get_weather"}}
        call = pd.chat.completions.create(**{**kw, "max_tokens": 60}, tools=[tool], tool_choice=named).choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    assert_clean(*engines)


def test_pd_client_disconnect_through_the_router_aborts_both_halves(engines):
    prefill, decode, _ = engines
    with pd_stack(engines) as (router_url, _):
        before = decode.get_stats()["forward_passes"]
        body = {"text": "Once upon a time", "stream": True, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        with httpx.Client(timeout=30) as c, c.stream("POST", router_url + "/generate", json=body) as resp:
            assert resp.status_code == 200
            assert next(resp.iter_lines()).startswith("data:")
        wait_until(lambda: decode.get_stats()["num_running"] == 0, 60, "the decode half to end")
        # the tiny model makes ~1000 tokens/s: the steps taken, not the time, tell an abort
        steps = decode.get_stats()["forward_passes"] - before
        assert steps < 3000, f"the decode half ran on for {steps} of its 4000 steps: the disconnect did not abort it"
        # a prefill half that fails reaches the client as its error, and the decode half ends
        r = httpx.post(router_url + "/generate", json={"text": "Once upon a time", "rid": "fault-forward-pd", "sampling_params": {"max_new_tokens": 4}}, timeout=60)
        assert r.status_code in (500, 502) and "forward pass failed" in r.json()["message"], r.text  # whichever side answers first
        wait_until(lambda: decode.get_stats()["pd_receiving"] == 0, 30, "the decode half to be freed")
    assert_clean(prefill, decode)
