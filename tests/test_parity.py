"""Greedy outputs are token-identical to transformers in every scheduling situation."""

from __future__ import annotations

import random

import pytest

from helpers import TINY_ARCHS, hf_greedy_divergence, load_hf_model, run_scenario

NEW_TOKENS = 32

SCENARIOS = {
    # name: (engine options, how requests arrive)
    "alone": ({}, "one_by_one"),
    "batch_joining_mid_decode": ({}, "staggered"),
    "radix_cache_hit": ({}, "twice"),
    "chunked_prefill_16": ({"chunked_prefill_size": 16}, "staggered"),
    "page_size_16": ({"page_size": 16}, "twice"),
    "retraction": ({"max_total_tokens": 400, "max_running_requests": 12}, "all_at_once"),
}


def _tiny_prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 390) for _ in range(40)]
    prompts = []
    for i in range(12):
        n = rng.randrange(2, 60)
        tail = [rng.randrange(3, 390) for _ in range(n)]
        prompts.append(shared[: rng.randrange(0, 40)] + tail if i % 2 else tail)
    return prompts


def _run_scenario(model_path: str, prompts: list[list[int]], options: dict, arrival: str):
    return run_scenario(model_path, prompts, options, arrival, max_total_tokens=8192, max_new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dirs):
    """The prompts and a check of an arch's outputs against transformers' greedy decoding (a
    teacher-forced pass per output, each distinct output checked once: see ``smol_reference``)."""
    prompts = _tiny_prompts()
    hfs = {arch: load_hf_model(tiny_model_dirs[arch]) for arch in TINY_ARCHS}
    checked: dict[tuple, int | None] = {}

    def divergence(arch: str, prompt: list[int], output: list[int]) -> int | None:
        key = (arch, tuple(prompt), tuple(output))
        if key not in checked:
            checked[key] = hf_greedy_divergence(hfs[arch], prompt, output)
        return checked[key]

    return prompts, divergence


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_greedy_matches_transformers(arch, scenario, tiny_model_dirs, tiny_reference):
    prompts, divergence = tiny_reference
    options, arrival = SCENARIOS[scenario]
    outputs, rt = _run_scenario(tiny_model_dirs[arch], prompts, dict(options), arrival)
    assert [len(o) for o in outputs] == [NEW_TOKENS] * len(prompts)
    for i, (prompt, ours) in enumerate(zip(prompts, outputs)):
        assert divergence(arch, prompt, ours) is None, f"prompt {i} diverged at token {divergence(arch, prompt, ours)}"
    if scenario == "retraction":
        assert rt.scheduler.total_retracted > 0, "the pool was large enough that nothing was retracted"
    rt.scheduler.check_accounting()


SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "List three colors:",
    "The radix tree is a data structure that",
    "Translate to French: Good morning, how are you?",
    "1, 1, 2, 3, 5, 8,",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nName a planet.<|im_end|>\n<|im_start|>assistant\n",
    "In machine learning, a transformer",
]


@pytest.fixture(scope="module")
def smol_reference(smollm2_path):
    """The prompts' token ids and a check of outputs against transformers' greedy decoding.

    transformers' greedy ``generate`` takes ~4 s a prompt on SmolLM2 (one forward pass per token, bound by reading
    the weights); a teacher-forced pass over prompt + output finds the same first divergence in
    ~0.4 s, and an output every scenario shares (all of them, when they pass) is checked once.
    """
    from radixlm.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    prompts = [tok(p).input_ids for p in SMOL_PROMPTS]
    hf = load_hf_model(smollm2_path)
    checked: dict[tuple, int | None] = {}

    def divergence(prompt: list[int], output: list[int]) -> int | None:
        key = (tuple(prompt), tuple(output))
        if key not in checked:
            checked[key] = hf_greedy_divergence(hf, prompt, output)
        return checked[key]

    return prompts, divergence


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["batch_joining_mid_decode", "radix_cache_hit", "chunked_prefill_16", "page_size_16", "retraction"])
def test_smollm2_greedy_matches_transformers(scenario, smollm2_path, smol_reference):
    prompts, divergence = smol_reference
    options, arrival = SCENARIOS[scenario]
    options = dict(options, quantization="none")  # transformers runs the file's weights dequantized, in fp32
    if scenario == "retraction":
        options["max_total_tokens"] = 400
    outputs, rt = _run_scenario(smollm2_path, prompts, options, arrival)
    assert [len(o) for o in outputs] == [NEW_TOKENS] * len(prompts)
    for i, (prompt, ours) in enumerate(zip(prompts, outputs)):
        assert divergence(prompt, ours) is None, f"prompt {i} diverged from transformers' greedy output at token {divergence(prompt, ours)}"
    if scenario == "retraction":
        assert rt.scheduler.total_retracted > 0
