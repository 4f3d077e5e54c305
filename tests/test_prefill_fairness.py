"""A long prompt's chunked prefill gives way to short requests, for a bounded share of its time.

Steps are counted, never seconds: the scheduler's clock is replaced by a virtual one in which a
forward pass lasts 1 ms per token it computes (a decode step is cheap, a chunk is not).
"""

from __future__ import annotations

import types

import pytest

from helpers import Driver
from radixlm import ServerArgs
from radixlm.runtime.engine import build_parts
from radixlm.runtime.scheduler import (
    forward as scheduler_module,  # the forward pass reads the clock
)

CHUNK = 16
LONG_PROMPT = [(i * 37) % 380 + 5 for i in range(40 * CHUNK)]  # 40 chunks
SHORT_PROMPT = [11, 12, 13, 14, 15, 16]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _runtime(model_path: str, monkeypatch: pytest.MonkeyPatch, **options):
    """A scheduler to drive by hand, on a virtual clock (``rt.clock.now``: seconds so far)."""
    rt = build_parts(ServerArgs(model_path=model_path, max_total_tokens=8192, chunked_prefill_size=CHUNK, page_size=1, **options))
    clock = types.SimpleNamespace(now=0.0)
    forward = rt.runner.forward

    def timed_forward(batch):
        clock.now += 1e-3 * len(batch.input_ids)
        return forward(batch)

    monkeypatch.setattr(rt.runner, "forward", timed_forward)
    monkeypatch.setattr(scheduler_module, "time", types.SimpleNamespace(perf_counter=lambda: clock.now, monotonic=scheduler_module.time.monotonic))
    rt.clock = clock
    return rt


def _find(sched, rid: str):
    return next(r for r in sched.running + sched.waiting if r.rid == rid)


def _alone(model_path: str, monkeypatch: pytest.MonkeyPatch, prompt: list[int], max_new_tokens: int) -> list[int]:
    d = Driver(_runtime(model_path, monkeypatch))
    rid = d.add(prompt, max_new_tokens=max_new_tokens, **GREEDY)
    d.run()
    return d.results[rid].output_ids


def test_a_short_request_arriving_mid_prefill_finishes_before_the_long_prompt_does(tiny_llama, monkeypatch):
    rt = _runtime(tiny_llama, monkeypatch)
    d = Driver(rt)
    d.add(LONG_PROMPT, rid="long", max_new_tokens=4, **GREEDY)
    for _ in range(3):
        d.step()
        assert rt.scheduler.stats.num_prefills_paused == 0, "alone, the long prompt must never pause"
    long = _find(rt.scheduler, "long")
    assert long.kv.kv_len == 3 * CHUNK
    d.add(SHORT_PROMPT, rid="short", max_new_tokens=4, **GREEDY)
    steps = 0
    while "short" not in d.results:
        d.step()
        steps += 1
        assert steps <= 4, "the short request waited behind the long prompt's chunks"
    assert not long.generating and long.kv.kv_len == 3 * CHUNK, "the long prompt kept computing while the short one ran"
    d.run()
    assert d.results["short"].output_ids == _alone(tiny_llama, monkeypatch, SHORT_PROMPT, 4)
    assert d.results["long"].output_ids == _alone(tiny_llama, monkeypatch, LONG_PROMPT, 4)


def test_a_long_prompt_stops_giving_way_once_its_share_of_time_is_spent(tiny_llama, monkeypatch):
    rt = _runtime(tiny_llama, monkeypatch)
    sched, d = rt.scheduler, Driver(rt)
    d.add(SHORT_PROMPT, rid="endless", max_new_tokens=3000, **GREEDY)  # decodes for the whole test
    d.step()
    d.add(LONG_PROMPT, rid="long", max_new_tokens=1, **GREEDY)
    paused_s = run_s = 0.0
    for _ in range(2000):
        before = rt.clock.now
        d.step()
        seconds = rt.clock.now - before
        if sched.stats.num_prefills_paused:
            paused_s += seconds
        else:
            run_s += seconds
        if "long" in d.results:
            break
    assert "long" in d.results, "the long prompt never finished: an endless decode starved it"
    assert paused_s > 0, "the long prompt never gave way to the decoding request"
    # In this clock every chunk step costs the same, so the expected prefill time is exact.
    assert paused_s <= sched.prefill_yield_share * run_s + 1e-3 + 1e-9
    assert not sched.prefill_clocks, "a finished prompt kept its clock"
    assert sched.abort("endless")
    d.run()


def test_a_long_prompt_does_not_pause_for_a_request_that_cannot_be_admitted(tiny_llama, monkeypatch):
    rt = _runtime(tiny_llama, monkeypatch, max_running_requests=1)
    d = Driver(rt)
    d.add(LONG_PROMPT, rid="long", max_new_tokens=2, **GREEDY)
    d.step()
    d.add(SHORT_PROMPT, rid="short", max_new_tokens=2, **GREEDY)  # waits: one request at a time
    long = _find(rt.scheduler, "long")
    for i in range(2, 6):
        d.step()
        assert long.kv.kv_len == i * CHUNK // 2 + CHUNK // 2, "the long prompt sat out a step for a request it cannot run with"
    d.run()
    assert d.results["long"].meta_info["finish_reason"]["type"] == "length"
    assert d.results["short"].output_ids == _alone(tiny_llama, monkeypatch, SHORT_PROMPT, 2)


def test_prefill_pausing_can_be_turned_off(tiny_llama, monkeypatch):
    rt = _runtime(tiny_llama, monkeypatch)
    rt.scheduler.prefill_yield_share = 0.0
    d = Driver(rt)
    d.add(LONG_PROMPT, rid="long", max_new_tokens=1, **GREEDY)
    d.step()
    d.add(SHORT_PROMPT, rid="short", max_new_tokens=4, **GREEDY)
    long = _find(rt.scheduler, "long")
    while "short" not in d.results:
        d.step()
        assert rt.scheduler.stats.num_prefills_paused == 0
    assert long.kv.kv_len > CHUNK, "with a zero share the long prompt keeps its chunks"
    d.run()


def test_a_prompt_cut_short_only_because_the_step_was_full_does_not_pause(tiny_llama, monkeypatch):
    rt = _runtime(tiny_llama, monkeypatch)
    d = Driver(rt)
    d.add(SHORT_PROMPT + [17, 18, 19, 20], rid="first", max_new_tokens=4, **GREEDY)  # 10 tokens
    d.add(SHORT_PROMPT * 2, rid="second", max_new_tokens=4, **GREEDY)  # 12 tokens: 6 fit this step
    d.step()
    second = _find(rt.scheduler, "second")
    assert second.kv.kv_len == CHUNK - 10
    d.step()  # "first" decodes; "second" is not a long prompt and finishes its prefill alongside
    assert rt.scheduler.stats.num_prefills_paused == 0 and second.generating
    d.run()
    assert not rt.scheduler.prefill_clocks
