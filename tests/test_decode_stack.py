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


# ---------------------------------------------------------------- layers beyond Llama's
# A tiny hand-built decoder of layers with each new feature: the stack against the Python path
# (the torch backend with the layer's AttentionSpec, RMSNorm, apply_rotary, the activations).

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, POOL_SLOTS = 32, 4, 2, 16, 48, 400
SINK_LOGITS = [0.5, -1.0, 2.0, 3.5]
FEATURES = {  # name -> each layer's options (three layers)
    "llama": [{}, {}, {}],
    "q_k_norms": [dict(q_norm=1e-6, k_norm=1e-5)] * 3,
    "nope": [{}, dict(rope_table=None), {}],
    "two_rope_tables": [dict(rope_table=1), {}, dict(rope_table=1)],
    "sandwich_norms": [dict(attn_out_norm=1e-6, mlp_out_norm=1e-6)] * 3,
    "gelu_tanh": [dict(activation="gelu_tanh")] * 3,
    "scale": [dict(scale=0.1)] * 3,
    "window": [dict(window=6), {}, dict(window=9)],
    "softcap": [dict(softcap=3.0)] * 3,
    "sinks": [dict(sinks=SINK_LOGITS)] * 3,
    "norm_eps": [dict(input_eps=0.5), dict(post_eps=0.7), {}],
    "gemma2": [dict(window=6, softcap=3.0, scale=0.2, attn_out_norm=1e-6, mlp_out_norm=1e-6, activation="gelu_tanh"), dict(softcap=3.0, scale=0.2, attn_out_norm=1e-6, mlp_out_norm=1e-6, activation="gelu_tanh")] * 2,
    "gemma3": [dict(window=6, q_norm=1e-6, k_norm=1e-6, attn_out_norm=1e-6, mlp_out_norm=1e-6, activation="gelu_tanh"), dict(rope_table=1, q_norm=1e-6, k_norm=1e-6, attn_out_norm=1e-6, mlp_out_norm=1e-6, activation="gelu_tanh")] * 2,
    "gpt_oss": [dict(window=6, sinks=SINK_LOGITS, qkv_bias=True), dict(sinks=SINK_LOGITS, qkv_bias=True)] * 2,
    "smollm3": [{}, {}, dict(rope_table=None)],
    "output_gate": [dict(output_gate=True, q_norm=1e-6, k_norm=1e-6)] * 3,  # Qwen3-Next's gated attention
}


class _Layer(nn.Module):
    """One decoder layer with the given features, computed as the families compute them."""

    def __init__(self, layer_id: int, gen: torch.Generator, options: dict) -> None:
        super().__init__()
        from radixlm.runtime.layers.attention_spec import AttentionSpec
        from radixlm.runtime.layers.norm import RMSNorm

        def norm(dim: int, eps: float) -> RMSNorm:
            n = RMSNorm(dim, eps)
            n.weight.data = 1 + 0.3 * torch.randn(dim, generator=gen)
            return n

        def linear(n_in: int, n_out: int, bias: bool = False, gain: float = 1.0) -> nn.Linear:
            lin = nn.Linear(n_in, n_out, bias=bias)
            lin.weight.data = torch.randn(n_out, n_in, generator=gen) * gain / n_in**0.5
            if bias:
                lin.bias.data = torch.randn(n_out, generator=gen)
            return lin

        self.layer_id = layer_id
        self.input_norm = norm(HIDDEN, options.get("input_eps", 1e-5))
        self.gated = options.get("output_gate", False)  # each head's query rows, then its gate's
        q_rows = HEADS * HEAD_DIM * (2 if self.gated else 1)
        self.qkv = linear(HIDDEN, q_rows + 2 * KV_HEADS * HEAD_DIM, options.get("qkv_bias", False), gain=3.0)  # scores large enough to cap
        self.o = linear(HEADS * HEAD_DIM, HIDDEN)
        self.post_norm = norm(HIDDEN, options.get("post_eps", 1e-5))
        self.gate_up = linear(HIDDEN, 2 * INTER)
        self.down = linear(INTER, HIDDEN)
        self.q_norm = norm(HEAD_DIM, options["q_norm"]) if "q_norm" in options else None
        self.k_norm = norm(HEAD_DIM, options["k_norm"]) if "k_norm" in options else None
        self.attn_out_norm = norm(HIDDEN, options["attn_out_norm"]) if "attn_out_norm" in options else None
        self.mlp_out_norm = norm(HIDDEN, options["mlp_out_norm"]) if "mlp_out_norm" in options else None
        self.rope_table = options.get("rope_table", 0)
        self.activation = options.get("activation", "silu")
        sinks = torch.tensor(options["sinks"]) if "sinks" in options else None
        self.spec = AttentionSpec(options.get("scale", HEAD_DIM**-0.5), options.get("window"), options.get("softcap"), sinks)

    def forward(self, ropes, x, residual, batch):
        from radixlm.runtime.layers.activation import gelu_tanh_and_mul, silu_and_mul
        from radixlm.runtime.layers.rope import apply_rotary

        residual, h = (x, self.input_norm(x)) if residual is None else self.input_norm.add_forward(x, residual)
        q, k, v = self.qkv(h).split([HEADS * HEAD_DIM * (2 if self.gated else 1), KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        gate = None
        if self.gated:
            q, gate = q.reshape(-1, HEADS, 2 * HEAD_DIM).chunk(2, dim=-1)
            gate = gate.reshape(-1, HEADS * HEAD_DIM)
        q, k, v = q.reshape(-1, HEADS, HEAD_DIM), k.view(-1, KV_HEADS, HEAD_DIM), v.view(-1, KV_HEADS, HEAD_DIM)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, HEAD_DIM)).view(q.shape)
        if self.k_norm is not None:
            k = self.k_norm(k.reshape(-1, HEAD_DIM)).view(k.shape)
        if self.rope_table is not None:
            q, k = apply_rotary(q, k, ropes[self.rope_table])
        a = batch.attn_backend.forward(q, k, v, self.layer_id, batch, self.spec)
        a = self.o(a if gate is None else a * torch.sigmoid(gate))
        if self.attn_out_norm is not None:
            a = self.attn_out_norm(a)
        residual, h = self.post_norm.add_forward(a, residual)
        act = gelu_tanh_and_mul if self.activation == "gelu_tanh" else silu_and_mul
        m = self.down(act(self.gate_up(h)))
        return (m if self.mlp_out_norm is None else self.mlp_out_norm(m)), residual

    def stack_layer(self):
        from radixlm.runtime.layers.decode_stack import StackLayer

        return StackLayer(
            HEADS, KV_HEADS, HEAD_DIM, self.input_norm, self.qkv, self.o, self.post_norm, self.gate_up, self.down,
            attention=self.spec, q_norm=self.q_norm, k_norm=self.k_norm, rope_table=self.rope_table,
            attn_out_norm=self.attn_out_norm, mlp_out_norm=self.mlp_out_norm, activation=self.activation, output_gate=self.gated,
        )  # fmt: skip


def _tiny_layers(feature: str) -> nn.ModuleList:
    gen = torch.Generator().manual_seed(sum(map(ord, feature)))
    return nn.ModuleList(_Layer(i, gen, options) for i, options in enumerate(FEATURES[feature]))


# Two decode rows over one shared prefix (cascade attention), a row of its own, and a verify row
# (three draft queries over a cached prefix): rows longer and shorter than the windows.
STEP_ROWS = [list(range(10, 52)) + [60], list(range(10, 52)) + [70, 71], list(range(100, 104)), list(range(200, 223))]
STEP_PREFIX, STEP_EXTEND = [42, 43, 3, 20], [1, 1, 1, 3]
ALONE_ROWS = [list(range(10, 40)), list(range(100, 104)), list(range(200, 223))]  # no shared prefix
ALONE_PREFIX, ALONE_EXTEND = [29, 3, 20], [1, 1, 3]


def _step(layers, kv_format: str, rows, prefix, extend, rotary_dim: int = HEAD_DIM):
    """One decode step of ``layers`` on a pool of random cached KV: the stack's (x, residual, pool)
    (None where it declined) and the Python path's."""
    from radixlm.radix_cache.pool import KVPool
    from radixlm.runtime.layers.attention.torch_backend import TorchAttentionBackend
    from radixlm.runtime.layers.forward_batch import ForwardBatch
    from radixlm.runtime.layers.rope import RotaryEmbedding

    gen = torch.Generator().manual_seed(11)
    cached = torch.tensor(sorted({s for r, p in zip(rows, prefix) for s in r[:p]}))
    tensors = [(torch.randn(len(cached), KV_HEADS, HEAD_DIM, generator=gen), torch.randn(len(cached), KV_HEADS, HEAD_DIM, generator=gen)) for _ in layers]
    positions = torch.tensor([p + i for p, e in zip(prefix, extend) for i in range(e)])
    x = torch.randn(len(positions), HIDDEN, generator=gen)
    ropes = [RotaryEmbedding(HEAD_DIM, 256, theta, None).table(positions, torch.float32) for theta in (10000.0, 1000.0)]
    ropes = [(cos[..., : rotary_dim // 2], sin[..., : rotary_dim // 2]) for cos, sin in ropes]
    table = torch.zeros(len(rows), 64, dtype=torch.int64)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r)
    results = []
    for stacked in (True, False):
        pool = KVPool(POOL_SLOTS, len(layers), KV_HEADS, HEAD_DIM, torch.float32, kv_format=kv_format)
        for i, (k, v) in enumerate(tensors):
            pool.write(i, cached, k, v)
        backend = TorchAttentionBackend()
        batch = ForwardBatch(
            input_ids=torch.zeros(len(positions), dtype=torch.int64), positions=positions,
            out_slots=torch.tensor([s for r, p in zip(rows, prefix) for s in r[p:]]), req_rows=torch.arange(len(rows)),
            prefix_lens=list(prefix), extend_lens=list(extend), num_decode=sum(e == 1 for e in extend), logits_indices=torch.tensor([]),
            req_to_token=table, kv_pool=pool, attn_backend=backend,
        )  # fmt: skip
        backend.init_forward_metadata(batch)
        if stacked:
            assert batch.attn_meta.decode.groups or prefix == ALONE_PREFIX, "the step has a shared prefix"
            out = DecodeStacks(layers).run(x, ropes, batch)
            if out is None:
                results.append(None)
                continue
        else:
            out, residual = x, None
            for layer in layers:
                out, residual = layer(ropes, out, residual, batch)
            out = (out, residual)
        results.append((*out, pool))
    return results


def _assert_same(stack, python, what: str, rows=STEP_ROWS) -> None:
    assert stack is not None, f"{what}: the stack declined the batch"
    (x, residual, pool), (x_ref, residual_ref, pool_ref) = stack, python
    assert torch.equal(x, x_ref), f"{what}: x differs by up to {(x - x_ref).abs().max():.3g}"
    assert torch.equal(residual, residual_ref), f"{what}: the residual differs"
    slots = torch.tensor([s for r in rows for s in r])  # the rest of the pool is uninitialized
    for i in range(len(pool.k)):
        k, v = pool.read(i, slots, torch.float32)
        k_ref, v_ref = pool_ref.read(i, slots, torch.float32)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref), f"{what}: layer {i}'s KV differs"


@pytest.mark.parametrize("feature", list(FEATURES))
def test_the_stack_computes_each_layer_feature_as_the_python_path_does(cpp_ext, feature):
    stack, python = _step(_tiny_layers(feature), "auto", STEP_ROWS, STEP_PREFIX, STEP_EXTEND)
    _assert_same(stack, python, feature)


@pytest.mark.parametrize("feature", ["gemma2", "gemma3", "gpt_oss"])
@pytest.mark.parametrize("kv_format", ["bfloat16", "int8"])
def test_the_stack_computes_the_new_families_over_a_converted_pool(cpp_ext, feature, kv_format):
    stack, python = _step(_tiny_layers(feature), kv_format, ALONE_ROWS, ALONE_PREFIX, ALONE_EXTEND)
    _assert_same(stack, python, f"{feature}, {kv_format} KV", ALONE_ROWS)


@pytest.mark.parametrize("feature", [f for f in FEATURES if f not in ("llama", "gemma2", "gemma3", "gpt_oss", "smollm3", "output_gate")])
def test_each_layer_feature_changes_the_step(cpp_ext, feature):
    """The features are not no-ops in these tiny layers, so the tests above would see one dropped."""
    plain, _ = _step(_tiny_layers("llama"), "auto", STEP_ROWS, STEP_PREFIX, STEP_EXTEND)
    layers = _tiny_layers("llama")
    for layer, featured in zip(layers, _tiny_layers(feature)):
        for name in ("q_norm", "k_norm", "rope_table", "attn_out_norm", "mlp_out_norm", "activation", "spec", "input_norm", "post_norm"):
            setattr(layer, name, getattr(featured, name))
    with_feature, _ = _step(layers, "auto", STEP_ROWS, STEP_PREFIX, STEP_EXTEND)
    assert not torch.allclose(plain[0], with_feature[0], atol=1e-4)


def test_rope_over_part_of_the_head_rotates_as_the_python_path_does(cpp_ext):
    stack, python = _step(_tiny_layers("q_k_norms"), "auto", STEP_ROWS, STEP_PREFIX, STEP_EXTEND, rotary_dim=HEAD_DIM // 2)
    _assert_same(stack, python, "partial rotary")
    whole, _ = _step(_tiny_layers("q_k_norms"), "auto", STEP_ROWS, STEP_PREFIX, STEP_EXTEND)
    assert not torch.allclose(whole[0], stack[0], atol=1e-4)  # the rotary width reached the step


def test_one_rope_table_may_be_passed_alone(cpp_ext):
    from radixlm.runtime.layers.decode_stack import DecodeStacks as Stacks

    layers = _tiny_layers("llama")
    original = Stacks.run

    def run_with_one_table(self, x, ropes, batch):
        return original(self, x, ropes[0], batch)

    Stacks.run = run_with_one_table
    try:
        stack, python = _step(layers, "auto", STEP_ROWS, STEP_PREFIX, STEP_EXTEND)
    finally:
        Stacks.run = original
    _assert_same(stack, python, "one table")


@pytest.mark.parametrize(
    "change",
    ["norm_subclass", "norm_dtype", "head_shape", "activation", "sinks_size", "rope_index", "o_bias"],
)
def test_a_layer_the_stack_cannot_take_makes_the_whole_model_take_the_python_path(cpp_ext, change):
    from radixlm.runtime.layers.attention_spec import AttentionSpec
    from radixlm.runtime.layers.decode_stack import StackLayer
    from radixlm.runtime.layers.norm import RMSNorm

    class OffsetNorm(RMSNorm):
        """A norm that computes otherwise than RMSNorm."""

    layers = _tiny_layers("gemma3")
    layer = layers[1]
    base = layer.stack_layer()
    if change == "norm_subclass":
        odd = OffsetNorm(HEAD_DIM, 1e-6)
        layer.stack_layer = lambda: StackLayer(**{**base.__dict__, "q_norm": odd})
    elif change == "norm_dtype":
        layer.mlp_out_norm.to(torch.float64)
    elif change == "head_shape":
        layer.stack_layer = lambda: StackLayer(**{**base.__dict__, "num_heads": 2, "num_kv_heads": 1, "head_dim": 32})
    elif change == "activation":
        layer.stack_layer = lambda: StackLayer(**{**base.__dict__, "activation": "gelu"})
    elif change == "sinks_size":
        layer.stack_layer = lambda: StackLayer(**{**base.__dict__, "attention": AttentionSpec(0.25, sinks=torch.zeros(3))})
    elif change == "rope_index":
        layer.stack_layer = lambda: StackLayer(**{**base.__dict__, "rope_table": -1})
    elif change == "o_bias":
        layer.o.bias = nn.Parameter(torch.zeros(HIDDEN))
    stacks = DecodeStacks(layers)
    assert stacks._build(1) is None
