"""Stress: many requests with random lengths and settings through a pool a quarter their size."""

from __future__ import annotations

import random

import pytest

from helpers import Driver
from radixlm import ServerArgs
from radixlm.runtime.engine import build_parts


def _random_request(rng: random.Random, shared: list[int]) -> tuple[list[int], dict]:
    n = rng.randrange(1, 120)
    ids = [rng.randrange(3, 390) for _ in range(n)]
    if rng.random() < 0.5:
        ids = shared[: rng.randrange(1, len(shared))] + ids
    params = {
        "max_new_tokens": rng.randrange(0, 40),
        "temperature": rng.choice([0.0, 0.7, 1.0, 1.3]),
        "top_p": rng.choice([1.0, 0.9, 0.5]),
        "top_k": rng.choice([-1, 1, 5, 50]),
        "min_p": rng.choice([0.0, 0.05]),
        "ignore_eos": rng.random() < 0.5,
        "frequency_penalty": rng.choice([0.0, 0.5]),
        "repetition_penalty": rng.choice([1.0, 1.2]),
        "seed": rng.choice([None, rng.randrange(1000)]),
    }
    if rng.random() < 0.2:
        params["stop"] = ["e", "th"]
    return ids, params


@pytest.mark.parametrize("headroom", ["normal", "starved"])
def test_200_random_requests_through_a_quarter_sized_pool_all_finish_without_leaks(tiny_llama, headroom):
    """``starved`` forces the scheduler to admit with almost no decode headroom, so it must retract."""
    rng = random.Random(2024)
    shared = [rng.randrange(3, 390) for _ in range(80)]
    requests = [_random_request(rng, shared) for _ in range(200)]
    need = sum(len(ids) + p["max_new_tokens"] for ids, p in requests)
    rt = build_parts(ServerArgs(model_path=tiny_llama, max_total_tokens=need // 4, max_running_requests=64 if headroom == "normal" else 128, chunked_prefill_size=512, page_size=1))
    d = Driver(rt)
    pending = list(requests)
    rids: list[str] = []
    aborted: set[str] = set()
    for _ in range(100):  # half arrive at once, the rest in bursts while others run
        ids, params = pending.pop()
        rids.append(d.add(ids, **params))

    def on_step(i: int) -> None:
        if headroom == "starved":
            rt.scheduler.new_token_ratio = 0.0
        for _ in range(rng.randrange(0, 6)):  # bursts of arrivals while others run
            if pending:
                ids, params = pending.pop()
                rids.append(d.add(ids, **params))
        if i % 17 == 5 and rids:  # abort a request now and then, waiting or running
            rid = rng.choice(rids)
            if rid not in d.results and rt.scheduler.abort(rid):
                aborted.add(rid)

    d.run(max_steps=20_000, on_step=on_step)
    while pending:
        ids, params = pending.pop()
        rids.append(d.add(ids, **params))
        d.run()
    assert len(d.results) == 200
    for rid in rids:
        out = d.results[rid]
        reason = out.meta_info["finish_reason"]["type"]
        assert reason in ("stop", "length", "abort")
        if rid not in aborted:
            assert reason != "abort", out.meta_info
    if headroom == "starved":
        assert rt.scheduler.total_retracted > 0, "the pool never ran short: the test lost its point"
    rt.scheduler.check_accounting()
    kv = rt.kv
    assert kv.allocator.available_slots() + kv.tree.total_size() == kv.allocator.num_slots
    assert kv.tree.protected_size() == 0
