"""Streaming costs O(new tokens) per step: logprob entries are appended and sent once, texts decoded once."""

from __future__ import annotations

import json

import pytest

import radixlm
from radixlm.runtime.output import OutputBuilder
from radixlm.runtime.request import Req
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.tokenizer import IncrementalDetokenizer, load_tokenizer

LOGPROBS = {"return_logprob": True, "top_logprobs_num": 5, "logprob_start_len": 0, "return_text_in_logprobs": True}
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
KEYS = ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs", "output_top_logprobs")


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with radixlm.Engine(model_path=tiny_llama, max_total_tokens=4096, max_running_requests=8) as eng:
        yield eng


class _CountingTokenizer:
    """Wraps a tokenizer and counts the ids it is asked to decode."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.decoded_ids = 0

    def decode(self, ids, **kwargs):
        self.decoded_ids += len(ids)
        return self.inner.decode(ids, **kwargs)


def _as_lists(value):
    """JSON round trip: tuples become lists, as a client sees them."""
    return json.loads(json.dumps(value))


def test_stream_chunks_carry_only_the_logprob_entries_new_since_the_previous_chunk(engine):
    prompt = engine.tokenize("Once upon a time, in a small village, there lived a curious engineer.")
    chunks = list(engine.generate(input_ids=prompt, sampling_params=GREEDY, stream=True, **LOGPROBS))
    assert len(chunks) == GREEDY["max_new_tokens"]
    prev_tokens = 0
    for k, chunk in enumerate(chunks):
        meta = chunk["meta_info"]
        new_tokens = len(chunk["output_ids"]) - prev_tokens
        prev_tokens = len(chunk["output_ids"])
        assert 1 <= len(meta["output_token_logprobs"]) <= new_tokens
        assert len(meta["output_top_logprobs"]) == len(meta["output_token_logprobs"])
        expected_prompt = len(prompt) if k == 0 else 0  # prompt entries come once, in the first chunk
        assert len(meta["input_token_logprobs"]) == len(meta["input_top_logprobs"]) == expected_prompt
    sizes = [len(json.dumps(c["meta_info"]["output_top_logprobs"])) for c in chunks]
    assert sizes[-1] <= 2 * sizes[1], f"the chunks' logprobs grow with the output: {sizes}"


def test_concatenated_stream_logprobs_equal_the_non_streamed_result(engine):
    prompt = engine.tokenize("Radix trees share prefixes; caches reuse keys and values.")
    whole = engine.generate(input_ids=prompt, sampling_params=GREEDY, **LOGPROBS)
    chunks = list(engine.generate(input_ids=prompt, sampling_params=GREEDY, stream=True, **LOGPROBS))
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    for key in KEYS:
        joined = [entry for c in chunks for entry in c["meta_info"][key]]
        assert _as_lists(joined) == _as_lists(whole["meta_info"][key]), key
    assert len(whole["meta_info"]["output_token_logprobs"]) == GREEDY["max_new_tokens"]


def _stream_req(prompt: list[int]) -> Req:
    return Req("r", prompt, SamplingParams(max_new_tokens=1000), lambda out: None, stream=True, return_logprob=True, top_logprobs_num=3, return_text_in_logprobs=True)


def test_output_builder_work_per_streamed_step_does_not_grow_with_the_output(tiny_llama):
    tok = _CountingTokenizer(load_tokenizer(tiny_llama))
    builder = OutputBuilder(tok)
    req = _stream_req([5, 6, 7])
    per_step = []
    for step in range(200):
        token = 10 + step % 50
        req.output_ids.append(token)
        req.output_logprobs.append(-1.0)
        req.output_top_logprobs.append([(-1.0, token), (-2.0, token + 1), (-3.0, token + 2)])
        before = tok.decoded_ids
        out = builder.build(req, finished=False)
        per_step.append(tok.decoded_ids - before)
        assert len(out.meta_info["output_token_logprobs"]) == 1
        assert out.output_logprob_offset == step
    # token texts are decoded once per distinct id: after the first 52 ids nothing is decoded again
    assert sum(per_step[100:]) == 0, per_step
    final = builder.build(req, finished=True)
    assert final.meta_info["output_token_logprobs"] == []  # everything was already sent


def test_incremental_detokenizer_decodes_only_the_new_tokens_per_update(tiny_llama):
    inner = load_tokenizer(tiny_llama)
    tok = _CountingTokenizer(inner)
    ids = inner.encode("Once upon a time, in a small village, there lived a curious engineer. " * 8)
    detok = IncrementalDetokenizer(tok, [1, 2, 3])
    per_update = []
    for n in range(1, len(ids) + 1):
        before = tok.decoded_ids
        detok.update(ids[:n])
        per_update.append(tok.decoded_ids - before)
    detok.update(ids, final=True)
    assert detok.text == inner.decode(ids)
    assert max(per_update[len(ids) // 2 :]) <= 12, per_update
