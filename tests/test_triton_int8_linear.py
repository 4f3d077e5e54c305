"""The Triton int8 weight-only matmul (weight quantization on GPUs), run under Triton's interpreter
on CPU tensors against the dequantized product; and quantization's device rules."""

import os

import pytest
import torch
from torch import nn

os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest sets it too, before anything imports triton
if os.environ.get("CI"):  # CI installs Triton: a failed install must fail the run, not skip these
    import triton  # noqa: F401
else:
    pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot run")

from radixlm.kernels.triton_int8_linear import int8_linear  # noqa: E402
from radixlm.runtime.layers.quant import quantize_model  # noqa: E402
from radixlm.runtime.layers.quantized_linear import Int4Linear, Int8Linear  # noqa: E402

pytestmark = pytest.mark.triton


@pytest.mark.parametrize(("m", "n", "k", "bias"), [(1, 40, 72, False), (3, 33, 96, True), (18, 64, 32, True)])
def test_int8_linear_equals_the_dequantized_product_with_tile_tails(m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 100 + n)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen))
    layer = Int8Linear(linear)
    x = torch.randn(m, k, generator=gen)
    got = int8_linear(x, layer.qweight, layer.scales, layer.bias)
    want = x @ (layer.qweight.float() * layer.scales.float()[:, None]).T + (layer.bias if bias else 0)
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_int8_linear_refuses_mismatched_shapes():
    q = torch.zeros(8, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match="same K"):
        int8_linear(torch.zeros(2, 16), q, torch.ones(8))
    with pytest.raises(ValueError, match="one scale per row"):
        int8_linear(torch.zeros(2, 32), q, torch.ones(4))


def _tiny_model(device: str) -> nn.Module:
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 64)).to(device)
    model.lm_head = nn.Linear(64, 8)  # not tied: quantize_model leaves the embedding alone
    return model


def test_quantization_off_the_cpu_is_int8_or_int4_on_triton_and_names_a_cpu_only_mode():
    # meta tensors stand in for a GPU's: quantize_model decides by the parameters' device
    for mode in ("int4_bf16", "auto"):
        with pytest.raises(ValueError, match=f"quantization '{mode}' runs on CPU kernels; on meta int8 and int4"):
            quantize_model(_tiny_model("meta"), mode)
    model = _tiny_model("meta")
    quantize_model(model, "int8")
    assert isinstance(model[0], Int8Linear) and model[0].qweight.device.type == "meta"
    model = _tiny_model("meta")
    quantize_model(model, "int4")
    assert isinstance(model[0], Int4Linear) and model[0].kernel == "triton" and model[0].halves.device.type == "meta"
