"""The Triton FP8 (e4m3) weight-only matmul (FP8 checkpoints on GPUs), run under Triton's
interpreter on CPU tensors against the dequantized product: per-tensor, per-channel and block
scales, every e4m3 bit pattern, and FP8Linear's GPU path."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest sets it too, before anything imports triton
if os.environ.get("CI"):  # CI installs Triton: a failed install must fail the run, not skip these
    import triton  # noqa: F401
else:
    pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot run")

from radixlm.kernels.triton_fp8_linear import PER_STEP, PER_WEIGHT, fp8_linear, scale_mode  # noqa: E402

pytestmark = pytest.mark.triton

FINITE = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # all but the two NaNs


def _fp8(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random e4m3 bits [N, K] (no NaN), spanning subnormals to 448."""
    return FINITE[torch.randint(0, FINITE.numel(), (n, k), generator=gen)]


def _dense(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """The weight the bits and scales stand for, through torch's own float8_e4m3fn."""
    w = weight.view(torch.float8_e4m3fn).float()
    if block is None:
        return w * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))
    bn, bk = block
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: w.shape[0], : w.shape[1]]
    return w * full


def _scales(kind: str, n: int, k: int, block: tuple[int, int] | None, gen: torch.Generator) -> torch.Tensor:
    if kind == "tensor":
        return torch.rand((), generator=gen) * 1e-3 + 1e-4
    if kind == "channel":
        return torch.rand(n, generator=gen) * 1e-3 + 1e-4
    bn, bk = block
    return torch.rand(-(-n // bn), -(-k // bk), generator=gen) * 1e-3 + 1e-4


def test_every_e4m3_bit_pattern_decodes_exactly():
    # one weight per output row, x = 1: y[0, j] is the decode of byte j times the scale (1)
    x = torch.ones(1, 1)
    got = fp8_linear(x, FINITE.reshape(-1, 1), torch.ones(()))
    want = FINITE.view(torch.float8_e4m3fn).float()
    assert torch.equal(got[0], want)
    assert want.abs().max() == 448 and want[want > 0].min() == 2.0**-9  # the range and the smallest subnormal


# (kind, block, N, K): K and N cover partial tiles, partial blocks, and block sizes whose K step
# is a divisor (32, 16: scaled per step) or none (24, 20: scaled per weight)
CASES = [
    ("tensor", None, 40, 48),
    ("channel", None, 33, 100),
    ("block", (32, 32), 70, 100),
    ("block", (16, 64), 33, 72),
    ("block", (24, 20), 50, 70),
]


@pytest.mark.parametrize(("kind", "block", "n", "k"), CASES)
@pytest.mark.parametrize("m", [1, 2, 5])
def test_fp8_linear_equals_the_dequantized_product(kind, block, n, k, m):
    gen = torch.Generator().manual_seed(n * 1000 + k + m)
    weight = _fp8(n, k, gen)
    scale = _scales(kind, n, k, block, gen)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if m == 2 else None
    got = fp8_linear(x, weight, scale, block, b)
    want = x @ _dense(weight, scale, block).T + (b if b is not None else 0)
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_block_scales_pick_the_per_step_or_the_per_weight_kernel():
    assert scale_mode(torch.ones(3, 4), 70, 100, (32, 32)) == PER_STEP
    assert scale_mode(torch.ones(3, 4), 50, 70, (24, 20)) == PER_WEIGHT


def test_fp8_linear_multiplies_in_fp16_and_returns_it():
    gen = torch.Generator().manual_seed(9)
    weight = _fp8(24, 64, gen)
    scale = _scales("block", 24, 64, (16, 32), gen)
    x = torch.randn(3, 64, generator=gen).half()
    got = fp8_linear(x, weight, scale, (16, 32))
    assert got.dtype == torch.float16
    want = x.float() @ _dense(weight, scale, (16, 32)).T
    torch.testing.assert_close(got.float(), want, atol=2e-3 * want.abs().max().item(), rtol=2e-3)


def test_fp8_linear_refuses_scales_of_another_shape():
    weight = torch.zeros(8, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="1 or 8 elements"):
        fp8_linear(torch.zeros(1, 64), weight, torch.ones(4))
    with pytest.raises(ValueError, match=r"must be \[1, 1\]"):
        fp8_linear(torch.zeros(1, 64), weight, torch.ones(1, 2), (128, 128))
    with pytest.raises(ValueError, match="uint8"):
        fp8_linear(torch.zeros(1, 64), weight.to(torch.int8), torch.ones(()))
