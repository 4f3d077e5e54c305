"""The C++ CPU kernels (fused norm, SiLU-mul, tanh-GELU-mul, RoPE) against the PyTorch code they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import TINY_ARCHS
from radixlm.runtime.layers import activation, rope
from radixlm.runtime.layers import norm as norm_layer

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(scope="module")
def ext(cpp_ext):
    return cpp_ext


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_the_pytorch_norm(ext, dtype, monkeypatch):
    torch.manual_seed(0)
    norm = norm_layer.RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96)
    norm = norm.to(dtype)
    x, residual = (torch.randn(37, 96) * 3).to(dtype), torch.randn(37, 96).to(dtype)
    fused_sum, fused = norm.add_forward(x, residual)
    plain_norm = norm(x)
    monkeypatch.setattr(norm_layer, "cpu_kernels", lambda: None)
    ref_sum, ref = norm.add_forward(x, residual)
    assert fused.dtype == dtype and torch.equal(fused_sum, ref_sum)
    torch.testing.assert_close(fused, ref, **TOL[dtype])
    torch.testing.assert_close(plain_norm, norm(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_pytorch_over_a_wide_range(ext, dtype):
    gate_up = (torch.linspace(-120, 120, 2 * 5 * 64).reshape(5, 128) * torch.rand(5, 128)).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(ext.silu_mul(gate_up), (F.silu(gate) * up).to(dtype), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_matches_pytorch_over_a_wide_range(ext, dtype, monkeypatch):
    gate_up = (torch.linspace(-60, 60, 2 * 5 * 64).reshape(5, 128) * torch.rand(5, 128)).to(dtype)
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e4, -1e4])
    fused = activation.gelu_tanh_and_mul(gate_up)
    monkeypatch.setattr(activation, "cpu_kernels", lambda: None)
    torch.testing.assert_close(fused, activation.gelu_tanh_and_mul(gate_up), **TOL[dtype])
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(fused, (F.gelu(gate, approximate="tanh") * up).to(dtype), **TOL[dtype])
    assert not torch.allclose(fused.float(), F.silu(gate) * up, atol=1e-3), "not SiLU"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_on_strided_heads_matches_the_pytorch_rotation(ext, dtype, monkeypatch):
    torch.manual_seed(1)
    rotary = rope.RotaryEmbedding(32, 512, 10000.0, None)
    qkv = torch.randn(6, 4 * 32 + 2 * 2 * 32).to(dtype)  # q, k, v of 6 tokens, as a fused projection writes them
    q, k, _ = qkv.split([128, 64, 64], dim=-1)
    q, k = q.view(6, 4, 32), k.view(6, 2, 32)
    table = rotary.table(torch.tensor([0, 1, 7, 100, 300, 511]), dtype)
    fused_q, fused_k = rope.apply_rotary(q, k, table)
    monkeypatch.setattr(rope, "cpu_kernels", lambda: None)
    ref_q, ref_k = rope.apply_rotary(q, k, table)
    torch.testing.assert_close(fused_q, ref_q, **TOL[dtype])
    torch.testing.assert_close(fused_k, ref_k, **TOL[dtype])


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_decoder_layers_give_the_same_hidden_states_with_and_without_the_kernels(ext, tiny_model_dirs, arch, monkeypatch):
    from radixlm.runtime.engine import build_parts
    from radixlm.runtime.server_args import ServerArgs

    rt = build_parts(ServerArgs(model_path=tiny_model_dirs[arch], max_total_tokens=512))
    out_fused = _prefill_hidden(rt)
    for module in (norm_layer, activation, rope):
        monkeypatch.setattr(module, "cpu_kernels", lambda: None)
    out_plain = _prefill_hidden(build_parts(ServerArgs(model_path=tiny_model_dirs[arch], max_total_tokens=512)))  # a cold cache
    torch.testing.assert_close(out_fused, out_plain, atol=1e-4, rtol=1e-4)


def _prefill_hidden(rt) -> torch.Tensor:
    from radixlm.runtime.request import Req
    from radixlm.runtime.sampling_params import SamplingParams

    hidden = []
    model = rt.runner.model
    original = model.forward
    model.forward = lambda batch: hidden.append(original(batch)) or hidden[-1]
    try:
        rt.scheduler.add(Req(rid=f"r{id(hidden)}", input_ids=list(range(3, 40)), params=SamplingParams(max_new_tokens=1, temperature=0), sink=lambda out: None))
        while rt.scheduler.waiting or rt.scheduler.running:
            rt.scheduler.step()
    finally:
        model.forward = original
    return hidden[0]
