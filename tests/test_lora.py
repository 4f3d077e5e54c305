"""Batched multi-LoRA: adapter folders read and checked, mixed batches equal to peft-merged
transformers row by row, KV keyed by adapter, the adapter pool's LRU and per-batch bounds."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

import radixlm
from helpers import FakeAdapter, make_adapter, wait_until
from radixlm.runtime.loader import load_model_config as load_config
from radixlm.runtime.lora.adapter import load_adapter
from radixlm.runtime.lora.batch import LoraBatch, add_lora_deltas, segments_of, stacked_plan
from radixlm.runtime.lora.manager import parse_lora_paths
from radixlm.runtime.lora.pool import LoraPool

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def merged_model(base: str, adapter: str | None):
    """transformers' model of ``base`` with ``adapter`` merged into its weights by peft."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
    if adapter is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation of ``ids`` by full forward passes."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


@pytest.fixture(scope="module")
def adapters(lora_adapters: dict[str, str]) -> dict[str, str]:
    """Three tiny random adapters of the tiny Llama (``LORA_ADAPTERS``)."""
    return lora_adapters


@pytest.fixture(scope="module")
def engine(tiny_llama: str, adapters: dict[str, str]):
    paths = [f"{name}={path}" for name, path in adapters.items()]
    with radixlm.Engine(model_path=tiny_llama, max_total_tokens=4096, max_running_requests=16, lora_paths=paths) as eng:
        yield eng


PROMPTS = [[5, 9, 23, 41, 7, 88, 13], [17, 3, 64, 29, 51], [99, 12, 45, 8, 31, 77, 6, 20, 11], [33, 44, 55]]


def test_mixed_batch_equals_each_adapter_merged_by_peft(engine, tiny_llama, adapters, monkeypatch):
    """Every row of one batch (base rows and three adapters, prefill then decode together) gets
    the greedy tokens of transformers with its adapter merged, run alone."""
    lora, seen = engine.runner.lora, []
    batch_for = lora.batch_for

    def recording(lengths, names):
        seen.append(set(names))
        return batch_for(lengths, names)

    monkeypatch.setattr(lora, "batch_for", recording)
    names = [None, "attn", "mlp", "fused"]
    expected = {}
    for name in names:
        model = merged_model(tiny_llama, None if name is None else adapters[name])
        expected[name] = [hf_greedy(model, ids, GREEDY["max_new_tokens"]) for ids in PROMPTS]
    assert len({str(v) for v in expected.values()}) == 4, "the adapters must change the outputs"

    async def one(i: int, name: str | None, ids: list[int]):
        return name, i, await engine.async_generate(input_ids=ids, sampling_params=GREEDY, lora=name)

    async def main():
        jobs = [one(i, name, ids) for i, ids in enumerate(PROMPTS) for name in names]
        return await asyncio.gather(*jobs)

    for name, i, out in asyncio.run(main()):
        assert out["output_ids"] == expected[name][i], (name, i)
    assert max(map(len, seen)) == 4  # base rows and all three adapters in one pass
    for name in names[1:]:  # alone (one adapter a pass: the segment-by-segment path), away from the cached KV
        out = engine.generate(input_ids=PROMPTS[2], sampling_params=GREEDY, lora=name, cache_salt="alone")
        assert out["meta_info"]["cached_tokens"] == 0 and out["output_ids"] == expected[name][2], name
    engine.check_accounting()


def test_same_prompt_under_another_adapter_never_hits_its_kv(engine):
    ids = [7, 19, 23, 61, 2, 90, 14, 33, 8, 41, 52, 6]
    first = engine.generate(input_ids=ids, sampling_params=GREEDY, lora="attn")
    assert first["meta_info"]["cached_tokens"] == 0
    other = engine.generate(input_ids=ids, sampling_params=GREEDY, lora="mlp")
    assert other["meta_info"]["cached_tokens"] == 0
    base = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert base["meta_info"]["cached_tokens"] == 0
    again = engine.generate(input_ids=ids, sampling_params=GREEDY, lora="attn")
    assert again["meta_info"]["cached_tokens"] == len(ids) - 1
    assert again["output_ids"] == first["output_ids"]
    salted = engine.generate(input_ids=ids, sampling_params=GREEDY, lora="attn", cache_salt="tenant")
    assert salted["meta_info"]["cached_tokens"] == 0
    engine.check_accounting()


def test_unknown_adapter_is_refused_naming_lora(engine, tiny_llama):
    with pytest.raises(ValueError, match="lora"):
        engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, lora="nope")
    with radixlm.Engine(model_path=tiny_llama, max_total_tokens=1024) as plain:
        with pytest.raises(ValueError, match="lora"):
            plain.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, lora="attn")


# ------------------------------------------------------------------ adapter folders
def test_adapter_maps_parts_onto_fused_slices(tiny_llama, adapters):
    cfg = load_config(tiny_llama)
    a = load_adapter(adapters["fused"], cfg, "fused")
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    A, B = a.weights["layers.0.self_attn.qkv_proj"]
    assert A.shape == (3 * 8, cfg.hidden_size) and B.shape == (q + 2 * kv, 3 * 8)
    assert not B[:q, 8:].any() and not B[q : q + kv, :8].any() and not B[q + kv :, :16].any()
    assert a.scaling == 32 / 8
    m = load_adapter(adapters["mlp"], cfg, "mlp")
    assert m.scaling == pytest.approx(16 / 16**0.5)  # rsLoRA
    A, B = m.weights["layers.1.mlp.gate_up_proj"]
    assert not B[: cfg.intermediate_size].any() and B[cfg.intermediate_size :].any()  # up only


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_adapter_folders_are_refused_naming_the_file(tiny_llama, adapters, tmp_path):
    cfg = load_config(tiny_llama)
    missing = _copy(adapters["attn"], tmp_path / "missing")
    (missing / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        load_adapter(missing, cfg, "x")
    broken = _copy(adapters["attn"], tmp_path / "broken")
    (broken / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json"):
        load_adapter(broken, cfg, "x")
    dora = _copy(adapters["attn"], tmp_path / "dora")
    conf = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    with pytest.raises(ValueError, match="adapter_config.json: use_dora"):
        load_adapter(dora, cfg, "x")
    embed = _copy(adapters["attn"], tmp_path / "embed")
    (embed / "adapter_config.json").write_text(json.dumps({**conf, "target_modules": ["q_proj", "embed_tokens"]}))
    with pytest.raises(ValueError, match="embed_tokens"):
        load_adapter(embed, cfg, "x")
    other = load_config(tiny_llama)
    other.hidden_size *= 2  # an adapter of another model: its shapes do not fit
    with pytest.raises(ValueError, match="adapter_model.safetensors: model.layers.0"):
        load_adapter(adapters["attn"], other, "x")
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        radixlm.Engine(model_path=tiny_llama, max_total_tokens=1024, lora_paths=[f"bad={missing}"])


def test_lm_head_adapter_is_refused(tiny_llama, tmp_path):
    path = make_adapter(tiny_llama, tmp_path / "head", 4, 8, ["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="lm_head"):
        load_adapter(path, load_config(tiny_llama), "head")


def test_rank_64(tiny_llama, tmp_path):
    path = make_adapter(tiny_llama, tmp_path / "r64", 64, 64, ["o_proj", "down_proj"])
    assert load_adapter(path, load_config(tiny_llama), "r64").rank == 64


def test_parse_lora_paths():
    assert parse_lora_paths(["a=/x/y", "/p/q/"]) == {"a": "/x/y", "q": "/p/q/"}
    with pytest.raises(ValueError, match="twice"):
        parse_lora_paths(["a=/x", "a=/y"])


# ------------------------------------------------------------------ grouped deltas
def test_grouped_deltas_equal_per_row_deltas():
    """The per-segment and the stacked (batched) paths both add each row's own adapter delta."""
    torch.manual_seed(0)
    a, b = FakeAdapter("a", {0: 2, 1: 3}), FakeAdapter("b", {1: 4})  # both parts; the second part only
    c, d = FakeAdapter("c", {None: 3}), FakeAdapter("d", {0: 1}, module="layers.0.other")  # the whole module; another module
    lengths, rows = [1, 1, 1, 1, 1, 3, 2, 2], [None, a, b, c, d, a, None, b]
    segments = segments_of(lengths, rows)
    assert [(s, e, ad.name) for s, e, ad in segments] == [(1, 2, "a"), (2, 3, "b"), (3, 4, "c"), (4, 5, "d"), (5, 8, "a"), (10, 12, "b")]
    x, base = torch.randn(12, 6), torch.randn(12, 5)
    want = base.clone()
    token = 0
    for length, ad in zip(lengths, rows):
        for t in range(token, token + length):
            if ad is not None and "layers.0.m" in ad.weights:
                A, B = ad.weights["layers.0.m"]
                want[t] += B @ (A @ x[t])
        token += length
    part_rows = {"m": [2, 3], "other": [5]}
    looped = add_lora_deltas(x, base.clone(), "layers.0.m", LoraBatch(segments, part_rows))
    plan = stacked_plan(segments, torch.device("cpu"), part_rows)
    assert plan is not None and plan.length == 3 and plan.keep is not None
    stacked = add_lora_deltas(x, base.clone(), "layers.0.m", LoraBatch(segments, part_rows, plan))
    torch.testing.assert_close(looped, want)
    torch.testing.assert_close(stacked, want)
    stacked_a, (b0, b1), _ = plan.stacks("layers.0.m")
    assert stacked_a.shape == (6, 6, 3 + 4) and b0.shape == (6, 3, 2) and b1.shape == (6, 4, 3)  # per part: no zero blocks but the rank padding
    assert stacked_plan(segments[:1], torch.device("cpu"), {}) is None  # one segment: the loop
    assert stacked_plan([(0, 1, a), (1, 2, b), (2, 40, a)], torch.device("cpu"), {}) is None  # padding would cost too much


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_cpu_kernel_adds_each_segments_own_delta(cpp_ext, x_dtype, w_dtype):
    """The C++ grouped kernel gives the per-row sums: segments longer than its token block, parts
    wider than its column chunk, rank 64, adapters on some parts only, rows of no adapter untouched."""
    torch.manual_seed(1)
    width, part_rows = 40, (300, 70)
    make = lambda name, ranks, module="layers.0.m": FakeAdapter(name, ranks, module, width, part_rows, w_dtype)  # noqa: E731
    a, b, c = make("a", {0: 64, 1: 8}), make("b", {1: 5}), make("c", {None: 12})
    d = make("d", {0: 3}, module="layers.0.other")
    lengths, rows = [1, 1, 1, 1, 19, 2, 9], [a, None, b, d, c, None, a]  # 19: two of the shrink's token blocks
    segments = segments_of(lengths, rows)
    n = sum(lengths)
    x, base = torch.randn(n, width).to(x_dtype), torch.randn(n, sum(part_rows)).to(x_dtype)
    want = base.float().clone()
    token = 0
    for length, ad in zip(lengths, rows):
        if ad is not None and "layers.0.m" in ad.weights:
            A, B = (w.float() for w in ad.weights["layers.0.m"])
            want[token : token + length] += x[token : token + length].float() @ A.T @ B.T
        token += length
    batch = LoraBatch(segments, {"m": list(part_rows), "other": [sum(part_rows)]}, kernels=cpp_ext)
    got = add_lora_deltas(x, base.clone(), "layers.0.m", batch)
    assert got.dtype == x_dtype
    tol = dict(atol=1e-4, rtol=1e-4) if x_dtype == torch.float32 else dict(atol=0.5, rtol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    assert torch.equal(got[[1, 3, 23, 24]], base[[1, 3, 23, 24]])  # the base rows and the other module's adapter
    assert torch.equal(add_lora_deltas(x, base.clone(), "layers.0.other", LoraBatch(segments[2:3], {"other": [370]}, kernels=cpp_ext)), base)  # no pair there


# ------------------------------------------------------------------ the pool
def test_pool_evicts_least_recently_used_unused_adapters():
    loads = []

    def load(name, path):
        loads.append(name)
        return object()

    pool = LoraPool(load, max_loaded=2, max_per_batch=2)
    for n in "abc":
        pool.register(n, f"/{n}")
    assert pool.admits("a", []) and pool.admits("b", ["a"])
    assert not pool.admits("c", ["a", "b"])  # two adapters running: the batch is full
    pool.max_per_batch = 3
    assert not pool.admits("c", ["a", "b"])  # both loaded ones in use: c waits
    assert pool.admits("c", ["b"])  # a is unused and least recently used: evicted
    assert list(pool.loaded) == ["b", "c"] and pool.evictions == 1
    assert pool.admits("a", ["c"])  # read again; b evicted
    assert loads == ["a", "b", "c", "a"] and list(pool.loaded) == ["c", "a"]
    pool.unregister("a")
    with pytest.raises(ValueError, match="unknown adapter 'a'"):
        pool.cache_key("a")  # refused to new requests
    assert pool.admits("a", ["c"])  # the queued ones still run with it
    with pytest.raises(ValueError, match="still unloading"):
        pool.register("a", "/a2")
    assert pool.sweep(["a"]) == [] and pool.sweep([]) == ["a"]
    with pytest.raises(ValueError, match="not loaded"):
        pool.admits("a", [])
    pool.register("a", "/a2")
    assert pool.cache_key("a") == "lora:a#4"  # a new generation: never the old KV


def test_engine_reloads_evicted_adapters(tiny_llama, adapters, engine):
    paths = [f"{name}={path}" for name, path in adapters.items()]
    with radixlm.Engine(model_path=tiny_llama, max_total_tokens=4096, lora_paths=paths, max_loaded_loras=1, max_loras_per_batch=1) as eng:
        pool = eng.runner.lora.pool
        ids = PROMPTS[0]
        outs = eng.generate(input_ids=[ids] * 3, sampling_params=GREEDY, lora=None)
        got = {}
        for name in ["attn", "mlp", "fused", "attn"]:
            got.setdefault(name, []).append(eng.generate(input_ids=ids, sampling_params=GREEDY, lora=name)["output_ids"])
        assert len(pool.loaded) == 1 and pool.evictions >= 3
        assert got["attn"][0] == got["attn"][1]
        want = {n: engine.generate(input_ids=ids, sampling_params=GREEDY, lora=n)["output_ids"] for n in got}
        assert {n: v[0] for n, v in got.items()} == want
        assert outs[0]["output_ids"] == outs[1]["output_ids"]
        eng.check_accounting()


def test_load_and_unload_while_requests_run(tiny_llama, adapters, engine):
    """Unloading refuses new requests at once, lets the running one finish with its adapter, and
    returns after it; the name loaded again from another folder never meets the old KV."""
    ids, long = PROMPTS[1], dict(GREEDY, max_new_tokens=1500)
    want = engine.generate(input_ids=ids, sampling_params=long, lora="attn")["output_ids"]
    with radixlm.Engine(model_path=tiny_llama, max_total_tokens=4096, enable_lora=True) as eng:
        assert eng.lora_adapters() == []
        with pytest.raises(ValueError, match="adapter_config.json"):
            eng.load_lora_adapter("x", str(Path(tiny_llama)))  # the base model's folder: no adapter
        eng.load_lora_adapter("x", adapters["attn"])
        assert [a["name"] for a in eng.lora_adapters()] == ["x"]
        stream = eng.generate(input_ids=ids, sampling_params=long, lora="x", stream=True)
        next(stream)
        done: dict[str, bool] = {}
        unloading = threading.Thread(target=lambda: done.setdefault("ok", eng.unload_lora_adapter("x", timeout=120)))
        unloading.start()
        wait_until(lambda: "x" in eng.runner.lora.pool.retired, what="the unload to begin")
        assert eng.scheduler.running, "the request should still run"
        with pytest.raises(ValueError, match="lora"):
            eng.generate(input_ids=ids, sampling_params=GREEDY, lora="x")
        chunks = list(stream)
        unloading.join(120)
        assert done == {"ok": True}
        assert chunks[-1]["output_ids"] == want
        assert eng.lora_adapters() == []
        eng.load_lora_adapter("x", adapters["mlp"])
        out = eng.generate(input_ids=ids, sampling_params=GREEDY, lora="x")
        assert out["meta_info"]["cached_tokens"] == 0
        assert out["output_ids"] == engine.generate(input_ids=ids, sampling_params=GREEDY, lora="mlp")["output_ids"]
        eng.check_accounting()


# ------------------------------------------------------------------ HTTP
def test_http_routes(tiny_llama, adapters, engine):
    """``lora_path`` on /generate, ``model: "base:name"`` and the bare name on the OpenAI routes,
    /v1/models listing adapters, load/unload behind the admin key."""
    import httpx

    from helpers import ADMIN_KEY, API_KEY, ServerThread
    from radixlm.runtime.entrypoints.http.server import create_app

    ids = PROMPTS[0]
    want = {n: engine.generate(input_ids=ids, sampling_params=GREEDY, lora=n)["output_ids"] for n in ("attn", "mlp", None)}
    eng = radixlm.Engine(model_path=tiny_llama, max_total_tokens=4096, lora_paths=[f"attn={adapters['attn']}"])
    server = ServerThread(create_app(eng, api_key=API_KEY, admin_api_key=ADMIN_KEY, served_model_name="tiny")).start()
    user, admin = ({"Authorization": f"Bearer {k}"} for k in (API_KEY, ADMIN_KEY))
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=user) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "tiny:attn"]
            assert c.get("/get_server_info").json()["lora_paths"] == ["attn"]  # the folders are the admin's to see
            r = c.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY, "lora_path": "attn"})
            assert r.status_code == 200 and r.json()["output_ids"] == want["attn"], r.text
            text = r.json()["text"]
            base_text = c.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()["text"]
            assert text != base_text
            r = c.post("/generate", json={"input_ids": [ids, ids], "sampling_params": GREEDY, "lora_path": [None, "attn"]})
            assert [o["output_ids"] for o in r.json()] == [want[None], want["attn"]], r.text
            r = c.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY, "lora_path": "nope"})
            assert r.status_code == 400 and r.json()["param"] == "lora_path", r.text
            for model in ("tiny:attn", "attn"):
                r = c.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == text, r.text
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert r.json()["choices"][0]["text"] == base_text
            r = c.post("/v1/completions", json={"model": "tiny:nope", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 400 and r.json()["param"] == "model", r.text
            body = {"lora_name": "mlp", "lora_path": adapters["mlp"]}
            assert c.post("/load_lora_adapter", json=body).status_code == 403
            r = c.post("/load_lora_adapter", json=body, headers=admin)
            assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"attn", "mlp"}, r.text
            r = c.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY, "lora_path": "mlp"})
            assert r.json()["output_ids"] == want["mlp"]
            r = c.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": tiny_llama}, headers=admin)
            assert r.status_code == 400 and "adapter_config.json" in r.json()["message"], r.text
            assert c.post("/unload_lora_adapter", json={"lora_name": "attn"}).status_code == 403
            r = c.post("/unload_lora_adapter", json={"lora_name": "attn"}, headers=admin)
            assert r.status_code == 200 and r.json()["success"] and set(r.json()["loaded_adapters"]) == {"mlp"}, r.text
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "tiny:mlp"]
            r = c.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY, "lora_path": "attn"})
            assert r.status_code == 400
        eng.check_accounting()
    finally:
        server.stop()
        eng.shutdown()


def test_adapters_stored_in_bf16_give_the_fp32_adapters_outputs(tiny_llama, adapters, engine):
    """``lora_dtype="bfloat16"`` keeps the pairs in bf16 (the C++ kernel widens them as it reads);
    the adapter's top logprobs keep their order and stay near the fp32-stored adapter's."""
    ids, params = PROMPTS[0], {**GREEDY, "max_new_tokens": 1}

    def first_logprob(eng, lora):
        out = eng.generate(input_ids=ids, sampling_params=params, lora=lora, return_logprob=True, top_logprobs_num=5, cache_salt="bf16")
        return {tok: lp for lp, tok, _ in out["meta_info"]["output_top_logprobs"][0]}

    want, base = first_logprob(engine, "fused"), first_logprob(engine, None)
    with radixlm.Engine(model_path=tiny_llama, max_total_tokens=1024, lora_paths=[f"fused={adapters['fused']}"], lora_dtype="bfloat16") as eng:
        assert all(a.dtype == torch.bfloat16 for pair in eng.runner.lora.pool.get("fused").weights.values() for a in pair)
        got = first_logprob(eng, "fused")
    assert list(got) == list(want) != list(base)  # the adapter reorders the top 5; stored in bf16, it keeps that order
    rounding = max(abs(got[tok] - lp) for tok, lp in want.items())
    assert rounding < 0.1, (got, want)  # measured 0.07: these random adapters move logprobs by several units


def test_lora_dtype_falls_back_to_the_models_without_the_grouped_kernels(caplog):
    from radixlm.runtime.lora.manager import adapter_dtype

    assert adapter_dtype("bfloat16", torch.float32, grouped_kernels=True) == torch.bfloat16
    assert adapter_dtype("auto", torch.float32, grouped_kernels=True) == torch.float32
    assert adapter_dtype("bfloat16", torch.float32, grouped_kernels=False) == torch.float32
    assert "lora_dtype=bfloat16" in caplog.text


def test_server_options():
    import argparse

    from radixlm.runtime.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli(parser.parse_args(["--lora-paths", "a=/x", "b=/y", "--max-loaded-loras", "3"]))
    assert args.lora_paths == ["a=/x", "b=/y"] and args.max_loaded_loras == 3 and args.lora_enabled
    with pytest.raises(ValueError, match="tp_size"):
        ServerArgs.from_kwargs(lora_paths=["a=/x"], tp_size=2)
    with pytest.raises(ValueError, match="max_loras_per_batch"):
        ServerArgs.from_kwargs(max_loras_per_batch=0)
    assert ServerArgs.from_cli(parser.parse_args(["--lora-dtype", "bfloat16"])).lora_dtype == "bfloat16"
    with pytest.raises(ValueError, match="lora_dtype"):
        ServerArgs.from_kwargs(lora_dtype="int8")


def test_a_failing_adapter_kernel_aborts_only_the_adapter_rows(engine, monkeypatch):
    """When the grouped kernel raises, the pass is split and retried: the adapter's request ends
    aborted, the base request beside it gets its own greedy tokens, and no KV is leaked."""
    want = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, cache_salt="kernel-fault")["output_ids"]

    class Broken:
        def lora_add(self, *args):
            raise RuntimeError("lora_add: injected failure")

    monkeypatch.setattr(engine.runner.lora, "kernels", Broken())

    async def main():
        return await asyncio.gather(
            engine.async_generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora="attn", cache_salt="kernel-fault-a"),
            engine.async_generate(input_ids=PROMPTS[1], sampling_params=GREEDY, cache_salt="kernel-fault"),
            return_exceptions=True,
        )

    tuned, base = asyncio.run(main())
    reason = tuned["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "injected failure" in reason["message"] and tuned["output_ids"] == [], tuned
    assert base["output_ids"] == want
    engine.check_accounting()
