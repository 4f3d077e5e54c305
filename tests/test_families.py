"""Every model family gives transformers' greedy tokens, in every scheduling situation.

Tiny random checkpoints saved by transformers' own classes (``FAMILY_ARCHS`` in helpers.py),
each with its distinctive piece switched on: Qwen3's q/k norms and wide heads, Gemma 2's
soft-caps and alternating sliding layers, Gemma 3's q/k norms and local RoPE base, Phi-3's fused
weights with longrope and partial rotary, SmolLM3's NoPE layers, Mistral's sliding window. The
prompts run from shorter than the window (8) to several times it, and one is exactly as long.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from helpers import (
    FAMILY_ARCHS,
    TINY_WINDOW,
    Driver,
    assert_masked_greedy,
    hf_greedy_divergence,
    load_hf_model,
    make_tiny_model,
    run_scenario,
)
from radixlm import ServerArgs
from radixlm.runtime.engine import build_parts
from radixlm.runtime.sampling_params import SamplingParams

NEW_TOKENS = 24  # run_scenario's default

SCENARIOS = {
    # name: (engine options, how requests arrive)
    "alone": ({}, "one_by_one"),
    "mixed_batch": ({}, "staggered"),
    "radix_cache_hit": ({}, "twice"),
    "chunked_prefill_16": ({"chunked_prefill_size": 16}, "staggered"),
    "page_size_16": ({"page_size": 16}, "twice"),
    # small enough that every family here retracts (84 to 87 did; at 80 the longest request no longer fits)
    "retraction": ({"max_total_tokens": 85, "max_running_requests": 12}, "all_at_once"),
    "ngram_speculation": ({"speculative_algorithm": "ngram"}, "all_at_once"),
    "python_layers": ({"disable_decode_stack": True}, "staggered"),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A folder per family: a tiny random checkpoint saved by transformers."""
    root = tmp_path_factory.mktemp("families")
    return {arch: make_tiny_model(arch, root / arch) for arch in FAMILY_ARCHS}


def _prompts() -> list[list[int]]:
    """Prompts shorter than, exactly as long as, and several times longer than the window,
    half of them sharing a prefix (so cache hits and shared-prefix decoding happen)."""
    rng = random.Random(11)
    shared = [rng.randrange(3, 390) for _ in range(30)]
    lengths = [3, TINY_WINDOW, TINY_WINDOW + 1, 17, 26, 40, 5, 33]
    prompts = []
    for i, n in enumerate(lengths):
        tail = [rng.randrange(3, 390) for _ in range(n)]
        prompts.append((shared[: rng.randrange(8, 30)] + tail) if i % 2 and n > TINY_WINDOW else tail)
    prompts[1] = prompts[1][:TINY_WINDOW]
    return prompts


@pytest.fixture(scope="module")
def references(family_dirs):
    """Each family's transformers model (loaded once) and a memoized check of outputs against it."""
    models: dict[str, torch.nn.Module] = {}
    checked: dict[tuple, int | None] = {}

    def divergence(arch: str, prompt: list[int], output: list[int]) -> int | None:
        key = (arch, tuple(prompt), tuple(output))
        if key not in checked:
            if arch not in models:
                models[arch] = load_hf_model(family_dirs[arch])
            checked[key] = hf_greedy_divergence(models[arch], prompt, output)
        return checked[key]

    return divergence


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_family_greedy_matches_transformers(arch, scenario, family_dirs, references):
    options, arrival = SCENARIOS[scenario]
    prompts = _prompts()
    # an all-sliding model caches only requests that never slid (shorter than the window): none
    # in pages of 16 with a window of 8
    expect_hits = not (arch == "mistral_swa" and options.get("page_size") == 16)
    outputs, rt = run_scenario(family_dirs[arch], prompts, dict(options), arrival, expect_hits)
    assert [len(o) for o in outputs] == [NEW_TOKENS] * len(prompts)
    for i, (prompt, ours) in enumerate(zip(prompts, outputs)):
        where = references(arch, prompt, ours)
        assert where is None, f"{arch}: prompt {i} ({len(prompt)} tokens) diverged from transformers at token {where}"
    if scenario == "retraction" and arch != "mistral_swa":  # all-sliding requests never outgrow their window
        assert rt.scheduler.total_retracted > 0, "the pool was large enough that nothing was retracted"
    if scenario == "ngram_speculation":
        assert rt.scheduler.speculator.stats()["spec_draft_tokens"] > 0


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}}, "required": ["name", "n"]}


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_family_json_schema_output_is_transformers_masked_greedy(arch, family_dirs):
    """Under a JSON schema, every token is transformers' argmax among the tokens the grammar allows."""
    prompts = _prompts()[2:5]
    schema = json.dumps(SCHEMA)
    constraint = SamplingParams.from_dict({"json_schema": schema}).constraint  # as the engine compiles it
    outputs, rt = run_scenario(family_dirs[arch], prompts, {"disable_jump_forward": True}, "all_at_once", json_schema=schema, max_new_tokens=64)
    hf = load_hf_model(family_dirs[arch])
    for prompt, ours in zip(prompts, outputs):
        matcher = assert_masked_greedy(hf, rt, constraint, prompt, ours, arch)
        if matcher.is_terminated():
            text = rt.tokenizer.decode(ours, skip_special_tokens=True)
            assert set(json.loads(text)) == {"name", "n"}


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_family_logprobs_equal_transformers(arch, family_dirs):
    """Output logprobs equal transformers' log-softmax (Gemma 2's final soft-cap changes them, not the argmax)."""
    prompts = _prompts()[3:6]
    rt = build_parts(ServerArgs(model_path=family_dirs[arch], max_total_tokens=4096))
    d = Driver(rt)
    rids = [d.add(p, max_new_tokens=8, temperature=0.0, ignore_eos=True, return_logprob=True) for p in prompts]
    d.run()
    hf = load_hf_model(family_dirs[arch])
    vocab = rt.runner.config.vocab_size
    for prompt, rid in zip(prompts, rids):
        out = d.results[rid]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + out.output_ids])).logits[0, len(prompt) - 1 : -1, :vocab].log_softmax(-1)
        ours = [lp for lp, _, _ in out.meta_info["output_token_logprobs"]]
        want = [float(ref[j, t]) for j, t in enumerate(out.output_ids)]
        assert max(abs(a - b) for a, b in zip(ours, want)) < 1e-4
