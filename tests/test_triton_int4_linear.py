"""The Triton int4 (Q4_1) weight-only matmul (int4 quantization on GPUs), run under Triton's
interpreter on CPU tensors against the dequantized product, alone and as Int4Linear's kernel."""

import os

import pytest
import torch
from torch import nn

os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest sets it too, before anything imports triton
if os.environ.get("CI"):  # CI installs Triton: a failed install must fail the run, not skip these
    import triton  # noqa: F401
else:
    pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot run")

from radixlm.kernels.triton_int4_linear import int4_linear, int4_zp_linear, pack_halves  # noqa: E402
from radixlm.runtime.layers.quantized_linear import Int4Linear, q4_1_quantize  # noqa: E402

pytestmark = pytest.mark.triton


def _dequantized(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    w = codes.float() * scale.float()[..., None] + minimum.float()[..., None]
    return w.reshape(codes.shape[0], -1)


# K = 32: one group, half a block step; 96: three groups, the high nibbles' groups start mid-step;
# 160: several steps and a tail. N and M leave partial tiles.
@pytest.mark.parametrize(("m", "n", "k", "bias"), [(1, 40, 32, False), (3, 33, 96, True), (18, 64, 160, True)])
def test_int4_linear_equals_the_dequantized_product_with_tile_tails(m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 100 + n)
    w = torch.randn(n, k, generator=gen)
    codes, scale, minimum = q4_1_quantize(w)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = int4_linear(x, pack_halves(codes), scale, minimum, b)
    want = x @ _dequantized(codes, scale, minimum).T + (b if bias else 0)
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_pack_halves_puts_input_j_low_and_j_plus_half_high():
    codes = torch.arange(64, dtype=torch.uint8).remainder(16).reshape(1, 2, 32)
    packed = pack_halves(codes)
    flat = codes.reshape(-1)
    assert packed.shape == (1, 32)
    assert torch.equal(packed[0] & 0xF, flat[:32]) and torch.equal(packed[0] >> 4, flat[32:])


def test_int4_linear_multiplies_in_16_bit_activations_and_returns_them():
    # fp16: Triton's interpreter multiplies bf16 operands as raw bits, so bf16 is checked on a GPU (gpu_check.py)
    gen = torch.Generator().manual_seed(3)
    codes, scale, minimum = q4_1_quantize(torch.randn(40, 96, generator=gen) * 0.05)
    x = torch.randn(3, 96, generator=gen).to(torch.float16)
    got = int4_linear(x, pack_halves(codes), scale, minimum)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), x.float() @ _dequantized(codes, scale, minimum).T, atol=2e-3, rtol=2e-3)


def test_int4_linear_refuses_mismatched_shapes():
    halves = torch.zeros(8, 16, dtype=torch.uint8)
    scale = torch.ones(8, 1, dtype=torch.float16)
    with pytest.raises(ValueError, match="multiple of 32"):
        int4_linear(torch.zeros(2, 16), halves, scale, scale)
    with pytest.raises(ValueError, match="scale and minimum"):
        int4_linear(torch.zeros(2, 32), halves, torch.ones(8, 2, dtype=torch.float16), scale)


def test_int4_layer_on_the_triton_kernel_matches_the_cpu_kernels_layer():
    gen = torch.Generator().manual_seed(7)
    linear = nn.Linear(96, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 96, generator=gen))
    gpu_form = Int4Linear(linear, kernel="triton")
    assert gpu_form.kernel == "triton" and gpu_form.tiles is None and gpu_form.qweight is None
    assert gpu_form.weight_bytes() == 48 * 48 + 2 * 48 * 3 * 2
    x = torch.randn(5, 96, generator=gen)
    codes, scale, minimum = q4_1_quantize(linear.weight.detach())
    want = x @ _dequantized(codes, scale, minimum).T + linear.bias.detach()
    torch.testing.assert_close(gpu_form(x), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="dense_from"):
        Int4Linear(linear, dense_from=64, kernel="triton")


# ------------------------------------------------------------ zero points (AWQ / GPTQ)
def _zp_weight(n: int, k: int, group: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes [N, K], fp16 scales and uint8 zero points [N, K/group], and the weight they stand for."""
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=gen) * 0.1 + 0.01).half()
    zero = torch.randint(0, 16, (n, k // group), generator=gen, dtype=torch.uint8)
    w = (codes.float().reshape(n, -1, group) - zero.float()[..., None]) * scale.float()[..., None]
    return codes, scale, zero, w.reshape(n, k)


# K = 2 groups (the high nibbles start at group 1), 3 groups (a group straddles the halves), 5 groups
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize(("m", "n", "groups", "bias"), [(1, 40, 2, False), (3, 33, 3, True), (18, 17, 5, True)])
def test_int4_zp_linear_equals_the_dequantized_product(group, m, n, groups, bias):
    gen = torch.Generator().manual_seed(group + m * 100 + n)
    k = groups * group
    codes, scale, zero, w = _zp_weight(n, k, group, gen)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = int4_zp_linear(x, pack_halves(codes), scale, zero, group, b)
    want = x @ w.T + (b if bias else 0)
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_int4_zp_linear_multiplies_in_fp16_and_returns_it():
    gen = torch.Generator().manual_seed(5)
    codes, scale, zero, w = _zp_weight(24, 128, 64, gen)
    x = torch.randn(2, 128, generator=gen).half()
    got = int4_zp_linear(x, pack_halves(codes), scale, zero, 64)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), x.float() @ w.T, atol=2e-2, rtol=2e-3)


def test_int4_zp_linear_refuses_other_groups_and_shapes():
    halves = torch.zeros(8, 64, dtype=torch.uint8)
    scale = torch.ones(8, 2, dtype=torch.float16)
    zero = torch.zeros(8, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="group must be"):
        int4_zp_linear(torch.zeros(2, 128), halves, scale, zero, 16)
    with pytest.raises(ValueError, match="multiple of 128"):
        int4_zp_linear(torch.zeros(2, 96), torch.zeros(8, 48, dtype=torch.uint8), scale, zero, 128)
    with pytest.raises(ValueError, match="uint8 zero"):
        int4_zp_linear(torch.zeros(2, 128), halves, scale, zero.half(), 64)
