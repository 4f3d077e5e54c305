"""Speculative decoding's parts on their own: the gate, the n-gram and prediction proposers, the
recent-output index, options, KV shrinking and the sampling law of deterministic drafts."""

from __future__ import annotations

import time

import pytest
import torch

from radixlm import ServerArgs
from radixlm.radix_cache import KVManager, RadixCache, ReqToTokenTable, SlotAllocator
from radixlm.runtime.request import FinishReason, Req
from radixlm.runtime.sampler import SamplingRow, accept_draft
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.speculative.gate import Gate, GateConfig
from radixlm.runtime.speculative.ngram import (
    NgramIndex,
    NgramProposer,
    PredictionProposer,
    RecentOutputs,
)
from radixlm.runtime.speculative.prediction import prediction_text


def _req(prompt: list[int], output: list[int] | None = None, **kw) -> Req:
    req = Req(rid="r", input_ids=list(prompt), params=SamplingParams(), sink=lambda out: None, **kw)
    req.output_ids = list(output or [])
    return req


# ------------------------------------------------------------------ gate
def test_gate_speculates_at_full_length_on_a_fresh_request_and_stops_after_rejections():
    gate = Gate(GateConfig())
    assert gate.plan("a", 4, batch=1) == 4  # the prior (0.6) pays for all four
    for _ in range(10):
        gate.record("a", 4, 0)
    assert gate.rate("a") < 0.2
    assert gate.plan("a", 4, batch=1) == 0


def test_gate_probes_a_stopped_request_and_resumes_when_acceptance_recovers():
    cfg = GateConfig(probe_every=5, probe_tokens=2)
    gate = Gate(cfg)
    for _ in range(8):
        gate.record("a", 4, 0)
    decisions = [gate.plan("a", 4, batch=1) for _ in range(10)]
    assert decisions == [0, 0, 0, 0, 2, 0, 0, 0, 0, 2]  # a short probe every probe_every steps
    for _ in range(6):
        gate.record("a", 2, 2)  # the probes were all accepted
    assert gate.plan("a", 4, batch=1) == 4


def test_gate_turns_off_above_the_batch_threshold_except_for_own_only_requests():
    gate = Gate(GateConfig(max_batch=8))
    assert gate.plan("a", 4, batch=8) == 4
    assert gate.plan("a", 4, batch=9) == 0
    assert gate.plan("a", 4, batch=64, own_only=True) == 4


def test_gate_picks_the_draft_length_with_the_best_expected_gain():
    gate = Gate(GateConfig(position_cost=0.05, min_gain=1.15))
    assert gate.gain(0.5, 1) == pytest.approx(1.5 / 1.05)
    assert gate.best_k(0.1, 4) == 0  # 1.1 tokens for 1.05 passes does not pay
    assert gate.best_k(0.95, 4) == 4
    assert 1 <= gate.best_k(0.4, 8) < 8  # extra positions stop paying before K
    assert gate.plan("a", 0, batch=1) == 0  # no budget (max_new_tokens or context)


def test_gate_decisions_depend_only_on_the_request_history():
    history = [(4, 1), (4, 0), (3, 3), (4, 0), (4, 0), (2, 0)]
    runs = []
    for noise in (False, True):
        gate = Gate(GateConfig(probe_every=3))
        out = []
        for proposed, accepted in history:
            if noise:  # another request's history must not matter
                gate.record("other", 4, 4)
                gate.plan("other", 4, batch=2)
            out.append(gate.plan("a", 4, batch=2))
            gate.record("a", proposed, accepted)
        runs.append(out)
    assert runs[0] == runs[1]


# ----------------------------------------------------------------- n-gram
def test_ngram_index_keeps_the_latest_occurrence_and_indexes_incrementally():
    idx = NgramIndex(max_n=2)
    tokens = [5, 6, 7, 5, 6, 8]
    idx.extend(tokens, 3)
    assert idx.table[(5, 6)] == 2 and idx.indexed == 3
    idx.extend(tokens, 5)
    assert idx.table[(5, 6)] == 5  # the later occurrence wins
    assert idx.indexed == 5


def test_ngram_proposes_the_continuation_of_the_longest_match():
    # last tokens "1 2 3": the 3-gram occurs at the start (followed by 4 5), while the latest
    # 1-gram "3" occurred just before (followed by 9): the longest match wins
    prompt = [1, 2, 3, 4, 5, 0, 3, 9, 8, 1, 2, 3]
    prop = NgramProposer()
    assert prop.propose([_req(prompt)], [3])[0].tokens == [4, 5, 0]
    assert prop.propose([_req([7, 8, 9])], [3])[0].tokens == []  # nothing repeats


def test_ngram_follows_the_output_as_it_grows():
    req = _req([10, 11, 12, 13, 14, 15, 16], [10, 11])
    prop = NgramProposer()
    assert prop.propose([req], [2])[0].tokens == [12, 13]
    req.output_ids += [12, 13]
    assert prop.propose([req], [3])[0].tokens == [14, 15, 16]


def test_ngram_finds_recent_outputs_of_other_requests_within_the_same_salt():
    prop = NgramProposer()
    done = _req([1, 2], [40, 41, 42, 43, 44])
    done.finish = FinishReason("stop")
    prop.release(done)
    assert prop.propose([_req([3, 40, 41])], [3])[0].tokens == [42, 43, 44]
    assert prop.propose([_req([3, 40, 41], cache_salt="s")], [3])[0].tokens == []
    assert prop.propose([_req([3, 40, 41])], [3], own_only=[True])[0].tokens == []


def test_ngram_does_not_learn_from_failed_or_retracted_requests():
    prop = NgramProposer()
    failed = _req([1], [50, 51, 52, 53])
    failed.finish = FinishReason.failure("boom")
    prop.release(failed)
    retracted = _req([1], [60, 61, 62, 63])
    prop.release(retracted)
    assert prop.propose([_req([50, 51])], [2])[0].tokens == []
    assert prop.propose([_req([60, 61])], [2])[0].tokens == []


def test_recent_outputs_stay_within_their_token_budget_least_recently_used_first():
    recent = RecentOutputs(max_tokens=30, max_n=3, min_n=2)
    recent.add(None, [100, 101, 102, 103, 104, 105, 106, 107, 108, 109])
    recent.add(None, [200, 201, 202, 203, 204, 205, 206, 207, 208, 209])
    assert recent.lookup(None, (100, 101), 2) == [102, 103]  # the first output is now the most recent
    recent.add(None, [300, 301, 302, 303, 304, 305, 306, 307, 308, 309])
    recent.add(None, [400, 401, 402, 403, 404, 405, 406, 407, 408, 409])
    assert recent.size <= 30
    assert recent.lookup(None, (100, 101), 2) == [102, 103]
    assert recent.lookup(None, (200, 201), 2) == []  # evicted, index entries with it
    assert not any(doc == 1 for doc, _ in recent.table.values())
    assert len(recent.table) <= 3 * 2 * 10


def test_ngram_proposals_for_a_batch_of_eight_cost_well_under_a_millisecond_per_step():
    prompts = [[(i * 7 + j * 13) % 500 for j in range(2000)] for i in range(8)]
    reqs = [_req(p) for p in prompts]
    prop = NgramProposer()
    prop.propose(reqs, [4] * 8)  # builds the indexes once
    steps = 200
    start = time.perf_counter()
    for s in range(steps):
        for r in reqs:
            r.output_ids.append((s * 31 + len(r.output_ids)) % 500)
        prop.propose(reqs, [4] * 8)
    per_step = (time.perf_counter() - start) / steps
    assert per_step < 1e-3, f"{per_step * 1e6:.0f} µs per step"


def test_prediction_is_followed_while_the_output_matches_it_then_resynchronised():
    req = _req([1, 2], prediction_ids=[20, 21, 22, 23, 24, 25, 26])
    prop = PredictionProposer()
    assert prop.propose([req], [3])[0].tokens == [20, 21, 22]
    req.output_ids = [20, 21]
    assert prop.propose([req], [3])[0].tokens == [22, 23, 24]
    req.output_ids = [20, 21, 99, 23, 24]  # departed from it, then came back: "23 24" -> 25 26
    assert prop.propose([req], [3])[0].tokens == [25, 26]
    assert prop.propose([_req([1, 2])], [3])[0].tokens == []  # no prediction, no drafts


def test_prediction_field_shapes_are_parsed_or_refused_by_name():
    assert prediction_text("abc") == "abc"
    assert prediction_text({"type": "content", "content": "abc"}) == "abc"
    assert prediction_text({"type": "content", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}) == "ab"
    assert prediction_text(None) is None
    for bad in (3, {"type": "file", "content": "x"}, {"type": "content", "content": 3}, {"type": "content", "content": [{"type": "image"}]}, {"type": "content", "content": "x", "extra": 1}):
        with pytest.raises(ValueError, match="prediction"):
            prediction_text(bad)


# ---------------------------------------------------------------- options
def test_speculative_options_are_validated_by_name():
    assert ServerArgs.from_kwargs(speculative_algorithm="ngram", speculative_num_draft_tokens=16).speculative_num_draft_tokens == 16
    for k in (0, 17, True, 2.0):
        with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
            ServerArgs.from_kwargs(speculative_num_draft_tokens=k)
    with pytest.raises(ValueError, match="speculative_algorithm"):
        ServerArgs.from_kwargs(speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="speculative_draft_model_path applies only"):
        ServerArgs.from_kwargs(speculative_algorithm="ngram", speculative_draft_model_path="/x")
    with pytest.raises(ValueError, match="speculative_draft_quantization applies only"):
        ServerArgs.from_kwargs(speculative_draft_quantization="int4")
    ServerArgs.from_kwargs(speculative_algorithm="draft", speculative_draft_quantization="int8")


def test_serve_help_explains_the_speculative_flags():
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    text = parser.format_help()
    for flag in ("--speculative-algorithm", "--speculative-num-draft-tokens", "--speculative-draft-model-path", "--speculative-draft-quantization"):
        assert flag in text
    ns = parser.parse_args(["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "6"])
    args = ServerArgs.from_cli(ns)
    assert (args.speculative_algorithm, args.speculative_num_draft_tokens) == ("ngram", 6)


# --------------------------------------------------------------------- KV
@pytest.mark.parametrize("page_size", [1, 4])
def test_truncate_frees_the_pages_of_rejected_drafts_at_once(page_size):
    alloc = SlotAllocator(64, page_size=page_size)
    kv = KVManager(alloc, ReqToTokenTable(4, 64), RadixCache(alloc.free_slots, page_size))
    state = kv.admit(torch.empty(0, dtype=torch.int64), kv.tree.root)
    assert kv.reserve(state, 13)
    kv.mark_computed(state, 13)
    free_before = alloc.available_slots()
    kv.truncate(state, 6)  # 7 draft positions rejected
    keep = -(-6 // page_size) * page_size
    assert (state.kv_len, state.alloc_len) == (6, keep)
    assert alloc.available_slots() == free_before + (-(-13 // page_size) * page_size - keep)
    kv.check_accounting([state])


def test_truncate_never_frees_tree_owned_pages():
    alloc = SlotAllocator(64, page_size=4)
    kv = KVManager(alloc, ReqToTokenTable(4, 64), RadixCache(alloc.free_slots, 4))
    state = kv.admit(torch.empty(0, dtype=torch.int64), kv.tree.root)
    kv.reserve(state, 10)
    kv.mark_computed(state, 10)
    kv.cache_prefix(state, list(range(10)))
    assert state.cached_len == 8
    kv.truncate(state, 3)
    assert state.kv_len == 8 and state.alloc_len >= 8
    kv.check_accounting([state])


# -------------------------------------------------- the law of point-mass drafts
CHI2_CRITICAL_0_01 = {3: 11.34}


def _draws(logits: torch.Tensor, params: SamplingParams, draft: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    row = SamplingRow(params, [0], [], None, (), False, 0)
    counts = torch.zeros(len(logits))
    for _ in range(n):
        counts[accept_draft(logits, row, draft, gen).token_ids[0]] += 1
    return counts


@pytest.mark.parametrize("case", ["plain", "top_k_and_temperature"])
def test_accept_draft_keeps_the_target_distribution_for_deterministic_drafts(case):
    # The draft holds about half the mass, so a 5% bias on it (0.50 -> 0.525) gives a chi-square
    # non-centrality of ~20 at 8000 draws: detected at the 1% level 19 times in 20.
    if case == "plain":
        logits, params = torch.tensor([0.9, -0.2, 0.3, -1.0]), SamplingParams(temperature=1.0)
    else:
        logits, params = torch.tensor([0.2, 1.0, -0.3, 0.4, -5.0, -6.0]), SamplingParams(temperature=0.8, top_k=4)
    draft = int(logits.argmax())
    scaled = logits / params.temperature
    if params.top_k > 0:
        scaled = scaled.masked_fill(scaled < scaled.topk(params.top_k).values[-1], float("-inf"))
    target = torch.softmax(scaled, dim=-1)
    assert 0.45 < float(target[draft]) < 0.55
    n = 8000
    counts = _draws(logits, params, draft, n)
    keep = target > 0
    assert int(counts[~keep].sum()) == 0, "a token outside the filtered support was drawn"
    expected = target[keep] * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert stat < CHI2_CRITICAL_0_01[int(keep.sum()) - 1], f"chi-square {stat:.1f}; counts {counts.tolist()}, expected {expected.tolist()}"


def test_accept_draft_never_returns_a_draft_that_top_k_filters_out():
    counts = _draws(torch.tensor([2.0, 1.0, 0.5, -3.0]), SamplingParams(temperature=1.0, top_k=3), 3, 300)
    assert counts[3] == 0 and counts.sum() == 300


def test_pass_cost_learns_that_extra_positions_cost_more_in_larger_batches():
    """From (tokens, seconds) of passes a + b*T, one position costs b*B/(a+b*B) of a row's share."""
    from radixlm.runtime.speculative.pass_cost import PassCost

    cost = PassCost(prior=0.05)
    a, b = 0.030, 0.002
    for i in range(40):
        tokens = [1, 5, 8, 40][i % 4]
        cost.record(tokens, a + b * tokens)
    fit = cost.line()
    assert fit is not None and abs(fit[0] - a) < 1e-9 and abs(fit[1] - b) < 1e-9
    assert abs(cost.position_cost(1) - b / (a + b)) < 1e-9
    assert abs(cost.position_cost(8) - 8 * b / (a + 8 * b)) < 1e-9
    # a low acceptance pays at batch 1 (positions nearly free) but not at batch 8
    gate = Gate(GateConfig(max_batch=64))
    for _ in range(20):
        gate.record("r", 4, 1)
    assert gate.plan("r", 4, 1, position_cost=lambda k: cost.position_cost(1, k)) > 0
    assert gate.plan("r", 4, 8, position_cost=lambda k: cost.position_cost(8, k)) == 0


def test_pass_cost_keeps_its_prior_until_pass_sizes_vary():
    """Passes all of one size cannot separate the fixed cost from the per-token cost."""
    from radixlm.runtime.speculative.pass_cost import PassCost

    cost = PassCost(prior=0.05)
    for _ in range(50):
        cost.record(8, 0.05)
    assert cost.line() is None and cost.position_cost(8) == 0.05


def test_gate_drafts_only_as_far_as_the_measured_pass_times_stay_flat():
    """Passes of 1-3 tokens cost alike but 5 cost double (a CPU matmul kernel switch): with a
    high acceptance the gate drafts 2 tokens, not the 4 a linear cost model would pick."""
    from radixlm.runtime.speculative.pass_cost import PassCost

    cost = PassCost(prior=0.05)
    for _ in range(10):
        for tokens, seconds in ((1, 0.070), (2, 0.071), (3, 0.072), (4, 0.140), (5, 0.141)):
            cost.record(tokens, seconds)
    assert cost.position_cost(1, 2) < 0.02 < 0.2 < cost.position_cost(1, 4)
    gate = Gate(GateConfig(max_batch=64))
    for _ in range(20):
        gate.record("r", 4, 4)  # everything accepted
    assert gate.plan("r", 4, 1, position_cost=lambda k: cost.position_cost(1, k)) == 2
    assert gate.plan("r", 4, 1) == 4  # the configured constant: nearly free positions


def test_draft_cost_charges_each_row_its_share_of_the_draft_step():
    """A draft step shared by all 8 rows costs each little; the same step for 1 row of 8 costs it 8x."""
    from types import SimpleNamespace

    from radixlm.runtime.server_args import ServerArgs
    from radixlm.runtime.speculative.speculator import DRAFT_COST_PRIOR, Speculator

    spec = Speculator(ServerArgs(), SimpleNamespace(context_len=2048), tokenizer=None)
    assert spec.draft_cost(8) == 0.0  # no draft model: n-gram lookup costs nothing
    spec.model = object()  # a draft model, as far as the cost is concerned
    assert spec.draft_cost(8) == DRAFT_COST_PRIOR  # nothing measured yet
    for _ in range(10):
        spec.note_pass(0.100, 8)
        spec.note_pass(0.110, 16)
    spec.draft_step_s = 0.050
    spec.drafting_rows = 8
    assert abs(spec.draft_cost(8) - 0.5) < 1e-6
    spec.drafting_rows = 1
    assert abs(spec.draft_cost(8) - 4.0) < 1e-6
    assert spec.draft_cost(8, own_only=True) == DRAFT_COST_PRIOR  # seeded samples never follow timings
