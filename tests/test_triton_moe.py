"""The Triton fused-MoE kernels (routed experts on GPUs), run under Triton's interpreter on CPU
tensors against a per-token loop in plain PyTorch, alone and as MoEBlock's routed experts."""

import functools
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest sets it too, before anything imports triton
if os.environ.get("CI"):  # CI installs Triton: a failed install must fail the run, not skip these
    import triton  # noqa: F401
else:
    pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot run")

from radixlm.kernels.triton_moe import align_blocks, fused_experts  # noqa: E402
from radixlm.runtime.layers.activation import clamped_swiglu, silu_and_mul  # noqa: E402
from radixlm.runtime.layers.moe import MoEBlock  # noqa: E402
from radixlm.runtime.layers.moe_router import RouterSpec  # noqa: E402
from radixlm.runtime.layers.quantized_linear import Int8Linear  # noqa: E402

pytestmark = pytest.mark.triton

# H = 40 and I = 24: the gate/up product is [48, 40], the down one [40, 24]; neither is a multiple
# of the interpreter's 32-column, 16-deep tiles. The kernels' pairs come in blocks of 16.
HIDDEN, INTER = 40, 24
GPT_OSS_ACT = functools.partial(clamped_swiglu, alpha=1.702, limit=7.0)


def _reference(x, w_gate_up, w_down, weights, ids, act_fn, b_gate_up=None, b_down=None):
    """Each token's experts one at a time, in fp32, added in ascending expert order."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in sorted(range(ids.shape[1]), key=lambda j: int(ids[t, j])):
            e = int(ids[t, j])
            h = x[t].float() @ w_gate_up[e].float().T + (b_gate_up[e].float() if b_gate_up is not None else 0)
            y = act_fn(h[None])[0] @ w_down[e].float().T + (b_down[e].float() if b_down is not None else 0)
            out[t] += weights[t, j].float() * y
    return out


def _problem(tokens, k, experts, used, bias, seed, equal_weights=False):
    """Random inputs whose tokens choose among the first ``used`` experts only; the others hold NaN
    weights, so reading any of them would poison the output."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    w_gate_up = torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) * 0.2
    w_down = torch.randn(experts, HIDDEN, INTER, generator=gen) * 0.2
    b_gate_up = torch.randn(experts, 2 * INTER, generator=gen) * 0.1 if bias else None
    b_down = torch.randn(experts, HIDDEN, generator=gen) * 0.1 if bias else None
    for w in (w_gate_up, w_down, b_gate_up, b_down):
        if w is not None:
            w[used:] = float("nan")
    ids = torch.stack([torch.randperm(used, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.full((tokens, k), 1.0 / k) if equal_weights else torch.rand(tokens, k, generator=gen)
    return x, w_gate_up, w_down, weights, ids, b_gate_up, b_down


# T = 1 (a decode step: one block per expert), several tokens; k = 1 and k > 1; T * k never a
# multiple of 16 except 16 = 4 x 4 (full blocks); E = 10 with only 3, 5 or 7 experts chosen.
@pytest.mark.parametrize(
    ("tokens", "k", "used", "bias", "act"),
    [
        (1, 1, 3, False, "silu"),
        (1, 4, 7, True, "gpt_oss"),
        (4, 4, 5, False, "silu"),
        (7, 2, 3, True, "silu"),
        (13, 3, 7, True, "gpt_oss"),
    ],
)
def test_fused_experts_equal_a_per_token_loop_and_never_read_unchosen_experts(tokens, k, used, bias, act):
    x, w_gate_up, w_down, weights, ids, b_gate_up, b_down = _problem(tokens, k, 10, used, bias, seed=tokens * 10 + k)
    act_fn = silu_and_mul if act == "silu" else GPT_OSS_ACT
    got = fused_experts(x, w_gate_up, w_down, weights, ids, act_fn, b_gate_up, b_down)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, _reference(x, w_gate_up, w_down, weights, ids, act_fn, b_gate_up, b_down), atol=1e-4, rtol=1e-4)


def test_fused_experts_with_equal_router_weights_sums_each_tokens_experts_alike():
    # ties: every slot weighs 1/k, ids listed in descending order so the sum's ascending order matters
    x, w_gate_up, w_down, weights, ids, _, _ = _problem(6, 3, 8, 8, False, seed=5, equal_weights=True)
    ids = ids.sort(dim=1, descending=True).values
    got = fused_experts(x, w_gate_up, w_down, weights, ids, silu_and_mul)
    torch.testing.assert_close(got, _reference(x, w_gate_up, w_down, weights, ids, silu_and_mul), atol=1e-4, rtol=1e-4)
    swapped = fused_experts(x, w_gate_up, w_down, weights, ids.flip(1), silu_and_mul)  # same experts, other slots
    assert torch.equal(got, swapped)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 3e-2), (torch.float16, 3e-3)], ids=["bf16", "fp16"])
def test_fused_experts_multiply_in_16_bit_and_return_it(dtype, tol):
    x, w_gate_up, w_down, weights, ids, b_gate_up, b_down = _problem(5, 2, 6, 4, True, seed=11)
    args = [t.to(dtype) for t in (x, w_gate_up, w_down)]
    got = fused_experts(*args, weights, ids, silu_and_mul, b_gate_up.to(dtype), b_down.to(dtype))
    assert got.dtype == dtype
    want = _reference(*args, weights, ids, silu_and_mul, b_gate_up.to(dtype), b_down.to(dtype))
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_align_blocks_pads_each_experts_run_and_gives_unchosen_experts_no_block():
    ids = torch.tensor([[5, 1], [1, 5], [5, 3]])  # pairs 0..5; experts 0, 2, 4, 6, 7 unchosen
    sorted_pairs, block_expert = align_blocks(ids, 8, 4)
    # bound: (6 pairs + 6 experts * 3) // 4 = 6 blocks; used: 1 (expert 1), 1 (3), 1 (5)
    assert block_expert.tolist() == [1, 3, 5, -1, -1, -1]
    sentinel = 6
    assert sorted_pairs.view(-1, 4)[:3].tolist() == [[1, 2, sentinel, sentinel], [5, sentinel, sentinel, sentinel], [0, 3, 4, sentinel]]
    assert (sorted_pairs.view(-1, 4)[3:] == sentinel).all()
    decode = align_blocks(torch.tensor([[7, 2, 4]]), 128, 16)[1]  # one token: exactly k blocks
    assert decode.tolist() == [2, 4, 7]


def test_fused_experts_refuse_mismatched_shapes_and_dtypes():
    x, w_gate_up, w_down, weights, ids, _, _ = _problem(2, 2, 4, 4, False, seed=1)
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_experts(x[:, :8], w_gate_up, w_down, weights, ids, silu_and_mul)
    with pytest.raises(ValueError, match="share one of"):
        fused_experts(x.half(), w_gate_up, w_down, weights, ids, silu_and_mul)
    with pytest.raises(ValueError, match="b_down"):
        fused_experts(x, w_gate_up, w_down, weights, ids, silu_and_mul, b_down=torch.zeros(4, 3))


def _block(kernel: str, bias: bool, act_fn=silu_and_mul) -> MoEBlock:
    torch.manual_seed(3)
    block = MoEBlock(HIDDEN, RouterSpec(num_experts=12, top_k=3), INTER, act_fn, bias=bias, kernel=kernel)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


@pytest.mark.parametrize(("bias", "act"), [(False, "silu"), (True, "gpt_oss")])
def test_moe_block_on_the_triton_kernel_equals_the_grouped_torch_path(bias, act):
    block = _block("triton", bias, silu_and_mul if act == "silu" else GPT_OSS_ACT)
    x = torch.randn(9, HIDDEN)
    assert block.stack_experts()  # as the model runner does after loading, before sizing the KV pool
    stacked = block._stacked
    with torch.inference_mode():  # as the model runner calls it
        got = block(x)
        block.kernel = "torch"
        want = block(x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # stacked once, without a second copy: each expert's parameters are views into the stacks
    assert block._stacked is stacked and stacked.gate_up.shape == (12, 2 * INTER, HIDDEN) and stacked.down.shape == (12, HIDDEN, INTER)
    for e, expert in enumerate(block.experts):
        assert expert.gate_up_proj.weight.data_ptr() == stacked.gate_up[e].data_ptr()
        assert expert.down_proj.weight.data_ptr() == stacked.down[e].data_ptr()
        if bias:
            assert expert.down_proj.bias.data_ptr() == stacked.down_bias[e].data_ptr()


def test_moe_block_sees_new_expert_weights_and_replaced_layers():
    block = _block("triton", False)
    x = torch.randn(4, HIDDEN)
    with torch.no_grad():
        block(x)
        for expert in block.experts:  # new weights, in place: the stacks see them
            expert.down_proj.weight.mul_(-2)
        got = block(x)
        block.kernel = "torch"
        torch.testing.assert_close(got, block(x), atol=1e-4, rtol=1e-4)
        block.experts[0].down_proj = Int8Linear(block.experts[0].down_proj)  # quantized: not stackable
        assert block(x).shape == x.shape  # the torch path
        block.kernel = "triton"
        with pytest.raises(ValueError, match="plain nn.Linear"):
            block(x)


def test_moe_block_restacks_after_a_dtype_change_and_stays_grouped_on_cpu_by_default():
    block = _block("auto", False)
    x = torch.randn(3, HIDDEN)
    with torch.no_grad():
        want = block(x)
        assert not block.stack_experts() and block._stacked is None  # auto: the grouped path on CPU tensors, nothing stacked
        block.kernel = "triton"
        torch.testing.assert_close(block(x), want, atol=1e-4, rtol=1e-4)
        block.half()
        got = block(x.half())
    assert block._stacked.gate_up.dtype == torch.float16 and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="kernel must be"):
        MoEBlock(HIDDEN, RouterSpec(num_experts=4, top_k=2), INTER, silu_and_mul, kernel="cuda")
