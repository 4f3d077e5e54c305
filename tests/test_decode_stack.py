"""The C++ decoder stack (one call for every layer of a decode step) against the Python layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import TINY_ARCHS, good_and_bad_requests, run_and_check_only_bad_failed
from radixlm.runtime.engine import build_parts
from radixlm.runtime.layers.decode_stack import DecodeStacks, stack_weight
from radixlm.runtime.layers.quantized_linear import Int4Linear, Int8Linear
from radixlm.runtime.request import Req
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.speculative.pass_cost import PassCost

PROMPTS = ([5, 9, 14, 3, 22, 40, 7], [31, 8, 8, 60, 2])  # no shared first slot: no cascade prefix


def _decode_logits(model_path: str, stack: bool, prompts=PROMPTS, steps: int = 6, seen: list | None = None, **args) -> tuple[list[torch.Tensor], int]:
    """Every forward's logits while ``prompts`` decode ``steps`` greedy tokens, and how many
    forwards the stack ran (``seen`` gets (shared prefixes, stack ran, query tokens) per forward)."""
    rt = build_parts(ServerArgs(model_path=model_path, max_total_tokens=512, disable_decode_stack=not stack, **args))
    stacks = rt.runner.model.decode_stacks
    ran = [0]
    original = stacks.run

    def run(x, rope, batch):
        out = original(x, rope, batch)
        ran[0] += out is not None
        if seen is not None and batch.attn_meta.decode is not None:
            seen.append((len(batch.attn_meta.decode.groups), out is not None, x.shape[0]))
        return out

    stacks.run = run
    logits = []
    forward = rt.runner.forward
    rt.runner.forward = lambda batch: logits.append(forward(batch)) or logits[-1]
    for i, ids in enumerate(prompts):
        rt.scheduler.add(Req(rid=str(i), input_ids=list(ids), params=SamplingParams(max_new_tokens=steps, temperature=0, ignore_eos=True), sink=lambda out: None))
    while rt.scheduler.waiting or rt.scheduler.running:
        rt.scheduler.step()
    return logits, ran[0]


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_the_stack_gives_the_python_layers_logits_bit_for_bit(cpp_ext, tiny_model_dirs, arch, quantization):
    fused, ran = _decode_logits(tiny_model_dirs[arch], True, quantization=quantization)
    plain, ran_plain = _decode_logits(tiny_model_dirs[arch], False, quantization=quantization)
    assert ran >= 5 and ran_plain == 0  # the decode steps went through the stack; --disable-decode-stack kept them off it
    assert len(fused) == len(plain)
    for step, (a, b) in enumerate(zip(fused, plain)):
        assert torch.equal(a, b), f"forward {step}: the stack's logits differ by up to {(a - b).abs().max():.3g}"


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8", "fp8_e4m3"])
def test_the_stack_writes_and_reads_every_kv_format_as_the_pool_does(cpp_ext, tiny_llama, kv_dtype):
    fused, ran = _decode_logits(tiny_llama, True, quantization="int4", kv_cache_dtype=kv_dtype)
    plain, _ = _decode_logits(tiny_llama, False, quantization="int4", kv_cache_dtype=kv_dtype)
    assert ran >= 5
    for step, (a, b) in enumerate(zip(fused, plain)):
        assert torch.equal(a, b), f"forward {step} ({kv_dtype} KV): differs by up to {(a - b).abs().max():.3g}"


SHARED = list(range(3, 60))  # one prefix for both rows, longer than MIN_SHARED_PREFIX


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_rows_over_a_shared_prefix_attend_it_once_as_the_cascade_path_does(cpp_ext, tiny_llama, quantization):
    prompts = (SHARED + [70, 71], SHARED + [80], [90, 91, 92])  # two share a prefix, one does not
    seen = []
    fused, _ = _decode_logits(tiny_llama, True, prompts=prompts, seen=seen, quantization=quantization)
    plain, _ = _decode_logits(tiny_llama, False, prompts=prompts, quantization=quantization)
    assert any(g == 1 and ran for g, ran, _ in seen)  # the stack ran batches with a shared prefix
    for step, (a, b) in enumerate(zip(fused, plain)):
        assert torch.equal(a, b), f"forward {step}: differs by up to {(a - b).abs().max():.3g}"


def test_a_shared_prefix_in_a_pool_of_another_dtype_keeps_the_python_path(cpp_ext, tiny_llama):
    seen = []
    _decode_logits(tiny_llama, True, prompts=(SHARED + [70], SHARED + [80]), seen=seen, kv_cache_dtype="int8")
    assert any(g == 1 for g, _, _ in seen) and not any(g and ran for g, ran, _ in seen)


def test_speculative_verify_rows_give_the_python_layers_logits(cpp_ext, tiny_llama, monkeypatch):
    # the prompt repeats itself, so the n-gram proposer drafts and each verify pass is one query a draft token;
    # the gate prices a draft position from measured pass times, which differ between the two runs, so
    # the price is held at its prior: both runs then draft the same tokens at the same steps
    monkeypatch.setattr(PassCost, "position_cost", lambda self, batch, k=1: self.prior)
    prompt = [5, 9, 14, 3, 22, 40, 7] * 8
    args = dict(prompts=(prompt,), steps=24, speculative_algorithm="ngram")
    verify = []
    fused, ran = _decode_logits(tiny_llama, True, seen=verify, **args)
    plain, _ = _decode_logits(tiny_llama, False, **args)
    assert any(ran and queries > 1 for _, ran, queries in verify)  # a verify pass went through the stack
    assert len(fused) == len(plain)
    for step, (a, b) in enumerate(zip(fused, plain)):
        assert a.shape == b.shape and torch.equal(a, b), f"forward {step}: differs"


def test_a_layer_the_stack_cannot_compute_keeps_the_python_path(cpp_ext, tiny_llama):
    linear = nn.Linear(64, 96)
    assert stack_weight(linear, 1)[0] is linear.weight
    assert stack_weight(Int8Linear(linear), 1) is None  # int8 runs PyTorch's kernel
    with_dense = Int4Linear(linear, dense_from=4)
    assert stack_weight(with_dense, 3)[0] is with_dense.tiles
    assert stack_weight(with_dense, 4) is None  # from 4 rows on it multiplies its bf16 copy
    assert stack_weight(Int4Linear(linear, kernel="torch"), 1) is None

    rt = build_parts(ServerArgs(model_path=tiny_llama, max_total_tokens=512, quantization="int8"))
    model = rt.runner.model
    rt.scheduler.add(Req(rid="0", input_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True), sink=lambda out: None))
    while rt.scheduler.waiting or rt.scheduler.running:
        rt.scheduler.step()
    assert model.decode_stacks._stacks == {1: None}  # looked at once, declined for good


def test_quantizing_a_model_drops_the_stacks_built_from_its_old_layers(cpp_ext, tiny_llama):
    from radixlm.runtime.layers.quant import quantize_model

    rt = build_parts(ServerArgs(model_path=tiny_llama, max_total_tokens=512))
    model = rt.runner.model
    stacks: DecodeStacks = model.decode_stacks
    stacks._stacks[1] = object()
    quantize_model(model, "int4")
    assert stacks._stacks == {}


def test_disabling_the_stack_reaches_a_self_draft_model_too(cpp_ext, tiny_llama):
    from radixlm.runtime.speculative.draft_model import DraftModelProposer

    for disabled in (False, True):
        rt = build_parts(ServerArgs(model_path=tiny_llama, max_total_tokens=512, disable_decode_stack=disabled))
        proposer = DraftModelProposer(rt.args, rt.runner, rt.tokenizer, rt.kv)
        assert rt.runner.model.decode_stacks.enabled is proposer.model.decode_stacks.enabled is (not disabled)


def test_a_stack_that_raises_fails_only_the_request_it_computes(cpp_ext, tiny_llama):
    # the engine splits a failing pass and re-runs the halves: the request whose row makes the
    # stack raise fails alone (a 500 abort), the other finishes, and no KV slot leaks
    rt = build_parts(ServerArgs(model_path=tiny_llama, max_total_tokens=512))
    stacks = rt.runner.model.decode_stacks
    original, calls = stacks.run, []
    reqs, outs = good_and_bad_requests(PROMPTS[0], PROMPTS[1])
    bad = reqs[1]

    def run(x, rope, batch):
        out = original(x, rope, batch)
        if out is not None and bad.kv is not None and bad.kv.row in batch.req_rows.tolist():
            calls.append(x.shape[0])
            raise RuntimeError("stack fault")
        return out

    stacks.run = run
    run_and_check_only_bad_failed(rt.scheduler, reqs, outs)
    assert calls and max(calls) == 2 and min(calls) == 1  # raised in the shared pass, then alone
