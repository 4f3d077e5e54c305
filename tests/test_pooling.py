"""Pooling: embeddings (last and mean), rerank and score, in-process and over HTTP.

Every vector is checked against transformers' own final hidden states (``model.model(...)``,
after the final norm) pooled the same way; every score against P(yes) from transformers' logits
on the same templated prompt. KV accounting is checked after every step (conftest) and after
every scenario.
"""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch

from helpers import Driver, ServerProcess

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Radix trees share prefixes; caches reuse keys and values.", "Once upon a time"]
SHARED = "Question: what is two plus two? Answer: four. " * 3  # a prefix several requests share
PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


# ------------------------------------------------------------------------- references
@pytest.fixture(scope="module")
def hf(tiny_pooling_model: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_pooling_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_pooling_model)


def hf_embedding(hf, ids: list[int], mode: str, dims: int | None = None) -> torch.Tensor:
    """transformers' last hidden state (after the final norm), pooled and L2-normalised."""
    model, _ = hf
    with torch.no_grad():
        h = model.model(torch.tensor([ids])).last_hidden_state[0]
    vec = h[-1] if mode == "last" else h.mean(0)
    return torch.nn.functional.normalize(vec[:dims] if dims else vec, dim=-1)


def hf_score(hf, query: str, doc: str) -> float:
    """P(yes) over the "yes"/"no" logits at the last position of Qwen3-Reranker's prompt."""
    model, tok = hf
    pair = f"<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}"
    ids = tok(PREFIX, add_special_tokens=False).input_ids + tok(pair).input_ids + tok(SUFFIX, add_special_tokens=False).input_ids
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return float(torch.softmax(logits[[yes, no]], -1)[0])


def assert_close(got, want: torch.Tensor) -> None:
    assert (torch.tensor(got) - want).abs().max().item() < 1e-4


# ------------------------------------------------------------------------- in-process
@pytest.fixture(scope="module")
def engine(tiny_pooling_model: str):
    import radixlm

    # chunks of 16 tokens: the longer prompts are pooled over several steps
    with radixlm.Engine(tiny_pooling_model, max_total_tokens=2048, chunked_prefill_size=16) as eng:
        yield eng


@pytest.fixture(scope="module")
def mean_engine(tiny_pooling_model: str):
    import radixlm

    with radixlm.Engine(tiny_pooling_model, max_total_tokens=2048, chunked_prefill_size=16, pooling="mean") as eng:
        yield eng


def _prefill_tokens(eng) -> int:
    return eng.dashboard_counters()["prefill_tokens"]


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_pooled_vector_equals_transformers_alone_batched_and_after_a_cache_hit(mode, engine, mean_engine, hf):
    eng = engine if mode == "last" else mean_engine
    assert eng.pooling_config.mode == mode
    _, tok = hf
    texts = [SHARED + t for t in TEXTS]  # longer than one chunk, sharing a prefix
    want = [hf_embedding(hf, tok(t).input_ids, mode) for t in texts]
    assert_close(eng.embed(texts[0]), want[0])  # alone
    before = _prefill_tokens(eng)
    batch = eng.embed(texts)  # batched, the first one now cached
    computed = _prefill_tokens(eng) - before
    for got, w in zip(batch, want):
        assert_close(got, w)
    assert_close(eng.embed(tok(texts[1]).input_ids), want[1])  # token ids, a whole-prompt cache hit
    total = sum(len(tok(t).input_ids) for t in texts)
    if mode == "last":  # the cached prefix is not recomputed
        assert computed < total - len(tok(texts[0]).input_ids) + 3
    else:  # mean pooling reads nothing from the cache: every position is computed
        assert computed == total
    eng.check_accounting()


def test_a_repeated_prompt_computes_only_its_last_token_for_last_pooling(engine, hf):
    _, tok = hf
    text = SHARED + "and once more"
    first = engine.embed(text)
    before = engine.dashboard_counters()
    again = engine.embed(text)
    after = engine.dashboard_counters()
    assert after["hit_tokens"] - before["hit_tokens"] == len(tok(text).input_ids) - 1  # all but the last from the cache
    assert after["prefill_tokens"] - before["prefill_tokens"] == 0  # (a one-token row counts as a decode row)
    assert_close(again, torch.tensor(first))
    engine.check_accounting()


def test_score_equals_p_yes_from_transformers_logits(engine, hf):
    docs = ["Radix trees share prefixes.", "The lazy dog sleeps.", "no"]
    got = engine.score("what do radix trees share?", docs)
    want = [hf_score(hf, "what do radix trees share?", d) for d in docs]
    assert all(abs(g - w) < 1e-4 for g, w in zip(got, want)), (got, want)
    assert abs(engine.score("what do radix trees share?", docs[0]) - want[0]) < 1e-4  # a cache hit
    engine.check_accounting()


def test_matryoshka_dimensions_truncate_then_renormalise(tiny_pooling_model, hf):
    import radixlm

    _, tok = hf
    with radixlm.Engine(tiny_pooling_model, max_total_tokens=512, matryoshka_dims="16,32") as eng:
        assert eng.pooling_config.matryoshka == frozenset({16, 32})
        assert_close(eng.embed(TEXTS[0], dimensions=16), hf_embedding(hf, tok(TEXTS[0]).input_ids, "last", 16))
        with pytest.raises(ValueError, match="dimensions: 8 is not one of"):
            eng.embed(TEXTS[0], dimensions=8)
        eng.check_accounting()


def test_bad_input_is_refused_naming_the_argument(engine):
    for bad, field in [("", "input"), ([], "input"), ([[1, 2], []], "input"), ([1, 10**6], "input_ids"), ("x" * 10**7, "prompt")]:
        with pytest.raises(ValueError, match=field):
            engine.embed(bad)
    with pytest.raises(ValueError, match="dimensions: this model does not allow"):
        engine.embed("hello", dimensions=8)
    with pytest.raises(ValueError, match="larger than the model's hidden size"):
        engine.embed("hello", dimensions=10_000)
    with pytest.raises(ValueError, match="documents"):
        engine.score("q", [])
    engine.check_accounting()


def test_pooling_beside_generation_in_one_batch_leaves_its_tokens_unchanged(tiny_pooling_model, hf):
    from radixlm.runtime.engine import build_parts
    from radixlm.runtime.pooling import PoolingTask
    from radixlm.runtime.request import Req
    from radixlm.runtime.sampling_params import SamplingParams
    from radixlm.runtime.server_args import ServerArgs

    _, tok = hf
    prompt = tok("Once upon a time, in a small village").input_ids
    greedy = dict(max_new_tokens=8, temperature=0, ignore_eos=True)
    alone = Driver(build_parts(ServerArgs(model_path=tiny_pooling_model, max_total_tokens=512)))
    alone.add(prompt, rid="gen", **greedy)
    alone.run()
    mixed = Driver(build_parts(ServerArgs(model_path=tiny_pooling_model, max_total_tokens=512)))
    mixed.add(prompt, rid="gen", **greedy)
    mixed.step()  # the generation's prompt; it decodes from now on
    pooled_ids = tok(SHARED).input_ids
    for rid, mode in (("last", "last"), ("mean", "mean")):
        req = Req(rid=rid, input_ids=pooled_ids, params=SamplingParams(max_new_tokens=0), sink=lambda out, rid=rid: mixed.results.__setitem__(rid, out), pooling=PoolingTask(mode))
        mixed.sched.add(req)
    mixed.step()  # one pass: a decode row beside two prefill rows that pool
    assert mixed.sched.stats.num_decode == 1 and mixed.sched.stats.num_prefill_tokens == 2 * len(pooled_ids)
    mixed.run()
    assert mixed.results["gen"].output_ids == alone.results["gen"].output_ids
    for mode in ("last", "mean"):
        assert_close(mixed.results[mode].pooled, hf_embedding(hf, pooled_ids, mode))
    mixed.sched.check_accounting()
    assert not mixed.sched.running and not mixed.sched.waiting


def test_a_pooling_request_that_fails_fails_alone_and_frees_its_kv(tiny_pooling_model, hf, monkeypatch):
    from radixlm.runtime import pooling
    from radixlm.runtime.engine import build_parts
    from radixlm.runtime.pooling import PoolingTask
    from radixlm.runtime.request import Req
    from radixlm.runtime.sampling_params import SamplingParams
    from radixlm.runtime.server_args import ServerArgs

    _, tok = hf
    real_gather = pooling.gather

    def gather(task, hidden, first):
        if task.mode == "mean":
            raise RuntimeError("pooling broke on purpose")
        return real_gather(task, hidden, first=first)

    monkeypatch.setattr(pooling, "gather", gather)
    driver = Driver(build_parts(ServerArgs(model_path=tiny_pooling_model, max_total_tokens=512)))
    driver.add(tok("Once upon a time").input_ids, rid="gen", max_new_tokens=4, temperature=0, ignore_eos=True)
    ids = tok(SHARED).input_ids
    for rid in ("last", "mean"):
        driver.sched.add(Req(rid=rid, input_ids=ids, params=SamplingParams(max_new_tokens=0), sink=lambda out, rid=rid: driver.results.__setitem__(rid, out), pooling=PoolingTask(rid)))
    driver.run()
    assert driver.results["mean"].meta_info["finish_reason"]["type"] == "abort" and "pooling broke on purpose" in driver.results["mean"].meta_info["finish_reason"]["message"]
    assert driver.results["mean"].pooled is None
    assert_close(driver.results["last"].pooled, hf_embedding(hf, ids, "last"))
    assert len(driver.results["gen"].output_ids) == 4
    driver.sched.check_accounting()
    assert not driver.sched.running and not driver.sched.waiting


def test_pooling_config_is_read_from_the_sentence_transformers_files(tmp_path):
    import json

    from radixlm.runtime.pooling import load_pooling_config

    (tmp_path / "modules.json").write_text(json.dumps([{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"}, {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    (tmp_path / "config.json").write_text(json.dumps({"is_matryoshka": True}))
    cfg = load_pooling_config(str(tmp_path), 64)
    assert (cfg.mode, cfg.source, cfg.matryoshka) == ("mean", "1_Pooling/config.json", frozenset())
    assert load_pooling_config(str(tmp_path), 64, flag="last").mode == "last"  # the flag wins
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    (tmp_path / "config.json").write_text("{}")
    cfg = load_pooling_config(str(tmp_path), 64)
    assert (cfg.mode, cfg.matryoshka) == ("last", None)


# ------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def pooling_server(tiny_pooling_model: str):
    server = ServerProcess(tiny_pooling_model, "--max-total-tokens", "2048", "--served-model-name", "tiny-pool", "--matryoshka-dims", "16,32")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(pooling_server):
    with httpx.Client(base_url=pooling_server.base_url, timeout=120) as c:
        yield c


def _assert_clean(client) -> None:
    stats = client.get("/get_server_info").json()["stats"]
    assert stats["kv_invariant_holds"] and stats["num_running"] == 0 and stats["running_slots"] == 0


def test_openai_sdk_embeddings_float_and_base64(pooling_server, client, hf):
    _, tok = hf
    oai = openai.OpenAI(base_url=pooling_server.base_url + "/v1", api_key="unused")
    want = [hf_embedding(hf, tok(t).input_ids, "last") for t in TEXTS]
    as_float = oai.embeddings.create(model="tiny-pool", input=TEXTS, encoding_format="float")
    as_base64 = oai.embeddings.create(model="tiny-pool", input=TEXTS)  # the SDK asks for base64 and decodes it
    for res in (as_float, as_base64):
        assert [d.index for d in res.data] == [0, 1, 2] and res.model == "tiny-pool"
        for d, w in zip(res.data, want):
            assert_close(d.embedding, w)
        assert res.usage.prompt_tokens == sum(len(tok(t).input_ids) for t in TEXTS)
    short = oai.embeddings.create(model="tiny-pool", input=[tok(TEXTS[0]).input_ids], dimensions=16, encoding_format="float")
    assert_close(short.data[0].embedding, hf_embedding(hf, tok(TEXTS[0]).input_ids, "last", 16))
    raw = client.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()["data"][0]["embedding"]
    decoded = struct.unpack(f"<{len(base64.b64decode(raw)) // 4}f", base64.b64decode(raw))
    assert_close(list(decoded), want[0])
    _assert_clean(client)


def test_rerank_and_score_equal_p_yes(client, hf):
    docs = ["Radix trees share prefixes.", "The lazy dog sleeps.", "Caches reuse keys and values."]
    query = "what do radix trees share?"
    want = [hf_score(hf, query, d) for d in docs]
    res = client.post("/v1/rerank", json={"query": query, "documents": docs, "top_n": 2}).json()
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in res["results"]] == order
    for r in res["results"]:
        assert abs(r["relevance_score"] - want[r["index"]]) < 1e-4 and r["document"] == {"text": docs[r["index"]]}
    assert res["usage"]["prompt_tokens"] > 0 and res["model"] == "tiny-pool"
    bare = client.post("/v1/rerank", json={"query": query, "documents": [{"text": d} for d in docs], "return_documents": False}).json()
    assert len(bare["results"]) == 3 and all("document" not in r for r in bare["results"])
    score = client.post("/v1/score", json={"text_1": query, "text_2": docs}).json()
    assert score["object"] == "list" and [d["index"] for d in score["data"]] == [0, 1, 2]
    assert all(d["object"] == "score" and abs(d["score"] - w) < 1e-4 for d, w in zip(score["data"], want))
    one = client.post("/v1/score", json={"text_1": [query], "text_2": docs[1]}).json()
    assert abs(one["data"][0]["score"] - want[1]) < 1e-4
    _assert_clean(client)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": [[1, 2], []]}, "input"),
        ("/v1/embeddings", {"input": [5, 10**6]}, "input"),
        ("/v1/embeddings", {"input": [[5, 6], [7, -1]]}, "input"),
        ("/v1/embeddings", {"input": "x" * 300_000}, "input"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 100}, "dimensions"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 8}, "dimensions"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"input": 3.5}, "input"),
        ("/v1/embeddings", {"input": ["a"] * 5000}, "input"),  # more than the server ever runs at once
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"] * 5000}, "documents"),
        ("/v1/rerank", {"query": 1, "documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
        ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/v1/score", {"text_1": "a", "text_2": "x" * 300_000}, "text_2"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["object"] == "error" and err["param"].split(".")[0] == param, err
    _assert_clean(client)  # what a failed request started was aborted and freed


def test_scores_need_single_yes_and_no_tokens(tmp_path):
    from transformers import AutoTokenizer

    from helpers import make_tokenizer
    from radixlm.runtime.rerank_prompt import yes_no_ids

    make_tokenizer(tmp_path)  # the tiny models' tokenizer: "yes" is several tokens there
    with pytest.raises(ValueError, match="no single 'yes' and 'no' tokens"):
        yes_no_ids(AutoTokenizer.from_pretrained(str(tmp_path)))


def test_tenants_share_no_cache_and_the_api_key_gates_the_routes(engine, hf):
    from fastapi.testclient import TestClient

    from radixlm.runtime.entrypoints.http.server import create_app

    _, tok = hf
    text = SHARED + "a tenant's own text"
    engine.embed(text, cache_salt="tenant-a")
    before = engine.dashboard_counters()["hit_tokens"]
    engine.embed(text, cache_salt="tenant-b")  # the same text, another tenant: nothing from a's cache
    assert engine.dashboard_counters()["hit_tokens"] == before
    engine.embed(text, cache_salt="tenant-a")
    assert engine.dashboard_counters()["hit_tokens"] - before == len(tok(text).input_ids) - 1
    http = TestClient(create_app(engine, api_key="k"), base_url="http://127.0.0.1")  # no lifespan: the module's engine outlives it
    for path, body in (("/v1/embeddings", {"input": "hi"}), ("/v1/rerank", {"query": "q", "documents": ["d"]}), ("/v1/score", {"text_1": "q", "text_2": "d"})):
        assert http.post(path, json=body).status_code == 401
        assert http.post(path, json=body, headers={"Authorization": "Bearer k", "x-cache-salt": "tenant-a"}).status_code == 200
    r = http.post("/v1/embeddings", json={"input": "hi", "cache_salt": "x"}, headers={"Authorization": "Bearer k", "x-cache-salt": "y"})
    assert r.status_code == 400 and r.json()["param"] == "cache_salt"
    r = http.post("/v1/embeddings", json={"input": "hi", "dimensions": 8}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 400 and r.json()["param"] == "dimensions" and "does not allow" in r.json()["message"]
    engine.check_accounting()
