"""Tensor parallelism on CPU with gloo: shard plans, greedy output equal to one process, and faults.

Every tensor-parallel engine here is a real process group (workers are spawned processes), so
the tests share engines where they can: each start costs a few seconds.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

import radixlm
from radixlm.runtime.engine import EngineError
from radixlm.runtime.models.config import ModelConfig
from radixlm.runtime.models.sharding import QUANT_GROUP, plan_shard

PROMPTS = [
    "The quick brown fox jumps over",
    "The quick brown fox jumps over the lazy dog. Radix trees share prefixes",  # shares a prefix
    "Question: what is two plus two? Answer:",
    '{"name": "Ada", "age": 36, "tags": ["math"',
]
GREEDY = {"max_new_tokens": 16, "temperature": 0}


def _config(heads: int, kv_heads: int, vocab: int = 49152, inter: int = 1536) -> ModelConfig:
    return ModelConfig("llama", vocab, 576, inter, 2, heads, kv_heads, 64)


# ------------------------------------------------------------------ shard plans
@pytest.mark.parametrize(
    "heads, kv_heads, size, expect_kv",
    [
        (9, 3, 2, [(0, 2), (2, 3)]),  # SmolLM2 at tp=2: whole KV groups, 2 and 1
        (9, 3, 3, [(0, 1), (1, 2), (2, 3)]),  # SmolLM2 at tp=3: one group each
        (8, 2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # fewer KV heads than ranks: replicated
        (4, 4, 1, [(0, 4)]),
    ],
)
def test_shard_plan_keeps_query_heads_with_their_kv_head_and_covers_every_head(heads, kv_heads, size, expect_kv):
    cfg = _config(heads, kv_heads, vocab=49153, inter=1568)  # 49 groups of 32: no even split
    shards = [plan_shard(cfg, r, size) for r in range(size)]
    assert [s.kv_heads for s in shards] == expect_kv
    group = heads // kv_heads
    covered = []
    for s in shards:
        covered += range(*s.heads)
        # every local query head reads a local KV head, in a uniform group
        assert s.num_heads % s.num_kv_heads == 0
        assert all(s.kv_heads[0] <= h // group < s.kv_heads[1] for h in range(*s.heads))
    assert covered == list(range(heads))
    assert [x for s in shards for x in range(*s.intermediate)] == list(range(1568))
    assert all(s.intermediate_size % QUANT_GROUP == 0 for s in shards)  # the down projection can still be int4
    assert [x for s in shards for x in range(*s.vocab)] == list(range(49153))
    assert all(s.vocab_size <= s.vocab_per_rank for s in shards)


@pytest.mark.parametrize("heads, kv_heads, size", [(4, 2, 3), (9, 3, 6)])
def test_shard_plan_refuses_a_split_that_breaks_grouped_query_attention(heads, kv_heads, size):
    with pytest.raises(ValueError, match=f"tp_size {size}"):
        plan_shard(_config(heads, kv_heads), 0, size)


def test_an_unsplittable_model_is_refused_before_any_worker_starts(tiny_llama):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="tp_size 3 cannot split"):
        radixlm.Engine(model_path=tiny_llama, tp_size=3, max_total_tokens=512)  # 4 heads, 2 KV heads
    assert set(multiprocessing.active_children()) == before


def test_tp_options_are_validated_with_their_names(tiny_llama):
    with pytest.raises(ValueError, match="tp_size must be a positive integer"):
        radixlm.Engine(model_path=tiny_llama, tp_size=0)
    with pytest.raises(ValueError, match="speculative_algorithm='draft'"):
        radixlm.Engine(model_path=tiny_llama, tp_size=2, speculative_algorithm="draft")


def test_each_rank_loads_exactly_its_slices_and_quantizes_them_with_the_full_models_groups(tp_models):
    import torch

    from radixlm.runtime.layers.quant import quantize_model
    from radixlm.runtime.loader import load_model

    path = tp_models["groups3"]
    full, cfg = load_model(path, torch.float32, torch.device("cpu"))
    quantize_model(full, "int4")
    x = torch.randn(5, cfg.hidden_size)
    d, q_all = cfg.head_dim, cfg.num_heads * cfg.head_dim
    full_qkv = full.layers[0].self_attn.qkv_proj(x)
    full_up = full.layers[1].mlp.gate_up_proj(x)
    down_in = torch.randn(5, cfg.intermediate_size)
    down_sum = torch.zeros(5, cfg.hidden_size)
    for rank in range(2):
        shard = plan_shard(cfg, rank, 2)
        model, _ = load_model(path, torch.float32, torch.device("cpu"), rank=rank, size=2)
        assert model.embed_tokens.weight.shape[0] == shard.vocab_size
        quantize_model(model, "int4")
        h, k = shard.heads, shard.kv_heads
        rows = [*range(h[0] * d, h[1] * d)] + [q_all + i for i in range(k[0] * d, k[1] * d)]
        rows += [q_all + cfg.num_kv_heads * d + i for i in range(k[0] * d, k[1] * d)]
        # column-parallel: the rank's output rows, bit for bit (same int4 groups)
        assert torch.equal(model.layers[0].self_attn.qkv_proj(x), full_qkv[:, rows])
        i0, i1 = shard.intermediate
        up_rows = [*range(i0, i1)] + [cfg.intermediate_size + i for i in range(i0, i1)]
        assert torch.equal(model.layers[1].mlp.gate_up_proj(x), full_up[:, up_rows])
        # row-parallel: partial sums over the rank's input columns add up to the full product
        down_sum += model.layers[1].mlp.down_proj(down_in[:, i0:i1])
    torch.testing.assert_close(down_sum, full.layers[1].mlp.down_proj(down_in), rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------ parity
def _run_scenarios(engine: radixlm.Engine) -> list:
    """Greedy tokens and logprobs over a mixed batch, then again from the radix cache."""
    first = engine.generate(PROMPTS, GREEDY, return_logprob=True)
    again = engine.generate(PROMPTS[:2], GREEDY, return_logprob=True)  # cache hits
    assert again[1]["meta_info"]["cached_tokens"] > 0
    engine.check_accounting()
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in first + again]


def _assert_same_greedy(reference: list, got: list) -> None:
    for (ref_ids, ref_lp), (ids, lp) in zip(reference, got):
        assert ids == ref_ids
        # the all-reduce sums partial products in another order: logprobs agree to fp32 rounding
        assert max(abs(a - b) for a, b in zip(ref_lp, lp)) < 1e-3


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory) -> dict[str, str]:
    """Tiny checkpoints shaped for the split cases: SmolLM2's 3 KV groups, one KV head, biases."""
    from helpers import make_tiny_model

    root = tmp_path_factory.mktemp("tp_models")
    return {
        # 6 query heads in 3 KV groups (SmolLM2's layout, scaled down); vocab 403 splits unevenly
        "groups3": make_tiny_model("llama", root / "groups3", hidden_size=96, num_attention_heads=6, num_key_value_heads=3),
        # one KV head replicated on both ranks; q/k/v biases and a tied head
        "kv1": make_tiny_model("qwen2", root / "kv1", num_key_value_heads=1),
    }


@pytest.mark.parametrize("model, sizes", [("groups3", (2, 3)), ("kv1", (2,))])
def test_tp_greedy_output_equals_one_process_on_tiny_models(tp_models, model, sizes):
    opts = {"model_path": tp_models[model], "max_total_tokens": 2048, "chunked_prefill_size": 8, "page_size": 4}
    with radixlm.Engine(**opts) as engine:
        reference = _run_scenarios(engine)
    for size in sizes:
        with radixlm.Engine(tp_size=size, **opts) as engine:
            assert engine.runner.tp_size == size
            _assert_same_greedy(reference, _run_scenarios(engine))


def test_smollm2_greedy_output_is_identical_at_tp_2(smollm2_path):
    """SmolLM2's 3 KV groups split 2 + 1 (tp=3 is the tiny ``groups3`` case above). Ranks split
    dense weights, so the single process dequantizes the GGUF file too (--quantization none)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colors:"]
    params = {"max_new_tokens": 16, "temperature": 0}
    outputs = {}
    for size in (1, 2):
        with radixlm.Engine(model_path=smollm2_path, tp_size=size, max_total_tokens=1024, quantization="none") as engine:
            outputs[size] = [o["output_ids"] for o in engine.generate(prompts, params)]
            stats = engine.get_stats()
    assert outputs[2] == outputs[1]
    assert stats["tp_size"] == 2 and stats["tp_all_reduce_seconds"] > 0


# ------------------------------------------------------------------ faults
def _wait(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_a_killed_worker_stops_the_engine_with_a_clear_error_and_leaves_no_process(tiny_llama):
    before = set(multiprocessing.active_children())
    engine = radixlm.Engine(model_path=tiny_llama, tp_size=2, max_total_tokens=1024)
    workers = set(multiprocessing.active_children()) - before
    assert len(workers) == 1
    assert engine.generate("The quick", {"max_new_tokens": 4})["meta_info"]["finish_reason"]["type"] == "length"
    stream = engine.generate("The quick brown", {"max_new_tokens": 2000, "ignore_eos": True}, stream=True)
    next(stream)  # the request is running
    os.kill(next(iter(workers)).pid, signal.SIGKILL)
    events = list(stream)
    final = events[-1]["meta_info"]["finish_reason"]
    assert final["type"] == "abort" and "tensor-parallel worker 1" in final["message"]
    assert _wait(lambda: not engine.is_alive())
    with pytest.raises(EngineError):
        engine.generate("The quick", {"max_new_tokens": 2})
    engine.shutdown()
    assert _wait(lambda: set(multiprocessing.active_children()) == before)


def test_a_worker_that_raises_fails_every_waiter_with_its_error_and_leaves_no_process(tiny_llama):
    import asyncio

    before = set(multiprocessing.active_children())
    engine = radixlm.Engine(model_path=tiny_llama, tp_size=2, max_total_tokens=1024, debug_fault_injection=True)

    async def final(rid: str, max_new_tokens: int):
        _, q = await engine.start_request(prompt="The quick", sampling_params={"max_new_tokens": max_new_tokens, "ignore_eos": True}, rid=rid)
        while not (out := await asyncio.wait_for(q.get(), 120)).finished:
            pass
        return out.meta_info["finish_reason"]

    async def both():
        bystander = asyncio.ensure_future(final("ok-1", 2000))
        await asyncio.sleep(0)  # the bystander is queued first
        return await asyncio.gather(final("fault-tp_worker-1", 4), bystander)

    for reason in asyncio.run(both()):
        assert reason["type"] == "abort" and reason["status"] == 503
        assert "tensor-parallel worker 1 failed" in reason["message"] and "injected fault" in reason["message"]
    assert not engine.is_alive()
    engine.shutdown()
    assert _wait(lambda: set(multiprocessing.active_children()) == before)


def test_a_worker_killed_between_requests_turns_the_engine_unhealthy(tiny_llama):
    before = set(multiprocessing.active_children())
    engine = radixlm.Engine(model_path=tiny_llama, tp_size=2, max_total_tokens=1024)
    (worker,) = set(multiprocessing.active_children()) - before
    worker.kill()
    assert _wait(lambda: not engine.is_alive())  # noticed while idle, not at the next request
    assert "tensor-parallel worker 1" in str(engine.error)
    engine.shutdown()
    assert _wait(lambda: set(multiprocessing.active_children()) == before)


def test_shutdown_joins_every_worker(tiny_llama):
    before = set(multiprocessing.active_children())
    engine = radixlm.Engine(model_path=tiny_llama, tp_size=2, max_total_tokens=1024)
    workers = set(multiprocessing.active_children()) - before
    engine.generate("The quick", {"max_new_tokens": 2})
    engine.shutdown()
    assert all(not w.is_alive() and w.exitcode == 0 for w in workers)  # stopped politely, not killed


# ------------------------------------------------------------------ the server
def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def test_server_with_tp_2_serves_the_openai_client_and_exits_nonzero_when_a_worker_dies(tiny_llama):
    import openai

    from helpers import ServerProcess

    server = ServerProcess(tiny_llama, "--tp-size", "2", "--max-total-tokens", "2048", "--served-model-name", "tiny")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
        assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens > 0
        chunks = list(client.completions.create(model="tiny", prompt="The quick", max_tokens=8, stream=True, temperature=0))
        assert "".join(c.choices[0].text for c in chunks if c.choices)
        workers = [pid for pid in _children(server.proc.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 1
        stream = client.completions.create(model="tiny", prompt="The quick", max_tokens=3000, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        scrapes: list[int] = []

        def scrape() -> None:  # /metrics calls queued on the engine loop as it dies must not hang the exit
            with httpx.Client(base_url=server.base_url, timeout=30) as c:
                while server.proc.poll() is None:
                    try:
                        scrapes.append(c.get("/metrics").status_code)
                    except httpx.HTTPError:
                        return

        scraper = threading.Thread(target=scrape, daemon=True)
        scraper.start()
        os.kill(workers[0], signal.SIGKILL)
        with pytest.raises(openai.APIError, match="tensor-parallel worker"):
            for _ in stream:
                pass
        assert server.proc.wait(timeout=60) == 1, "the server must exit 1 once its engine died"
        scraper.join(60)
        assert not scraper.is_alive() and scrapes, "every /metrics call got an answer"
        assert _wait(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 30)
    finally:
        server.stop()


def test_a_ready_report_read_while_joining_still_counts():
    """A worker that loads before rank 0 has joined reports ready into the failure check's read."""
    import multiprocessing as mp
    import threading
    from types import SimpleNamespace

    from radixlm.runtime.executor.tp_driver import TPDriver

    receive, send = mp.Pipe(duplex=False)
    send.send(("ready", None))
    driver = TPDriver.__new__(TPDriver)
    alive, _keep = mp.Pipe(duplex=False)  # a waitable that never fires: the worker's exit sentinel
    driver.conns, driver.workers = [receive], [SimpleNamespace(is_alive=lambda: True, exitcode=None, sentinel=alive)]
    driver.failure, driver._lock, driver._ready, driver._closing = None, threading.RLock(), set(), False
    driver._watcher, driver._on_failure = None, None
    driver.check(wait_s=0.0)  # what _join does while the group forms: it reads the report
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (driver.wait_ready(), done.set()), daemon=True)
    waiter.start()
    assert done.wait(30), "wait_ready waited for a report already read"
    driver._closing = True
    driver._watcher.join(30)
