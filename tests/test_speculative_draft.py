"""Draft-model speculation on tiny random models: self-draft (quantized target sharing its KV pool)
and a separate draft model (own KV pool, same slots), driven through the real scheduler.

Drafts are set the way the Speculator does (after a pass, on decoding rows without drafts) and
verified by the decoder in the next pass; every step checks the KV accounting.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import Driver, failing_every, make_tiny_model
from radixlm.runtime.engine import build_parts
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.speculative.draft_model import DraftModelProposer

PROMPTS = [[5, 17, 42, 9, 33, 8], [100, 3, 77], [250, 251, 252, 253, 254, 255, 12, 40, 41], [7]]


def _args(model: str, draft_path: str | None = None, draft_quant: str | None = None, **kw) -> ServerArgs:
    args = ServerArgs.from_kwargs(model_path=model, max_total_tokens=kw.pop("max_total_tokens", 2048), **kw)
    args.speculative_draft_model_path = draft_path  # the draft options (ServerArgs fields once merged)
    args.speculative_draft_quantization = draft_quant
    return args


def _speculate(rt, proposer: DraftModelProposer, k: int, stats: dict | None = None, pause: dict | None = None):
    """An ``on_step`` hook: give the decoding rows without drafts up to ``k`` drafts (as the Speculator
    does); a request in ``pause`` gets none for that many more steps (as when the gate says no)."""
    last: dict = {}

    def hook(_step: int) -> None:
        sched = rt.scheduler
        if stats is not None:  # _generate sums these requests' verified drafts at the end
            stats.setdefault("reqs", set()).update(last)
        last.clear()
        for req in list(proposer._state):
            if req.finish is not None:
                proposer.release(req)
        ready = [r for r in sched.running if r.finish is None and r.generating and not r.draft_ids and r.params.max_new_tokens > 0]
        if pause:
            ready = [r for r in ready if pause.get(r, 0) <= 0]
            for r in pause:
                pause[r] -= 1
        sizes = [min(k, r.remaining_tokens() - 1, rt.runner.context_len - 1 - r.seq_len) for r in ready]
        for req, prop in zip(ready, proposer.propose(ready, sizes)):
            if prop.tokens:
                req.draft_ids, req.draft_probs, req.draft_source = list(prop.tokens), prop.probs, "draft"
                last[req] = len(prop.tokens)
        sched.check_accounting()

    return hook


def _generate(rt, prompts, proposer=None, k: int = 4, stats: dict | None = None, **params) -> list[list[int]]:
    driver = Driver(rt)
    rids = [driver.add(p, **{"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True, **params}) for p in prompts]
    driver.run(on_step=None if proposer is None else _speculate(rt, proposer, k, stats))
    rt.scheduler.check_accounting()
    if stats is not None:
        seen = stats.get("reqs", set())
        stats["drafted"] = sum(r.spec_draft_tokens for r in seen)
        stats["accepted"] = sum(r.spec_accepted_tokens for r in seen)
    return [driver.results[r].output_ids for r in rids]


def _assert_pool_clean(rt) -> None:
    kv = rt.kv
    kv.check_accounting([])
    assert kv.allocator.available_slots() + kv.tree.total_size() == kv.allocator.num_slots


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory) -> dict[str, str]:
    """A one-layer draft with the tiny Llama's tokenizer, and two drafts whose vocabulary differs."""
    root = tmp_path_factory.mktemp("drafts")
    small = make_tiny_model("llama", root / "small", seed=1, num_hidden_layers=1)
    size = make_tiny_model("llama", root / "size", seed=1, num_hidden_layers=1, vocab_size=410)
    strings = root / "strings"
    shutil.copytree(small, strings)
    tok = json.loads((strings / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size and strings, two ids swapped
    (strings / "tokenizer.json").write_text(json.dumps(tok))
    return {"small": small, "size": size, "strings": str(strings)}


@pytest.fixture(scope="module")
def target(tiny_llama):
    """The tiny Llama (fp32) with its KV manager and scheduler."""
    return build_parts(_args(tiny_llama))


# -------------------------------------------------------------- self-draft
def test_self_draft_of_an_int4_target_proposes_its_own_greedy_continuation(tiny_llama):
    rt = build_parts(_args(tiny_llama, draft_quant="int4", quantization="int4"))
    proposer = DraftModelProposer(rt.args, rt.runner, rt.tokenizer, rt.kv)  # int4 copy of an int4 target: the same model
    plain = _generate(rt, [PROMPTS[0]], max_new_tokens=8)[0]
    driver = Driver(rt)
    driver.add(PROMPTS[0], max_new_tokens=8, temperature=0.0, ignore_eos=True)
    while not (rt.scheduler.running and rt.scheduler.running[0].output_ids):
        driver.step()
    req = rt.scheduler.running[0]
    kv_len = req.kv.kv_len
    prop = proposer.propose([req], [5])
    assert prop[0].tokens == plain[1:6] and prop[0].probs is None
    assert req.kv.kv_len == kv_len and req.kv.alloc_len >= req.seq_len + 4  # slots reserved, nothing marked computed
    rt.scheduler.check_accounting()
    stats: dict = {}
    assert _generate(rt, PROMPTS, proposer, k=4, stats=stats) == _generate(rt, PROMPTS)
    assert stats["accepted"] == stats["drafted"] > 0  # the draft is the target: every draft is kept
    _assert_pool_clean(rt)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_self_draft_greedy_output_is_token_identical_to_no_speculation(target, quantization):
    args = _args(target.args.model_path, draft_quant=quantization)
    proposer = DraftModelProposer(args, target.runner, target.tokenizer, target.kv)
    assert proposer.pool is target.runner.kv_pool
    stats: dict = {}
    assert _generate(target, PROMPTS, proposer, k=4, stats=stats) == _generate(target, PROMPTS)
    assert 0 < stats["accepted"] <= stats["drafted"]
    _assert_pool_clean(target)


def test_self_draft_proposes_nothing_for_a_row_the_pool_cannot_hold(tiny_llama):
    rt = build_parts(_args(tiny_llama, max_total_tokens=16))
    proposer = DraftModelProposer(rt.args, rt.runner, rt.tokenizer, rt.kv)
    driver = Driver(rt)
    driver.add(list(range(5, 17)), max_new_tokens=3, temperature=0.0, ignore_eos=True)  # 12 of 16 slots
    while not (rt.scheduler.running and rt.scheduler.running[0].output_ids):
        driver.step()
    req = rt.scheduler.running[0]
    assert proposer.propose([req], [8])[0].tokens == []  # 12 + 8 positions do not fit
    assert len(proposer.propose([req], [2])[0].tokens) == 2
    rt.scheduler.check_accounting()


# -------------------------------------------------------- separate draft
def test_separate_draft_model_greedy_output_is_token_identical_to_no_speculation(target, draft_dirs):
    proposer = DraftModelProposer(_args(target.args.model_path, draft_dirs["small"]), target.runner, target.tokenizer, target.kv)
    assert proposer.pool is not target.runner.kv_pool and proposer.pool.num_layers == 1
    stats: dict = {}
    assert _generate(target, PROMPTS, proposer, k=3, stats=stats) == _generate(target, PROMPTS)
    assert stats["drafted"] > 0
    _assert_pool_clean(target)


def test_separate_draft_with_the_targets_weights_keeps_every_draft(target):
    """Its own pool, catch-up rows and per-request KV bookkeeping are right: nothing is rejected."""
    path = target.args.model_path
    proposer = DraftModelProposer(_args(path, path), target.runner, target.tokenizer, target.kv)
    stats: dict = {}
    assert _generate(target, PROMPTS, proposer, k=4, stats=stats) == _generate(target, PROMPTS)
    assert stats["accepted"] == stats["drafted"] > 20
    _assert_pool_clean(target)


def test_separate_draft_kept_kv_drafts_as_recomputing_everything_would(target, draft_dirs):
    """After rejections and accepted runs, the draft KV it kept gives the drafts a fresh draft gives."""
    args = _args(target.args.model_path, draft_dirs["small"])
    kept = DraftModelProposer(args, target.runner, target.tokenizer, target.kv)
    fresh = DraftModelProposer(args, target.runner, target.tokenizer, target.kv)
    pause: dict = {}
    spec = _speculate(target, kept, 4, pause=pause)
    compared = {"proposals": 0, "reused": 0}

    def hook(step: int) -> None:
        ready = [r for r in target.scheduler.running if r.generating and not r.draft_ids and r.output_ids and pause.get(r, 0) <= 0]
        expected = []
        for req in ready:
            fresh.release(req)
            expected.append(fresh.propose([req], [4])[0].tokens)
            compared["reused"] += kept._computed_len(req) > 0
        spec(step)
        for req, tokens in zip(ready, expected):
            if req.draft_ids:
                assert req.draft_ids == tokens[: len(req.draft_ids)], f"step {step}: {req.draft_ids} != {tokens}"
                compared["proposals"] += 1
        if step % 4 == 0 and ready and ready[0].draft_ids:  # drafts taken back unverified, then 2 plain steps
            ready[0].draft_ids, ready[0].draft_probs, ready[0].draft_source = [], None, ""
            pause[ready[0]] = 3
            compared["dropped"] = compared.get("dropped", 0) + 1

    driver = Driver(target)
    for p in PROMPTS:
        driver.add(p, max_new_tokens=20, temperature=0.0, ignore_eos=True)
    driver.run(on_step=hook)
    assert compared["proposals"] > 10 and compared["reused"] > 10 and compared["dropped"] > 2
    _assert_pool_clean(target)


def _drafted_request(target, draft_dirs):
    """A separate-draft proposer, and a running request whose draft KV it holds up to kv_len."""
    proposer = DraftModelProposer(_args(target.args.model_path, draft_dirs["small"]), target.runner, target.tokenizer, target.kv)
    driver = Driver(target)
    driver.add(PROMPTS[2], max_new_tokens=6, temperature=0.0, ignore_eos=True)
    while not (target.scheduler.running and target.scheduler.running[0].output_ids):
        driver.step()
    req = target.scheduler.running[0]
    assert proposer.propose([req], [2])[0].tokens
    assert proposer._computed_len(req) == req.kv.kv_len
    return proposer, driver, req


def test_separate_draft_recomputes_positions_another_draft_pass_rewrote(target, draft_dirs):
    """A slot freed (rejected drafts), written by another request's draft and handed back is not trusted."""
    proposer, driver, req = _drafted_request(target, draft_dirs)
    slot = int(target.kv.table.table[req.kv.row, 3])
    proposer._passes += 1  # what another request's draft pass writing that slot records
    proposer._stamps[slot] = proposer._passes
    assert proposer._computed_len(req) == 3
    req.draft_ids = []
    driver.run()
    _assert_pool_clean(target)


def test_separate_draft_recomputes_positions_whose_slots_the_tree_swapped(target, draft_dirs):
    """A running request's prefix pointed at other slots (the tree's copies) is not trusted."""
    proposer, driver, req = _drafted_request(target, draft_dirs)
    table = target.kv.table.table
    saved = int(table[req.kv.row, 3])
    table[req.kv.row, 3] = int(table[req.kv.row, 4])
    try:
        assert proposer._computed_len(req) == 3
    finally:
        table[req.kv.row, 3] = saved
    req.draft_ids = []
    driver.run()
    proposer.release(req)
    _assert_pool_clean(target)


def test_separate_draft_recomputes_after_a_retraction(tiny_llama):
    """Requests retracted (pool too small for all) and re-admitted still get exact draft KV."""
    rt = build_parts(_args(tiny_llama, max_total_tokens=200, max_running_requests=12))
    proposer = DraftModelProposer(_args(tiny_llama, tiny_llama), rt.runner, rt.tokenizer, rt.kv)
    prompts = [[(7 * i + 3 * j) % 390 + 3 for j in range(8 + 3 * i)] for i in range(10)]
    stats: dict = {}
    out = _generate(rt, prompts, proposer, k=4, stats=stats, max_new_tokens=24)
    assert rt.scheduler.total_retracted > 0
    assert out == _generate(rt, prompts, max_new_tokens=24)
    assert stats["accepted"] == stats["drafted"]
    _assert_pool_clean(rt)


def test_a_draft_whose_vocabulary_differs_is_refused(target, draft_dirs):
    for name in ("size", "strings"):
        with pytest.raises(ValueError, match="speculative_draft_model_path"):
            DraftModelProposer(_args(target.args.model_path, draft_dirs[name]), target.runner, target.tokenizer, target.kv)


@pytest.mark.parametrize(("arch", "kind"), [("qwen3_5", "linear-attention layers"), ("deepseek_v2", "latent attention")])
def test_a_draft_that_keeps_more_than_per_head_kv_is_refused_by_name(arch, kind, target, tmp_path):
    """The draft's own pool holds per-head KV only: a hybrid or latent-attention draft is refused, not run."""
    draft = make_tiny_model(arch, tmp_path / arch)
    with pytest.raises(ValueError, match=f"speculative_draft_model_path .* {kind}"):
        DraftModelProposer(_args(target.args.model_path, draft), target.runner, target.tokenizer, target.kv)


# ------------------------------------------------------ sampling, faults, aborts
def test_sampling_with_a_draft_returns_full_lengths_and_is_reproducible_with_a_seed(target, draft_dirs):
    proposer = DraftModelProposer(_args(target.args.model_path, draft_dirs["small"]), target.runner, target.tokenizer, target.kv)
    params = dict(temperature=1.0, top_p=0.9, max_new_tokens=16, seed=11)
    stats: dict = {}
    first = _generate(target, PROMPTS, proposer, stats=stats, **params)
    assert [len(o) for o in first] == [16] * len(PROMPTS)
    assert stats["drafted"] > 0
    assert _generate(target, PROMPTS, proposer, **params) == first
    _assert_pool_clean(target)


def test_sampled_drafts_carry_the_law_they_were_drawn_from(target, draft_dirs):
    proposer = DraftModelProposer(_args(target.args.model_path, draft_dirs["small"]), target.runner, target.tokenizer, target.kv)
    driver = Driver(target)
    driver.add(PROMPTS[0], max_new_tokens=8, temperature=0.8, top_k=20, ignore_eos=True, seed=3)
    while not (target.scheduler.running and target.scheduler.running[0].output_ids):
        driver.step()
    req = target.scheduler.running[0]
    prop = proposer.propose([req], [3])[0]
    assert prop.probs is not None and prop.probs.shape == (3, target.runner.config.vocab_size)
    assert torch.allclose(prop.probs.sum(dim=1), torch.ones(3)) and all(int((row > 0).sum()) <= 20 for row in prop.probs)
    assert all(float(prop.probs[i, t]) > 0 for i, t in enumerate(prop.tokens))
    driver.run()
    proposer.release(req)
    _assert_pool_clean(target)


def test_a_proposal_that_raises_leaves_nothing_behind(target, draft_dirs):
    proposer = DraftModelProposer(_args(target.args.model_path, target.args.model_path), target.runner, target.tokenizer, target.kv)
    proposer._forward, calls = failing_every(proposer._forward, 3, 2, "draft pass failed")
    base = _speculate(target, proposer, 4)

    def hook(step: int) -> None:
        try:
            base(step)
        except RuntimeError:  # the Speculator catches it: no drafts this step, plain decoding
            assert not any(r.draft_ids for r in target.scheduler.running)

    driver = Driver(target)
    rids = [driver.add(p, max_new_tokens=20, temperature=0.0, ignore_eos=True) for p in PROMPTS]
    driver.run(on_step=hook)
    assert [driver.results[r].output_ids for r in rids] == _generate(target, PROMPTS)
    assert calls["n"] > 3
    _assert_pool_clean(target)


def test_aborting_a_request_with_drafts_keeps_the_accounting_clean(target, draft_dirs):
    proposer = DraftModelProposer(_args(target.args.model_path, draft_dirs["small"]), target.runner, target.tokenizer, target.kv)
    driver = Driver(target)
    rids = [driver.add(p, max_new_tokens=30, temperature=0.0, ignore_eos=True) for p in PROMPTS]
    spec = _speculate(target, proposer, 4)

    def hook(step: int) -> None:
        spec(step)
        if step == 4:
            assert any(r.draft_ids for r in target.scheduler.running)
            for r in target.scheduler.running[:2]:
                target.scheduler.abort(r.rid)

    driver.run(on_step=hook)
    aborted = [r for r in rids if driver.results[r].meta_info["finish_reason"]["type"] == "abort"]
    assert len(aborted) == 2
    _assert_pool_clean(target)
