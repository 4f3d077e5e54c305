"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5) give transformers' greedy tokens.

Tiny random checkpoints saved by transformers' own classes (``HYBRID_ARCHS`` in helpers.py): three
Gated DeltaNet layers (2 key heads serving 4 value heads) and one gated full-attention layer with
partial RoPE; Qwen3-Next with routed experts, a gated shared expert and one dense MLP layer;
Qwen3.5-MoE with experts on every layer (always renormalised) and the gated shared expert. Each
request's recurrent and convolution states must be carried exactly through every scheduling
situation: chunk boundaries, mixed decode/prefill passes, retraction, and drafts (n-gram
speculation, jump-forward) whose rejected tokens must leave no trace in the state.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

import radixlm
from helpers import (
    HYBRID_ARCHS,
    Driver,
    assert_masked_greedy,
    assert_same_logits,
    decode_with_stack,
    failing_every,
    hf_greedy_divergence,
    load_hf_model,
    make_tiny_model,
    run_scenario,
)
from radixlm import ServerArgs
from radixlm.radix_cache.state_pool import StatePool
from radixlm.runtime.engine import build_parts
from radixlm.runtime.layers.gated_delta import (
    GatedDeltaNet,
    delta_rule_chunked,
    delta_rule_recurrent,
    l2norm,
)
from radixlm.runtime.sampling_params import SamplingParams

SCENARIOS = {
    # name: (engine options, how requests arrive)
    "alone": ({}, "one_by_one"),
    "mixed_batch": ({}, "staggered"),
    "all_at_once": ({}, "all_at_once"),
    "chunked_prefill_16": ({"chunked_prefill_size": 16}, "staggered"),
    "chunked_prefill_5": ({"chunked_prefill_size": 5}, "all_at_once"),  # chunks that align with nothing
    "radix_cache_hit": ({}, "twice"),  # the second round resumes from the first's snapshots
    "page_size_16": ({"page_size": 16}, "twice"),
    "retraction": ({"max_total_tokens": 72, "max_running_requests": 12}, "all_at_once"),  # the first 4 prompts need 149
    "ngram_speculation": ({"speculative_algorithm": "ngram"}, "all_at_once"),
}


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A folder per hybrid family: a tiny random checkpoint saved by transformers."""
    root = tmp_path_factory.mktemp("hybrid")
    return {arch: make_tiny_model(arch, root / arch) for arch in HYBRID_ARCHS}


@pytest.fixture(scope="module")
def references(hybrid_dirs):
    """Each family's transformers model, loaded once."""
    models: dict[str, torch.nn.Module] = {}

    def model(arch: str) -> torch.nn.Module:
        if arch not in models:
            models[arch] = load_hf_model(hybrid_dirs[arch])
        return models[arch]

    return model


def _prompts() -> list[list[int]]:
    """Short and long prompts (past one 64-token block of the chunked form), some repeating a
    phrase so n-gram speculation finds drafts in them."""
    rng = random.Random(5)
    phrase = [rng.randrange(3, 390) for _ in range(6)]
    lengths = [3, 9, 17, 40, 70, 130]
    prompts = [[rng.randrange(3, 390) for _ in range(n)] for n in lengths]
    prompts[2] = (phrase * 4)[:17]
    prompts[4] = prompts[4][:40] + phrase * 5
    return prompts


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_hybrid_greedy_matches_transformers(arch, scenario, hybrid_dirs, references):
    options, arrival = SCENARIOS[scenario]
    prompts = _prompts()
    if scenario == "retraction":
        prompts = prompts[:4]  # each fits the small pool alone, not all together
    outputs, rt = run_scenario(hybrid_dirs[arch], prompts, dict(options), arrival, max_new_tokens=20)
    assert [len(o) for o in outputs] == [20] * len(prompts)
    for i, (prompt, ours) in enumerate(zip(prompts, outputs)):
        where = hf_greedy_divergence(references(arch), prompt, ours)
        assert where is None, f"{arch}: prompt {i} ({len(prompt)} tokens) diverged from transformers at token {where}"
    if scenario == "retraction":
        assert rt.scheduler.total_retracted > 0, "the pool was large enough that nothing was retracted"
    if scenario == "ngram_speculation":
        stats = rt.scheduler.speculator.stats()
        assert stats["spec_draft_tokens"] > 0
        assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], "no draft was rejected: the state roll-back went untested"


def test_hybrid_greedy_with_a_separate_draft_model_matches_transformers(hybrid_dirs, references, tmp_path):
    """An attention-only draft model proposes for a hybrid target: the target verifies its drafts
    and keeps the state of the accepted prefix only, so the output is the target's own."""
    draft = make_tiny_model("llama", tmp_path / "draft", seed=1, num_hidden_layers=1)
    prompts = _prompts()
    options = {"speculative_algorithm": "draft", "speculative_draft_model_path": draft, "chunked_prefill_size": 16}
    outputs, rt = run_scenario(hybrid_dirs["qwen3_5"], prompts, options, "staggered", max_new_tokens=20)
    for i, (prompt, ours) in enumerate(zip(prompts, outputs)):
        where = hf_greedy_divergence(references("qwen3_5"), prompt, ours)
        assert where is None, f"prompt {i} ({len(prompt)} tokens) diverged from transformers at token {where}"
    stats = rt.scheduler.speculator.stats()
    assert stats["spec_draft_tokens"] > 0, "the draft model proposed nothing"
    assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], "no draft was rejected: the state roll-back went untested"
    rt.scheduler.check_accounting()


def test_a_failing_draft_pass_on_a_hybrid_target_falls_back_to_plain_decoding(hybrid_dirs, references, tmp_path):
    """A draft pass that raises leaves the target's states untouched: its rows decode plainly
    that step, every request still ends with the target's own tokens, the accounting clean."""
    draft = make_tiny_model("llama", tmp_path / "draft", seed=1, num_hidden_layers=1)
    rt = build_parts(ServerArgs(model_path=hybrid_dirs["qwen3_5"], max_total_tokens=4096, speculative_algorithm="draft", speculative_draft_model_path=draft))
    proposer = rt.scheduler.speculator.model
    proposer._forward, calls = failing_every(proposer._forward, 2, 1, "draft pass failed")
    d = Driver(rt)
    prompts = _prompts()[:4]
    rids = []
    for prompt in prompts:  # one after another: a lone request speculates
        rids.append(d.add(prompt, max_new_tokens=20, temperature=0.0, ignore_eos=True))
        d.run()
    assert calls["n"] >= 2, "the draft model was never asked"
    for prompt, rid in zip(prompts, rids):
        assert hf_greedy_divergence(references("qwen3_5"), prompt, d.results[rid].output_ids) is None


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}}, "required": ["name", "n"]}


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_hybrid_json_schema_with_jump_forward_is_transformers_masked_greedy(arch, hybrid_dirs, references):
    """Under a JSON schema with jump-forward on (forced text verified as drafts), every token is
    transformers' argmax among the tokens the grammar allows."""
    prompts = _prompts()[1:4]
    schema = json.dumps(SCHEMA)
    constraint = SamplingParams.from_dict({"json_schema": schema}).constraint
    outputs, rt = run_scenario(hybrid_dirs[arch], prompts, {}, "all_at_once", expect_hits=False, json_schema=schema, max_new_tokens=48)
    for prompt, ours in zip(prompts, outputs):
        assert_masked_greedy(references(arch), rt, constraint, prompt, ours, arch)


def test_a_failing_pass_reruns_its_rows_from_the_committed_states(hybrid_dirs, references, monkeypatch):
    """A pass that raises in a late layer (the early layers already staged new states) is split and
    re-run: the failing request alone fails, and its batch-mates still match transformers."""
    prompts = _prompts()[:4]
    victim = 7777 % 300
    rt = build_parts(ServerArgs(model_path=hybrid_dirs["qwen3_5"], max_total_tokens=4096))
    layer = rt.runner.model.layers[2].linear_attn
    real = GatedDeltaNet.forward

    def failing(self, x, batch):
        if self is layer and bool((batch.input_ids == victim).any()):
            raise RuntimeError("injected failure in layer 2")
        return real(self, x, batch)

    monkeypatch.setattr(GatedDeltaNet, "forward", failing)
    d = Driver(rt)
    rids = [d.add(p, max_new_tokens=12, temperature=0.0, ignore_eos=True) for p in prompts]
    bad = d.add([5, 6, victim, 8], max_new_tokens=12, temperature=0.0, ignore_eos=True)
    d.run()
    rt.scheduler.check_accounting()
    assert d.results[bad].meta_info["finish_reason"]["type"] == "abort"
    assert "injected failure" in d.results[bad].meta_info["finish_reason"]["message"]
    for prompt, rid in zip(prompts, rids):
        assert hf_greedy_divergence(references("qwen3_5"), prompt, d.results[rid].output_ids) is None


def _generate(d: Driver, prompt: list[int], **params) -> object:
    rid = d.add(prompt, max_new_tokens=params.pop("max_new_tokens", 10), temperature=0.0, ignore_eos=True, return_cache_info=True, **params)
    d.run()
    return d.results[rid]


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefixes_resume_from_snapshots_and_stop_where_none_is(page_size, hybrid_dirs, references):
    """A shared system prompt: the first request snapshots its own prompt, the second finds the
    shared KV but no snapshot at the branch point (it recomputes, and leaves one there), the third
    resumes at the branch point; a follow-up turn resumes at the end of the turn before it. Every
    output is transformers' greedy continuation."""
    rng = random.Random(9)
    system = [rng.randrange(3, 390) for _ in range(37)]
    questions = [[rng.randrange(3, 390) for _ in range(n)] for n in (11, 6, 9)]
    rt = build_parts(ServerArgs(model_path=hybrid_dirs["qwen3_5"], max_total_tokens=4096, page_size=page_size))
    d = Driver(rt)
    hf = references("qwen3_5")
    results = []
    for q in questions:
        results.append(_generate(d, system + q))
        assert hf_greedy_divergence(hf, system + q, results[-1].output_ids) is None
        rt.scheduler.check_accounting()
    branch = len(system) // page_size * page_size  # the questions share no first token
    first, second, third = (r.meta_info for r in results)
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] == 0 and second["cache_info"]["miss"] == {"stopped_at": 0, "reason": "no_snapshot", "cached_kv_tokens": branch}
    assert third["cached_tokens"] == branch
    turn = system + questions[2] + results[2].output_ids + [7, 8, 9]
    follow = _generate(d, turn)
    assert follow.meta_info["cached_tokens"] == (len(turn) - 4) // page_size * page_size  # up to the last turn's KV (its last token's was never computed)
    assert hf_greedy_divergence(hf, turn, follow.output_ids) is None
    rt.scheduler.check_accounting()


def test_snapshots_are_dropped_with_their_nodes_and_for_room(hybrid_dirs):
    """The store keeps at most its capacity (least recently used snapshots give way), and a node
    evicted from the tree frees its snapshot; the accounting stays whole through both."""
    rt = build_parts(ServerArgs(model_path=hybrid_dirs["qwen3_5"], max_total_tokens=512, max_running_requests=4))
    snapshots = rt.kv.tree.snapshots
    d = Driver(rt)
    rng = random.Random(3)
    for _ in range(3 * snapshots.capacity):
        _generate(d, [rng.randrange(3, 390) for _ in range(rng.randrange(20, 60))], max_new_tokens=4)
        rt.scheduler.check_accounting()
    assert len(snapshots) <= snapshots.capacity and snapshots.dropped > 0
    rt.kv.tree.evict(rt.kv.tree.evictable_size())
    assert len(snapshots) == 0
    rt.scheduler.check_accounting()


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_hybrid_greedy_at_tp_2_matches_transformers(arch, hybrid_dirs, references):
    """Heads split over two processes, each rank's states following rank 0's commits, snapshots and
    restores: a batch with chunked prefill and n-gram drafts (some rejected), then the same prompts
    resumed from the snapshots, then a JSON schema with jump-forward; all transformers' tokens."""
    prompts = _prompts()
    params = {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True}
    opts = {"tp_size": 2, "max_total_tokens": 4096, "chunked_prefill_size": 16, "speculative_algorithm": "ngram"}
    schema = json.dumps(SCHEMA)
    with radixlm.Engine(model_path=hybrid_dirs[arch], **opts) as engine:
        assert engine.runner.tp_size == 2 and engine.runner.state_pool.state.shape[2] == 2  # 2 of the 4 value heads on rank 0
        first = engine.generate(input_ids=prompts, sampling_params=params)
        again = engine.generate(input_ids=prompts, sampling_params=params)
        constrained = engine.generate(input_ids=prompts[1:3], sampling_params={**params, "json_schema": schema, "max_new_tokens": 48, "close_json_within_budget": False})
        engine.check_accounting()
        drafts = engine.scheduler.speculator.stats()
        hf = references(arch)
        for i, (prompt, out) in enumerate(zip(prompts, first)):
            where = hf_greedy_divergence(hf, prompt, out["output_ids"])
            assert where is None, f"{arch}: prompt {i} ({len(prompt)} tokens) diverged from transformers at token {where}"
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in first]
        assert sum(o["meta_info"]["cached_tokens"] for o in again) > 0
        assert drafts["spec_accepted_tokens"] < drafts["spec_draft_tokens"], "no draft was rejected: the state roll-back went untested"
        constraint = SamplingParams.from_dict({"json_schema": schema}).constraint
        for prompt, out in zip(prompts[1:3], constrained):
            assert_masked_greedy(hf, engine, constraint, prompt, out["output_ids"], arch)


def test_a_worker_whose_states_diverge_stops_the_engine_with_a_clear_error(hybrid_dirs):
    """A worker that cannot repeat one of rank 0's state decisions (here: told a snapshot holds a
    length its row never reached) fails the group; every waiter gets the error."""
    with radixlm.Engine(model_path=hybrid_dirs["qwen3_5"], tp_size=2, max_total_tokens=1024) as engine:
        engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params={"max_new_tokens": 2, "temperature": 0.0})
        engine.runner.state_journal.take(0, 0, 999)  # a take no worker's pool can serve
        reason = engine.generate(input_ids=[[9, 10, 11]], sampling_params={"max_new_tokens": 2, "temperature": 0.0})[0]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status"] == 503
        assert "tensor-parallel worker 1 failed" in reason["message"] and "row 0 holds no states after 999 tokens" in reason["message"]
        assert not engine.is_alive()


def test_a_pd_pair_hands_the_states_over_with_the_kv(hybrid_dirs, references, monkeypatch):
    """Prefill/decode disaggregation: the prefill side sends the states after all but the last
    prompt token with the KV, and the decode side's tokens are transformers'; a prompt the decode
    side holds up to its last token resumes from its own snapshot and nothing travels. A prefill
    side that lost the states fails that request on both sides, and both go on."""
    from test_disaggregation import assert_clean, paired, run_pair

    rng = random.Random(11)
    repeated = [rng.randrange(3, 390) for _ in range(45)]  # 44 positions travel: whole pages of 4
    prompts = [repeated, repeated, [rng.randrange(3, 390) for _ in range(70)]]
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    hf = references("qwen3_5")
    with paired(hybrid_dirs["qwen3_5"], page_size=4, max_total_tokens=2048) as (prefill, decode):
        sent = []
        for i, ids in enumerate(prompts):
            _, out = run_pair(prefill, decode, ids, room=40 + i, params=params)
            assert hf_greedy_divergence(hf, ids, out["output_ids"]) is None, f"prompt {i}: {out['meta_info']['finish_reason']}"
            sent.append((out["meta_info"]["cached_tokens"], out["meta_info"]["pd"]["received_tokens"], out["meta_info"]["pd"]["received_bytes"]))
        token_bytes, state_bytes = decode.runner.kv_pool.token_bytes(), decode.runner.state_pool.row_nbytes
        assert sent == [(0, 44, 44 * token_bytes + state_bytes), (44, 0, 0), (0, 69, 69 * token_bytes + state_bytes)]
        assert_clean(prefill, decode)
        monkeypatch.setattr(StatePool, "pack", lambda *a: None)
        lost, out = run_pair(prefill, decode, prompts[2][:30], room=50, params=params)
        for side in (lost, out):
            reason = side["meta_info"]["finish_reason"]
            assert reason["type"] == "abort" and "did not keep the linear-attention states" in reason["message"], reason
        assert_clean(prefill, decode)


def test_a_pd_pair_whose_states_differ_is_refused_with_the_field_named(hybrid_dirs):
    from test_disaggregation import GREEDY, paired

    with paired(hybrid_dirs["qwen3_5"], timeout=2, decode_extra={"dtype": "bfloat16"}) as (_, decode):
        reason = decode.generate(input_ids=list(range(10, 30)), sampling_params=GREEDY, bootstrap_room=5)["meta_info"]["finish_reason"]
        assert reason["status"] == 503 and "KV layouts differ" in reason["message"] and "state_format" in reason["message"], reason


def test_hybrid_models_refuse_what_their_states_cannot_do_yet(hybrid_dirs):
    path = hybrid_dirs["qwen3_5"]
    with pytest.raises(ValueError, match="tp_size 3 .* larger than the 2 linear-attention key heads"):
        radixlm.Engine(model_path=path, max_total_tokens=256, tp_size=3)
    with pytest.raises(ValueError, match="kv_host_cache_gb"):
        build_parts(ServerArgs(model_path=path, max_total_tokens=256, kv_host_cache_gb=0.01))
    with pytest.raises(ValueError, match="speculative_algorithm='draft' without speculative_draft_model_path"):
        build_parts(ServerArgs(model_path=path, max_total_tokens=256, speculative_algorithm="draft"))


def test_hybrid_kv_pool_holds_only_the_attention_layers(hybrid_dirs):
    rt = build_parts(ServerArgs(model_path=hybrid_dirs["qwen3_next"], max_total_tokens=256))
    cfg = rt.runner.config
    assert (cfg.num_layers, cfg.kv_layers, cfg.linear_layers) == (4, 1, 3)
    assert rt.runner.kv_pool.num_layers == 1
    pool = rt.runner.state_pool
    assert pool.state.shape == (3, rt.kv.table.max_requests + 4, 4, 16, 8)  # layers, rows and 4 spare slots, value heads, key dim, value dim
    assert pool.conv.shape == (3, rt.kv.table.max_requests, 2 * 2 * 16 + 4 * 8, 3)


# ------------------------------------------------------------------ the layer's pieces


def _random_rule_inputs(n: int, heads: int = 3, dk: int = 8, dv: int = 5, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(n, heads, dk, generator=gen)) * dk**-0.5
    k = l2norm(torch.randn(n, heads, dk, generator=gen))
    v = torch.randn(n, heads, dv, generator=gen)
    g = -torch.rand(n, heads, generator=gen) * 2
    beta = torch.rand(n, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("n", [1, 5, 64, 100, 129])
def test_chunked_delta_rule_equals_the_token_by_token_recurrence(n):
    q, k, v, g, beta, state = _random_rule_inputs(n)
    out, final = delta_rule_chunked(q, k, v, g, beta, state)
    want, states = delta_rule_recurrent(q[None], k[None], v[None], g[None], beta[None], state[None])
    torch.testing.assert_close(out, want[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(final, states[0, -1], atol=2e-5, rtol=2e-5)


def test_chunked_delta_rule_equals_transformers_reference():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, g, beta, state = _random_rule_inputs(90, seed=3)
    # transformers scales q itself: give it unscaled queries
    want, want_state = torch_chunk_gated_delta_rule(
        q[None] * 8**0.5, k[None], v[None], g[None], beta[None], initial_state=state[None], output_final_state=True
    )
    out, final = delta_rule_chunked(q, k, v, g, beta, state)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_state[0], atol=1e-5, rtol=1e-5)


class _Batch:
    """The few ForwardBatch fields a StatePool reads."""

    def __init__(self, rows: list[int], prefix: list[int], extend: list[int], keeps: list[int]) -> None:
        self.pool_rows = torch.tensor(rows)
        self.prefix_lens, self.extend_lens, self._keeps = prefix, extend, keeps
        self.seq_lens = [p + e for p, e in zip(prefix, extend)]
        self.batch_size = len(rows)

    def state_keep(self, i: int) -> int:
        return self._keeps[i]


def test_state_pool_commits_the_state_at_the_kept_length_and_nothing_from_an_uncommitted_pass():
    pool = StatePool(rows=4, layers=2, conv_shape=(3, 2), state_shape=(2, 2, 2), conv_dtype=torch.float32)
    batch = _Batch(rows=[2, 0], prefix=[10, 0], extend=[4, 6], keeps=[4, 1])
    pool.begin(batch)
    for layer in range(2):
        pool.stage(layer, 0, torch.arange(4.0).reshape(4, 1, 1).expand(4, 3, 2) + layer, torch.arange(4.0).reshape(4, 1, 1, 1).expand(4, 2, 2, 2))
        pool.stage(layer, 1, torch.full((1, 3, 2), 9.0), torch.full((1, 2, 2, 2), 9.0))
    pool.commit([12, 6])  # row 2 kept 12 of 14 positions: the state after its second new token
    assert torch.all(pool.committed(2)[1] == 1) and torch.all(pool.conv[0, 2] == 1) and torch.all(pool.conv[1, 2] == 2)
    assert torch.all(pool.committed(0)[1] == 9)
    with pytest.raises(ValueError, match="kept"):
        pool.begin(batch)
        for layer in range(2):
            pool.stage(layer, 0, torch.zeros(4, 3, 2), torch.zeros(4, 2, 2, 2))
            pool.stage(layer, 1, torch.zeros(1, 3, 2), torch.zeros(1, 2, 2, 2))
        pool.commit([10, 6])  # before the row's first new token: no state was staged there
    pool.begin(batch)  # a pass that raised and never committed leaves the committed states alone
    conv, state = pool.read(0)
    assert torch.all(state[0] == 1) and torch.all(state[1] == 0)  # row 0 of the batch starts its sequence: zeros


def test_a_row_restored_from_a_snapshot_forgets_its_previous_requests_page_boundary():
    """With pages of 4, a row's states at its last page boundary serve its request's snapshot at
    release; a new request restored into that row must not be handed the old request's."""
    from radixlm.radix_cache.state_snapshots import StateSnapshots
    from radixlm.radix_cache.tree import TreeNode

    pool = StatePool(rows=2, layers=1, conv_shape=(2, 1), state_shape=(1, 1, 1), conv_dtype=torch.float32, page_size=4)
    batch = _Batch(rows=[1], prefix=[6], extend=[3], keeps=[3])  # positions 6, 7, 8: the state after 8 is on a boundary
    pool.begin(batch)
    pool.stage(0, 0, torch.arange(3.0).reshape(3, 1, 1).expand(3, 2, 1), torch.arange(3.0).reshape(3, 1, 1, 1))
    pool.commit([9])
    assert pool.state_at(1, 8) is not None and float(pool.state_at(1, 8)[1].sum()) == 1.0
    snapshots = StateSnapshots(pool, capacity=1)
    node = TreeNode()
    snapshots.take(node, torch.full((1, 2, 1), 5.0), torch.full((1, 1, 1, 1), 5.0))
    snapshots.restore(node, 1, 4)  # another request, resumed after 4 tokens of its own
    assert pool.state_at(1, 8) is None and float(pool.state_at(1, 4)[1].sum()) == 5.0


@pytest.mark.parametrize(
    "option",
    [{"quantization": "int8"}, {"quantization": "int4"}, {"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "bfloat16"}, {"dtype": "bfloat16"}],
)
def test_hybrid_models_run_with_quantized_weights_kv_and_bf16(option, hybrid_dirs):
    """Weight quantization reaches the DeltaNet projections (the conv and decays stay as stored),
    the KV dtypes apply to the attention layers, and bf16 activations keep the states in fp32."""
    prompts = _prompts()[:4]
    with radixlm.Engine(model_path=hybrid_dirs["qwen3_next"], max_total_tokens=1024, **option) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True})
        again = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True})
        engine.check_accounting()
    assert [len(o["output_ids"]) for o in outs] == [12] * len(prompts)
    if "dtype" not in option:  # (bf16 activations: a resumed row rounds differently from a whole prompt's pass)
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]  # resumed from snapshots, same tokens
    assert sum(o["meta_info"]["cached_tokens"] for o in again) > 0


def test_parallel_samples_of_one_prompt_share_its_snapshot(hybrid_dirs, references):
    """``n`` > 1 greedy samples of one prompt: every sample is transformers' continuation, and the
    samples after the first resume from the prompt's snapshot."""
    prompt = _prompts()[3]
    with radixlm.Engine(model_path=hybrid_dirs["qwen3_5"], max_total_tokens=1024) as engine:
        outs = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True, "n": 3})
        engine.check_accounting()
    assert len(outs) == 3
    for out in outs:
        assert hf_greedy_divergence(references("qwen3_5"), prompt, out["output_ids"]) is None
    assert sorted(o["meta_info"]["cached_tokens"] for o in outs) == [0, len(prompt) - 1, len(prompt) - 1]


def test_a_failing_state_commit_fails_its_pass_requests_and_the_engine_goes_on(hybrid_dirs, references, monkeypatch):
    """Where committing a pass's states raises, that pass's running requests fail with the error;
    the engine keeps serving, and what it serves next is still exact."""
    rt = build_parts(ServerArgs(model_path=hybrid_dirs["qwen3_5"], max_total_tokens=1024))
    d = Driver(rt)
    real = StatePool.commit
    calls = {"n": 0}

    def failing(self, kept):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected commit failure")
        return real(self, kept)

    monkeypatch.setattr(StatePool, "commit", failing)
    first = d.add(_prompts()[2], max_new_tokens=8, temperature=0.0, ignore_eos=True)
    d.run()
    rt.scheduler.check_accounting()
    reason = d.results[first].meta_info["finish_reason"]
    assert reason["type"] == "abort" and "injected commit failure" in reason["message"]
    later = _generate(d, _prompts()[3])
    assert hf_greedy_divergence(references("qwen3_5"), _prompts()[3], later.output_ids) is None
    rt.scheduler.check_accounting()


def test_the_text_model_of_a_vision_language_qwen3_5_checkpoint_runs(tmp_path):
    """A ``Qwen3_5ForConditionalGeneration`` checkpoint (text under ``model.language_model``, its
    config under ``text_config``, a vision tower beside it) serves its text model."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from helpers import make_tokenizer

    text = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, num_position_embeddings=16, patch_size=2, spatial_merge_size=2, temporal_patch_size=1)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() >= 2 else 0.3)
    make_tokenizer(tmp_path)
    model.save_pretrained(tmp_path)
    prompt = _prompts()[3]
    outputs, _ = run_scenario(str(tmp_path), [prompt], {}, "one_by_one", max_new_tokens=10)
    assert hf_greedy_divergence(model, prompt, outputs[0]) is None


def test_snapshots_that_fail_cost_only_the_reuse_and_a_failed_restore_only_its_request(hybrid_dirs, references, monkeypatch):
    """Taking a snapshot that raises is logged and skipped (requests finish exactly, nothing leaks);
    a restore that raises fails only the request being admitted, with the row given back."""
    from radixlm.radix_cache.state_snapshots import StateSnapshots

    rt = build_parts(ServerArgs(model_path=hybrid_dirs["qwen3_5"], max_total_tokens=1024))
    d = Driver(rt)
    hf = references("qwen3_5")
    prompt = _prompts()[3]

    def broken(*args, **kwargs):
        raise RuntimeError("injected snapshot failure")

    with monkeypatch.context() as patch:
        patch.setattr(StateSnapshots, "take", broken)
        first = _generate(d, prompt)
        assert hf_greedy_divergence(hf, prompt, first.output_ids) is None
        rt.scheduler.check_accounting()
        assert len(rt.kv.tree.snapshots) == 0
    _generate(d, prompt)  # leaves snapshots this time
    assert len(rt.kv.tree.snapshots) > 0
    free_rows = rt.kv.table.available()
    with monkeypatch.context() as patch:
        patch.setattr(StateSnapshots, "restore", broken)
        failed = _generate(d, prompt)
    assert failed.meta_info["finish_reason"]["type"] == "abort" and "injected snapshot failure" in failed.meta_info["finish_reason"]["message"]
    assert rt.kv.table.available() == free_rows
    rt.scheduler.check_accounting()
    again = _generate(d, prompt)
    assert again.meta_info["cached_tokens"] > 0 and hf_greedy_divergence(hf, prompt, again.output_ids) is None



@pytest.mark.parametrize("rows", [2, 6])  # within the state pool's spare slots, and past them (the scratch states)
def test_the_decode_stack_runs_hybrid_layers_as_the_python_path_does(cpp_ext, hybrid_dirs, references, rows):
    """Qwen3.5's Gated DeltaNet layers and gated, partially rotated attention in the fused C++
    decode stack: the logits of every forward equal the Python layers' bit for bit, and the
    states it stages carry each request to transformers' tokens."""
    prompts = _prompts()[:rows]
    d, rids, fused, ran = decode_with_stack(hybrid_dirs["qwen3_5"], prompts, True)
    _, _, plain, ran_plain = decode_with_stack(hybrid_dirs["qwen3_5"], prompts, False)
    assert ran >= 9 and ran_plain == 0
    assert_same_logits(fused, plain)
    for prompt, rid in zip(prompts, rids):
        assert hf_greedy_divergence(references("qwen3_5"), prompt, d.results[rid].output_ids) is None


def test_a_hybrid_decode_stack_that_raises_fails_only_its_request(cpp_ext, hybrid_dirs, references):
    """A stack call that raises after its layers staged new states: the pass is split and re-run
    from the committed states, the request it computes fails alone, and the others still get
    transformers' tokens."""
    prompts = _prompts()[:3]
    d, rids, _, ran = decode_with_stack(hybrid_dirs["qwen3_5"], prompts, True, fail_row_of="r1")
    assert ran > 0
    assert d.results["r1"].meta_info["finish_reason"]["type"] == "abort"
    assert "stack fault" in d.results["r1"].meta_info["finish_reason"]["message"]
    for prompt, rid in zip(prompts, rids):
        if rid != "r1":
            assert hf_greedy_divergence(references("qwen3_5"), prompt, d.results[rid].output_ids) is None
