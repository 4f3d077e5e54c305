"""Speculation inside the engine: greedy parity, stops, limits, logprobs, streaming, constraints,
seeds, and clean KV accounting after rejections, aborts and retractions (tiny models)."""

from __future__ import annotations

import json
import re

import pytest
from test_parity import SCENARIOS, _run_scenario, _tiny_prompts

from helpers import Driver
from radixlm import Engine, ServerArgs
from radixlm.runtime.engine import build_parts
from radixlm.runtime.speculative import speculator as speculator_module
from radixlm.runtime.speculative.gate import GateConfig
from radixlm.runtime.speculative.proposal import Proposal

ALWAYS = dict(min_gain=0.0, position_cost=0.0, max_batch=10**6)  # speculate on every row, K tokens


@pytest.fixture
def always_speculate(monkeypatch):
    """Every Speculator built during the test drafts K tokens on every row."""
    monkeypatch.setattr(speculator_module, "GateConfig", lambda: GateConfig(**ALWAYS))


class OracleProposer:
    """Proposes the reference continuation, with the last draft wrong on every other step."""

    name = "ngram"

    def __init__(self, refs: dict[tuple, list[int]], fallback, vocab: int) -> None:
        self.refs, self.fallback, self.vocab = refs, fallback, vocab
        self.steps = 0

    def propose(self, reqs, num_tokens, own_only=None):
        out = []
        for req, k in zip(reqs, num_tokens):
            ref = self.refs.get(tuple(req.input_ids))
            if ref is None:
                out.append(self.fallback.propose([req], [k])[0])
                continue
            n = len(req.output_ids)
            tokens = list(ref[n : n + k])
            self.steps += 1
            if tokens and self.steps % 2:
                tokens[-1] = (tokens[-1] + 1) % self.vocab
            out.append(Proposal(tokens))
        return out

    def release(self, req) -> None:
        self.fallback.release(req)


# ------------------------------------------------------------ parity scenarios
@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_output_is_identical_with_speculation_in_every_scenario(scenario, algorithm, tiny_llama, always_speculate):
    prompts = _tiny_prompts()
    options, arrival = SCENARIOS[scenario]
    if scenario == "retraction":  # tighter: accepted drafts end requests in fewer steps, the pool must still run out
        options = {**options, "max_total_tokens": 360}
    plain, _ = _run_scenario(tiny_llama, prompts, dict(options), arrival)
    spec, rt = _run_scenario(tiny_llama, prompts, {**options, "speculative_algorithm": algorithm}, arrival)
    assert spec == plain
    stats = rt.scheduler.speculator.stats()
    assert stats["spec_draft_tokens"] > 0
    if scenario == "retraction":
        assert rt.scheduler.total_retracted > 0
    rt.scheduler.check_accounting()


# ------------------------------------------------ the engine with accepted runs
@pytest.fixture(scope="module")
def engines(tiny_llama):
    """An engine without speculation, and one whose n-gram proposer is an oracle (module-wide)."""
    prompts = [p for p in _tiny_prompts()[:6]]
    plain = Engine(tiny_llama, max_total_tokens=4096, debug_check_accounting=True)
    spec = Engine(tiny_llama, max_total_tokens=4096, debug_check_accounting=True, speculative_algorithm="ngram")
    outs = plain.generate(input_ids=prompts, sampling_params={"max_new_tokens": 48, "temperature": 0, "ignore_eos": True})
    refs = {tuple(p): o["output_ids"] for p, o in zip(prompts, outs)}
    spec_sched = spec.scheduler
    spec_sched.speculator.gate.config = GateConfig(**ALWAYS)
    spec_sched.speculator.ngram = OracleProposer(refs, spec_sched.speculator.ngram, spec.config.vocab_size)
    yield plain, spec, prompts, refs
    plain.shutdown()
    spec.shutdown()


def _both(engines, **kw):
    plain, spec, _, _ = engines
    return plain.generate(**kw), spec.generate(**kw)


def _same(a: dict, b: dict) -> None:
    assert b["output_ids"] == a["output_ids"]
    assert b["text"] == a["text"]
    assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"]
    assert b["meta_info"]["completion_tokens"] == a["meta_info"]["completion_tokens"]


def test_accepted_runs_are_counted_in_meta_info_and_stats(engines):
    _, spec, prompts, refs = engines
    out = spec.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 40, "temperature": 0, "ignore_eos": True})
    assert out["output_ids"] == refs[tuple(prompts[0])][:40]
    meta = out["meta_info"]
    assert meta["spec_accepted_tokens"] > 0 and meta["spec_draft_tokens"] >= meta["spec_accepted_tokens"]
    assert meta["spec_accept_length"] == pytest.approx(meta["spec_accepted_tokens"] / meta["spec_verify_passes"])
    assert meta["spec_verify_passes"] < 40 / 1.5  # accepted runs saved passes
    stats = spec.get_stats()
    assert stats["speculative_algorithm"] == "ngram" and 0 < stats["spec_accept_rate"] <= 1


def test_stop_token_inside_an_accepted_run_ends_the_request_there(engines):
    _, _, prompts, refs = engines
    ref = refs[tuple(prompts[1])]
    for at in range(4, 12):  # the stop lands at each place of a drafted run
        stop = ref[at]
        a, b = _both(engines, input_ids=prompts[1], sampling_params={"max_new_tokens": 40, "temperature": 0, "stop_token_ids": [stop]})
        _same(a, b)
        assert b["output_ids"][-1] == stop and len(b["output_ids"]) <= at + 1


def test_stop_string_inside_an_accepted_run_ends_the_request_at_the_same_token(engines):
    plain, _, prompts, refs = engines
    ref = refs[tuple(prompts[2])]
    text = plain.tokenizer.decode(ref[:30])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "the reference text has no usable stop string"
    a, b = _both(engines, input_ids=prompts[2], sampling_params={"max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": [stop]})
    _same(a, b)
    assert b["meta_info"]["finish_reason"]["type"] == "stop"
    assert len(b["output_ids"]) < 30


@pytest.mark.parametrize("limit", [1, 2, 7, 11])
def test_max_new_tokens_is_never_exceeded(engines, limit):
    _, _, prompts, _ = engines
    a, b = _both(engines, input_ids=prompts[3], sampling_params={"max_new_tokens": limit, "temperature": 0, "ignore_eos": True})
    _same(a, b)
    assert len(b["output_ids"]) == limit


def test_logprobs_are_given_for_every_accepted_token(engines):
    _, _, prompts, _ = engines
    kw = dict(input_ids=prompts[4], sampling_params={"max_new_tokens": 21, "temperature": 0, "ignore_eos": True}, return_logprob=True, top_logprobs_num=2)
    a, b = _both(engines, **kw)
    _same(a, b)
    entries = b["meta_info"]["output_token_logprobs"]
    assert len(entries) == len(b["output_ids"]) == 21
    assert [e[1] for e in entries] == b["output_ids"]
    for (lp_a, _, _), (lp_b, _, _) in zip(a["meta_info"]["output_token_logprobs"], entries):
        assert lp_b == pytest.approx(lp_a, abs=1e-4)
    assert len(b["meta_info"]["output_top_logprobs"]) == 21


def test_streamed_text_equals_the_non_streamed_text(engines):
    _, spec, prompts, _ = engines
    params = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    whole = spec.generate(input_ids=prompts[5], sampling_params=params)
    chunks = list(spec.generate(input_ids=prompts[5], sampling_params=params, stream=True))
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert all(c["text"].startswith(p["text"]) for p, c in zip(chunks, chunks[1:]))
    assert chunks[-1]["meta_info"]["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("constraint", [{"regex": r"(ab|cd)[0-9]{3,6}x"}, {"json_schema": json.dumps({"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 6}}, "required": ["n", "s"], "additionalProperties": False})}])
def test_constrained_outputs_stay_valid_and_identical_with_speculation(engines, constraint):
    _, _, prompts, _ = engines
    outs = []
    for p in prompts[:3]:
        a, b = _both(engines, input_ids=p, sampling_params={"max_new_tokens": 60, "temperature": 0, **constraint})
        _same(a, b)
        outs.append(b)
    assert sum(o["meta_info"].get("spec_draft_tokens", 0) for o in outs) > 0
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length"), out["meta_info"]["finish_reason"]
        if out["meta_info"]["finish_reason"]["type"] == "length":
            continue
        if "regex" in constraint:
            assert re.fullmatch(constraint["regex"], out["text"])
        else:
            value = json.loads(out["text"])
            assert set(value) == {"n", "s"} and isinstance(value["n"], int)


def test_a_seeded_sample_is_reproducible_whatever_ran_before_and_beside_it(tiny_llama, always_speculate):
    prompt = _tiny_prompts()[7]
    params = {"max_new_tokens": 32, "temperature": 0.3, "seed": 11, "ignore_eos": True}
    results = []
    for others in (0, 5):
        with Engine(tiny_llama, max_total_tokens=4096, speculative_algorithm="ngram") as engine:
            if others:  # outputs of the same prompt (other seeds) fill the cross-request index first
                engine.generate(input_ids=[prompt] * others, sampling_params=[{**params, "seed": 100 + i} for i in range(others)])
            batch = [prompt] + _tiny_prompts()[8 : 8 + others]
            out = engine.generate(input_ids=batch, sampling_params=params)
            results.append(out[0]["output_ids"])
            assert out[0]["meta_info"].get("spec_draft_tokens", 0) > 0
    assert results[0] == results[1]


# ------------------------------------------------------------- KV accounting
def _forced_driver(tiny_llama: str, **options) -> Driver:
    rt = build_parts(ServerArgs(model_path=tiny_llama, speculative_algorithm="ngram", **options))
    rt.scheduler.speculator.gate.config = GateConfig(**ALWAYS)
    return Driver(rt)


def _no_slots_past_the_verified_tokens(sched) -> None:
    page = sched.kv.page_size
    for r in sched.running:
        if r.kv is not None and r.generating:
            verified = r.seq_len - len(r.draft_ids)
            assert r.kv.alloc_len <= -(-verified // page) * page, f"{r.rid} keeps slots of rejected drafts"


@pytest.mark.parametrize("page_size", [1, 4])
def test_rejected_drafts_free_their_kv_at_once_and_aborts_leak_nothing(tiny_llama, page_size):
    d = _forced_driver(tiny_llama, max_total_tokens=2048, page_size=page_size)
    prompts = _tiny_prompts()[:6]
    rids = [d.add(p, max_new_tokens=40, temperature=0, ignore_eos=True) for p in prompts]
    for i in range(12):
        d.step()  # checks the accounting
        _no_slots_past_the_verified_tokens(d.sched)
        if i == 6:
            d.sched.abort(rids[1])
            d.sched.abort(rids[4])
    d.run()
    assert d.results[rids[1]].meta_info["finish_reason"]["type"] == "abort"
    assert d.sched.speculator.draft_tokens > d.sched.speculator.accepted_tokens  # drafts were rejected
    d.sched.check_accounting()
    assert not d.sched.speculator._pending and not d.sched.speculator.ngram._histories


def test_speculative_drafts_give_way_before_any_request_is_retracted(tiny_llama):
    d = _forced_driver(tiny_llama, max_total_tokens=2048)
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i, 50 + i] * 6 for i in range(4)]  # repetitive: n-grams match
    rids = [d.add(p, max_new_tokens=32, temperature=0, ignore_eos=True) for p in prompts]
    for _ in range(40):
        d.step()
        if sum(r.speculating for r in d.sched.running) >= 2:
            break
    assert sum(r.speculating for r in d.sched.running) >= 2, "no request got drafts"
    kv = d.sched.kv
    # the pool now holds what plain decoding needs, not the drafts
    kv.available = lambda: sum(kv.pages_for(r.kv, r.seq_len - len(r.draft_ids)) for r in d.sched.running if r.generating)
    d.step()
    assert d.sched.total_retracted == 0
    del kv.available
    d.run()
    assert all(len(d.results[r].output_ids) == 32 for r in rids)


def test_sampling_with_a_self_draft_runs_to_full_length_and_counts_its_drafts(tiny_llama, always_speculate):
    """Sampled rows verified against the int4 self-draft's law q: every request completes, drafts are counted."""
    with Engine(tiny_llama, max_total_tokens=4096, debug_check_accounting=True, speculative_algorithm="draft") as engine:
        outs = engine.generate(
            input_ids=_tiny_prompts()[:4],
            sampling_params={"max_new_tokens": 24, "temperature": 0.9, "top_p": 0.95, "ignore_eos": True},
        )
        assert [len(o["output_ids"]) for o in outs] == [24] * 4
        assert sum(o["meta_info"]["spec_draft_tokens"] for o in outs) > 0
        stats = engine.get_stats()
        assert stats["speculative_algorithm"] == "draft" and stats["spec_draft_tokens"] > 0


def test_a_forward_pass_split_by_a_failing_request_keeps_its_speculating_neighbours_exact(tiny_llama):
    """The split-and-retry path with drafts in flight: only the failing request fails, the others'
    greedy outputs equal plain decoding and the KV accounting stays clean."""
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i, 50 + i] * 4 + [7 * i + 3] for i in range(6)]
    plain = Driver(build_parts(ServerArgs(model_path=tiny_llama)))
    want = [plain.add(p, max_new_tokens=24, temperature=0, ignore_eos=True) for p in prompts]
    plain.run()
    d = _forced_driver(tiny_llama, max_total_tokens=2048, debug_fault_injection=True)
    rids = [d.add(p, max_new_tokens=24, temperature=0, ignore_eos=True) for p in prompts]
    for _ in range(3):
        d.step()
    for j in range(3):  # each arrives while the others decode with drafts, and fails its pass
        d.add([5, 6, 7, 8 + j], rid=f"fault-forward-{j}", max_new_tokens=4)
        for _ in range(2):
            d.step()
    d.run()
    for j in range(3):
        assert d.results[f"fault-forward-{j}"].meta_info["finish_reason"]["type"] == "abort"
    assert [d.results[r].output_ids for r in rids] == [plain.results[r].output_ids for r in want]
    assert d.sched.speculator.draft_tokens > 0
    d.sched.check_accounting()
