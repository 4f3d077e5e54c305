"""Lazy grammar masking: picking a constrained row first and masking only a refused pick gives
the masked pick exactly (same tokens, same seeds), computes fewer masks, and falls back to the
mask where the pick depends on it (top-k/top-p/min-p) or the mask narrows the grammar."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.sampler import SamplingRow, exact_without_mask, sample
from radixlm.runtime.sampling_params import SamplingParams

V = 64


def _rows(params: list[SamplingParams], seed: int) -> list[SamplingRow]:
    return [SamplingRow(p, [1], [], torch.Generator().manual_seed(seed + i), (), False, 0) for i, p in enumerate(params)]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.8])
def test_picking_first_and_masking_a_refused_pick_is_the_masked_pick(temperature):
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=temperature, repetition_penalty=1.3, frequency_penalty=0.5) for _ in range(6)]
    for trial in range(200):
        logits = torch.randn(6, V, generator=gen) * 3
        allowed = torch.rand(6, V, generator=gen) < torch.rand(6, 1, generator=gen)  # some rows allow few tokens
        allowed[:, 0] = True
        eager = sample(logits, _rows(params, trial), None, allowed).token_ids
        rechecked: list[int] = []

        def recheck(i: int, token: int, allowed=allowed, rechecked=rechecked):
            if bool(allowed[i, token]):
                return None
            rechecked.append(i)
            return allowed[i]

        lazy = sample(logits, _rows(params, trial), None, None, recheck).token_ids
        assert lazy == eager, (trial, rechecked)
        assert all(bool(allowed[i, t]) for i, t in enumerate(lazy))


def test_only_plain_temperature_and_greedy_rows_may_skip_the_mask():
    assert exact_without_mask(SamplingParams(temperature=0.0, top_p=0.5))
    assert exact_without_mask(SamplingParams(temperature=0.8))
    assert exact_without_mask(SamplingParams(temperature=1.0, top_k=1))  # greedy
    for truncated in (dict(top_p=0.9), dict(top_k=20), dict(min_p=0.05)):
        assert not exact_without_mask(SamplingParams(temperature=0.8, **truncated)), truncated


def test_top_p_after_masking_differs_from_top_p_before_so_it_is_not_done_lazily():
    """Why the rule above: the unmasked nucleus holds only a refused token, the masked one an
    allowed token; picking first and masking the refused pick cannot find it."""
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    allowed = torch.tensor([[False, False, True, True]])
    row = SamplingParams(temperature=1.0, top_p=0.5)
    eager = {sample(logits, _rows([row], s), None, allowed).token_ids[0] for s in range(50)}
    forced = {sample(logits, _rows([row], s), None, None, lambda i, t: None if bool(allowed[i, t]) else allowed[i]).token_ids[0] for s in range(50)}
    assert eager == {2} and forced != eager


# ------------------------------------------------------------- in the engine
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "n": {"type": "integer"}}, "required": ["name", "n"]}
KINDS = [("json_schema", SCHEMA), ("regex", r"[a-z ]{5,40}\.")]


@pytest.fixture(scope="module")
def engines(tiny_llama):
    from radixlm.runtime.engine import Engine

    made = {
        (mode, jump): Engine(model_path=tiny_llama, grammar_mask=mode, disable_jump_forward=not jump, max_total_tokens=4096)
        for mode in ("lazy", "eager")
        for jump in (True, False)
    }
    yield made
    for e in made.values():
        e.shutdown()


def _run(engine, params: list[dict]) -> tuple[list[str], int, int]:
    before = engine.get_stats()
    outs = engine.generate(["Hello there", "Tell me", "JSON:", "x"] * (len(params) // 4), params)
    after = engine.get_stats()
    return [o["text"] for o in outs], after["grammar_masks"] - before["grammar_masks"], after["grammar_lazy_picks"] - before["grammar_lazy_picks"]


@pytest.mark.parametrize("jump", [True, False], ids=["jump-forward", "no-jump-forward"])
@pytest.mark.parametrize("kind,spec", KINDS)
def test_lazy_masking_gives_the_eager_outputs_with_fewer_masks(engines, kind, spec, jump):
    """Without jump-forward the forced keys are picked one by one: there the mask allows only
    the canonical split of the forced text, which lazy masking must leave to the mask."""
    params = [{kind: spec, "max_new_tokens": 40, "temperature": t, "seed": 11 + i} for i, t in enumerate([0.0, 0.6, 1.0, 1.4] * 2)]
    lazy, lazy_masks, lazy_picks = _run(engines["lazy", jump], params)
    eager, eager_masks, eager_picks = _run(engines["eager", jump], params)
    assert lazy == eager
    assert eager_picks == 0 and lazy_picks > 0
    assert lazy_masks < eager_masks, (lazy_masks, eager_masks)


def test_rows_with_top_p_or_a_tight_budget_get_their_mask_first(engines):
    params = [{"json_schema": SCHEMA, "max_new_tokens": 30, "temperature": 0.9, "top_p": 0.8, "seed": i} for i in range(4)]
    _, masks, picks = _run(engines["lazy", True], params)
    assert picks == 0 and masks > 0, "top-p: every pick from the mask"
    closing = [{"json_schema": SCHEMA, "max_new_tokens": 16, "temperature": 0.0, "close_json_within_budget": True} for _ in range(4)]
    lazy, _, _ = _run(engines["lazy", True], closing)
    eager, _, _ = _run(engines["eager", True], closing)
    assert lazy == eager, "the budget closer's narrowed mask applies under lazy masking too"


def test_forced_text_is_picked_from_the_mask_which_keeps_its_canonical_tokens(smollm2_path):
    """SmolLM2 spells '{"' as one token; llguidance's mask at the forced '{"name":' allows only
    that one, while its grammar would also take '{'. A pick biased to '{' must not get through."""
    from radixlm.runtime.engine import Engine

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    outs = {}
    for mode in ("lazy", "eager"):
        engine = Engine(model_path=smollm2_path, grammar_mask=mode, disable_jump_forward=True, max_total_tokens=2048)
        try:
            brace = engine.tokenizer.convert_tokens_to_ids("{")
            outs[mode] = engine.generate("Name a cat as JSON:", {"json_schema": schema, "max_new_tokens": 12, "temperature": 0.0, "logit_bias": {brace: 30.0}})["output_ids"]
        finally:
            engine.shutdown()
    assert outs["lazy"] == outs["eager"]
    assert outs["eager"][0] != brace
