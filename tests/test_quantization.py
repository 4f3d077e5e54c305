"""Weight-only int8/int4 layers: close to fp32, and usable end to end."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from radixlm.runtime.layers.quantized_linear import Int4Linear, Int8Linear


@pytest.mark.parametrize("cls, tol", [(Int8Linear, 0.02), (Int4Linear, 0.12)])
def test_quantized_linear_is_close_to_fp32(cls, tol):
    torch.manual_seed(0)
    lin = nn.Linear(128, 96, bias=True)
    x = torch.randn(5, 128)
    ref = lin(x)
    out = cls(lin)(x)
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert (out - ref).norm() / ref.norm() < tol


def test_int4_recovers_q4_1_blocks_exactly():
    """Weights already on a Q4_1 grid (scale and min per 32) come back unchanged up to bf16 scales."""
    torch.manual_seed(1)
    q = torch.randint(0, 16, (64, 64)).float()
    q[:, 0], q[:, 1], q[:, 32], q[:, 33] = 0, 15, 0, 15  # Q4_1 blocks span their whole range
    scale = torch.rand(64, 2, 1) * 0.1 + 0.01
    lo = torch.randn(64, 2, 1) * 0.1
    w = (q.view(64, 2, 32) * scale + lo).view(64, 64)
    lin = nn.Linear(64, 64, bias=False)
    lin.weight.data = w
    eye = torch.eye(64)
    recovered = Int4Linear(lin)(eye).t()
    assert (recovered - w).abs().max() < 0.01  # bf16 scales and outputs: ~2 ulps at |w| < 2


def test_int4_bf16_switches_to_the_bf16_copy_for_many_rows():
    torch.manual_seed(2)
    lin = nn.Linear(64, 48, bias=False)
    layer = Int4Linear(lin, dense_from=16)
    few, many = torch.randn(2, 64), torch.randn(64, 64)
    assert torch.equal(layer(few), Int4Linear(lin)(few))  # the int4 path
    torch.testing.assert_close(layer(many), lin(many), atol=0.05, rtol=0.02)  # bf16 math, not int4
    assert (layer(many) - Int4Linear(lin)(many)).abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["int8", "int4", "int4_bf16", "auto"])
def test_quantized_engine_generates(tiny_llama, mode):
    import radixlm

    with radixlm.Engine(model_path=tiny_llama, max_total_tokens=1024, quantization=mode) as eng:
        out = eng.generate("The quick brown", {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert len(out["output_ids"]) == 8
        eng.check_accounting()
    with pytest.raises(ValueError, match="quantization"):
        radixlm.Engine(model_path=tiny_llama, quantization="int3")
