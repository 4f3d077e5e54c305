"""The offline Engine API: single and batch generation, streaming, async, logprobs, bad input."""

from __future__ import annotations

import asyncio

import pytest

import radixlm


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with radixlm.Engine(model_path=tiny_llama, max_total_tokens=4096, max_running_requests=16) as eng:
        yield eng


GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def test_generate_returns_text_ids_and_meta_info(engine):
    out = engine.generate("The quick brown fox", GREEDY)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 12 == meta["completion_tokens"]
    assert meta["prompt_tokens"] == len(engine.tokenize("The quick brown fox"))
    assert meta["finish_reason"] == {"type": "length", "matched": None}
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    engine.check_accounting()


def test_batch_generate_keeps_order_and_per_prompt_params(engine):
    prompts = ["Radix trees share", "Once upon a time", "Question: what"]
    params = [dict(GREEDY, max_new_tokens=n) for n in (3, 5, 7)]
    outs = engine.generate(prompts, params)
    assert [len(o["output_ids"]) for o in outs] == [3, 5, 7]
    singles = [engine.generate(p, sp)["output_ids"] for p, sp in zip(prompts, params)]
    assert [o["output_ids"] for o in outs] == singles


def test_input_ids_batch_and_repeated_prompt_hits_the_cache(engine):
    ids = engine.tokenize("Once upon a time, in a small village, there lived")
    first = engine.generate(input_ids=[ids, ids[:5]], sampling_params=GREEDY)
    second = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert second["output_ids"] == first[0]["output_ids"]
    assert second["meta_info"]["cached_tokens"] == len(ids) - 1


def test_stream_yields_growing_text_that_ends_with_the_full_output(engine):
    chunks = list(engine.generate("The quick brown", GREEDY, stream=True))
    assert len(chunks) == 12
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[-1]["output_ids"] == engine.generate("The quick brown", GREEDY)["output_ids"]


def test_async_generate_and_async_stream(engine):
    async def main():
        single = await engine.async_generate("The quick", GREEDY)
        batch = await engine.async_generate(["The quick", "Radix"], GREEDY)
        stream = await engine.async_generate("The quick", GREEDY, stream=True)
        chunks = [c async for c in stream]
        return single, batch, chunks

    single, batch, chunks = asyncio.run(main())
    assert single["output_ids"] == batch[0]["output_ids"] == chunks[-1]["output_ids"]


def test_stop_string_is_trimmed_and_reported(engine):
    base = engine.generate("The quick brown fox", dict(GREEDY, max_new_tokens=12))
    text = base["text"]
    assert len(text) > 4
    stop = text[2:4]
    out = engine.generate("The quick brown fox", dict(GREEDY, stop=[stop]))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.index(stop)]
    kept = engine.generate("The quick brown fox", dict(GREEDY, stop=stop, no_stop_trim=True))
    assert kept["text"].endswith(stop)


def test_stop_token_ids_and_eos_end_generation(engine):
    base = engine.generate("Radix", dict(GREEDY, max_new_tokens=6))["output_ids"]
    out = engine.generate("Radix", dict(GREEDY, stop_token_ids=[base[2]]))
    assert out["output_ids"] == base[: base.index(base[2]) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": base[2]}


def test_min_new_tokens_suppresses_stop_tokens(engine):
    base = engine.generate("Radix", dict(GREEDY, max_new_tokens=6))["output_ids"]
    out = engine.generate("Radix", dict(GREEDY, stop_token_ids=[base[0]], min_new_tokens=3, max_new_tokens=6))
    assert len(out["output_ids"]) >= 3
    assert base[0] not in out["output_ids"][:3]


def test_output_and_prompt_logprobs(engine):
    ids = engine.tokenize("The quick brown fox jumps")
    out = engine.generate(input_ids=ids, sampling_params=dict(GREEDY, max_new_tokens=4), return_logprob=True, top_logprobs_num=3, logprob_start_len=0, return_text_in_logprobs=True)
    meta = out["meta_info"]
    inp = meta["input_token_logprobs"]
    assert len(inp) == len(ids) and inp[0][0] is None
    assert [t[1] for t in inp] == ids
    assert all(lp <= 0 for lp, _, _ in inp[1:])
    outp = meta["output_token_logprobs"]
    assert [t[1] for t in outp] == out["output_ids"]
    # greedy: the chosen token is the top alternative
    for (lp, tid, _), tops in zip(outp, meta["output_top_logprobs"]):
        assert len(tops) == 3 and tops[0][1] == tid and abs(tops[0][0] - lp) < 1e-5
    # prompt logprobs from the middle agree with those from the start, even with a cache hit
    again = engine.generate(input_ids=ids, sampling_params=dict(GREEDY, max_new_tokens=1), return_logprob=True, logprob_start_len=3)
    tail = again["meta_info"]["input_token_logprobs"]
    assert len(tail) == len(ids) - 3
    for a, b in zip(tail, inp[3:]):
        assert a[1] == b[1] and abs(a[0] - b[0]) < 1e-4


def test_max_new_tokens_zero_only_prefills_and_caches(engine):
    ids = engine.tokenize("Question: what is two plus two? Answer:")
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert len(out["meta_info"]["input_token_logprobs"]) == len(ids)
    hit = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert hit["meta_info"]["cached_tokens"] == len(ids) - 1


def test_seeded_sampling_is_repeatable_and_batch_independent(engine):
    sp = {"max_new_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "ignore_eos": True}
    a = engine.generate("Once upon", sp)["output_ids"]
    b = engine.generate(["Radix trees", "Once upon"], [dict(sp, seed=9), sp])[1]["output_ids"]
    assert a == b
    c = engine.generate("Once upon", dict(sp, seed=4321))["output_ids"]
    assert c != a


def test_penalties_change_greedy_output(engine):
    base = engine.generate("The quick", dict(GREEDY, max_new_tokens=10))["output_ids"]
    pen = engine.generate("The quick", dict(GREEDY, max_new_tokens=10, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=1.5))["output_ids"]
    assert pen != base
    assert len(pen) - len(set(pen)) <= len(base) - len(set(base))  # fewer repeats, not more


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, -3]}, "input_ids"),
        ({"input_ids": [10**9]}, "input_ids"),
        ({"prompt": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"prompt": "x", "sampling_params": {"max_new_tokens": 2.5}}, "max_new_tokens"),
        ({"prompt": "x", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"prompt": "x", "sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"prompt": "x", "sampling_params": {"top_k": 2.0}}, "top_k"),
        ({"prompt": "x", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"prompt": "x", "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"prompt": "x", "sampling_params": {"min_p": 2}}, "min_p"),
        ({"prompt": "x", "sampling_params": {"bogus": 1}}, "bogus"),
        ({"prompt": "x", "sampling_params": {"stop": [""]}}, "stop"),
        ({"prompt": "x", "sampling_params": {"stop_token_ids": ["a"]}}, "stop_token_ids"),
        ({"prompt": "x", "sampling_params": {"seed": "s"}}, "seed"),
        ({"prompt": "x", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}}, "min_new_tokens"),
        ({"prompt": "x", "sampling_params": {"regex": "a", "json_schema": "{}"}}, "regex"),
        ({"prompt": "x", "sampling_params": "fast"}, "sampling_params"),
        ({"prompt": "x", "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"prompt": "x", "logprob_start_len": -5}, "logprob_start_len"),
        ({"prompt": ["x", "y"], "sampling_params": [{}]}, "sampling_params"),
        ({"prompt": "x", "input_ids": [1]}, "prompt"),
        ({"prompt": "x", "stream": True, "sampling_params": None, "input_ids": None, "return_logprob": "yes"}, "return_logprob"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(engine, kwargs, field):
    with pytest.raises(ValueError, match=field):
        result = engine.generate(**kwargs)
        if hasattr(result, "__next__"):
            next(result)
    engine.check_accounting()
    stats = engine.get_stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_over_long_prompt_is_refused(engine):
    ids = [5] * engine.context_len
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=ids)
    engine.check_accounting()


def test_abort_frees_the_requests_kv(engine):
    stream = engine.generate("Once upon a time", {"max_new_tokens": 400, "ignore_eos": True}, stream=True)
    first = next(stream)
    assert first["meta_info"]["finish_reason"] is None
    stream.close()  # closing the iterator aborts the request
    for _ in range(100):
        stats = engine.get_stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            break
    assert stats["num_running"] == 0
    engine.check_accounting()


def test_flush_cache_empties_the_tree(engine):
    engine.generate("Radix trees share prefixes", GREEDY)
    assert engine.get_stats()["tree_slots"] > 0
    assert engine.flush_cache()
    stats = engine.get_stats()
    assert stats["tree_slots"] == 0 and stats["free_slots"] == stats["max_total_tokens"]


def test_unknown_engine_argument_is_a_value_error(tiny_llama):
    with pytest.raises(ValueError, match="page_sise"):
        radixlm.Engine(model_path=tiny_llama, page_sise=4)
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        radixlm.Engine(model_path=tiny_llama, chunked_prefill_size=0)
