"""Speculation on the embedded SmolLM2: greedy output unchanged, and a copying prompt accepts drafts."""

from __future__ import annotations

import pytest

from radixlm import Engine

RECORD = "name: Ada Lovelace; born: 10 December 1815; field: mathematics; known for: the first published computer program"
COPY_PROMPT = (
    "<|im_start|>user\nRepeat the following record exactly, then stop.\n"
    f"{RECORD}<|im_end|>\n<|im_start|>assistant\n"
)
PROMPTS = [COPY_PROMPT, "The capital of France is", "def fibonacci(n):", "1, 1, 2, 3, 5, 8,"]
# fp32 weights: as stored, the int4 kernels round activations to 8 bits, so the last-bit
# differences between verifying several tokens at once and decoding one (attention's summation
# order) can move a rounding step and flip a near-tie; speculation's own exactness is what is tested
DENSE = {"quantization": "none"}


@pytest.mark.slow
def test_smollm2_greedy_output_is_identical_with_ngram_and_copying_accepts_drafts(smollm2_path):
    params = {"max_new_tokens": 40, "temperature": 0}
    with Engine(smollm2_path, max_total_tokens=4096, speculative_algorithm="ngram", **DENSE) as engine:
        # the gate bypassed (its choices follow measured timings): every row drafts K tokens
        engine.scheduler.speculator.gate.plan = lambda key, max_tokens, *args, **kwargs: max_tokens
        spec = engine.generate(PROMPTS, sampling_params=params)
        engine.scheduler.speculator.algorithm = None  # the same engine without speculation
        engine.flush_cache()
        plain = engine.generate(PROMPTS, sampling_params=params)
    for a, b in zip(plain, spec):
        assert b["output_ids"] == a["output_ids"] and b["text"] == a["text"]
    copy = spec[0]["meta_info"]
    assert copy["spec_accepted_tokens"] >= 10, copy  # a quarter of the output came from drafts


@pytest.mark.slow
def test_smollm2_greedy_output_is_identical_with_the_int4_self_draft(smollm2_path):
    params = {"max_new_tokens": 24, "temperature": 0}
    with Engine(smollm2_path, max_total_tokens=4096, **DENSE) as engine:
        plain = engine.generate(PROMPTS, sampling_params=params)
    with Engine(smollm2_path, max_total_tokens=4096, speculative_algorithm="draft", **DENSE) as engine:
        engine.scheduler.speculator.gate.plan = lambda key, max_tokens, *args, **kwargs: max_tokens
        spec = engine.generate(PROMPTS, sampling_params=params)
        engine.check_accounting()
    for a, b in zip(plain, spec):
        assert b["output_ids"] == a["output_ids"] and b["text"] == a["text"]
    assert sum(o["meta_info"]["spec_accepted_tokens"] for o in spec) > 0
