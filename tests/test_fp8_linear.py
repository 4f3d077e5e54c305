"""The FP8 (e4m3) weight kernel on CPUs (kernels/csrc/fp8_matmul.h) and FP8Linear: the built kernel
and its plain-C++ build against ``x @ (w * scale).T`` for per-tensor, per-channel and block scales,
the exact decode of every e4m3 bit pattern, the PyTorch path, and the joining of fused parts."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import pytest
import torch

from helpers import missing_under_ci
from radixlm.kernels.cpu_ext import CSRC
from radixlm.runtime.layers.fp8_linear import FP8Linear, dequantize

FINITE = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # all but the two NaNs

SHIM = r"""
#include "fp8_matmul.h"
extern "C" void fp8_matmul(const float* x, int64_t m, int64_t k, const uint8_t* w, const float* scale, int64_t rows_per_scale,
                           int64_t scale_stride, int64_t seg, int64_t n, float* y) {
  radixlm::fp8::matmul_rows(x, m, k, w, scale, rows_per_scale, scale_stride, seg, n, 0, n, y);
}
extern "C" float e4m3(uint8_t b) { return radixlm::fp8::e4m3_value(b); }
"""
FLAGS = {"plain C++": "-march=x86-64", "avx2": "-march=haswell"}


@pytest.fixture(scope="module")
def ext(cpp_ext):
    return cpp_ext


def _fp8(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random e4m3 bits [N, K] (no NaN), spanning subnormals to 448."""
    return FINITE[torch.randint(0, FINITE.numel(), (n, k), generator=gen)]


def _reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """``x @ (w.float() * scale).T`` in float64, w decoded by torch's own float8_e4m3fn."""
    w = weight.view(torch.float8_e4m3fn).double()
    if block is None:
        s = scale.double().reshape(-1, 1) if scale.numel() > 1 else scale.double().reshape(())
    else:
        s = scale.double().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
    return (x.double() @ (w * s).T).float()


def _scale(kind: str, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, tuple[int, int] | None]:
    if kind == "tensor":
        return torch.rand((), generator=gen) * 1e-3 + 1e-4, None
    if kind == "channel":
        return torch.rand(n, generator=gen) * 1e-3 + 1e-4, None
    return torch.rand(-(-n // 128), -(-k // 128), generator=gen) * 1e-3 + 1e-4, (128, 128)


# N and K not multiples of the 128x128 blocks (nor of 16 or 8: every tail of the vector loop)
SHAPES = [(1, 1), (7, 13), (200, 300), (130, 264)]
KINDS = ["tensor", "channel", "block"]


def _cases():
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        weight = _fp8(n, k, gen)
        for kind in KINDS:
            scale, block = _scale(kind, n, k, gen)
            for m in (1, 2, 5):
                yield torch.randn(m, k, generator=gen), weight, scale, block


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=2e-5 * want.abs().max().item() + 1e-7, rtol=1e-4)


def test_the_built_kernel_equals_the_dequantized_product(ext):
    for x, weight, scale, block in _cases():
        bn, bk = block or (0, 0)
        got = ext.fp8_linear(x, weight, scale, bn, bk)
        assert got.shape == (x.shape[0], weight.shape[0])
        _close(got, _reference(x, weight, scale, block))


def test_the_built_kernel_decodes_every_bit_pattern_exactly(ext):
    # x = 1 over one input: y[0, j] is weight j's value
    got = ext.fp8_linear(torch.ones(1, 1), FINITE.reshape(-1, 1), torch.ones(1), 0, 0)
    assert torch.equal(got[0], FINITE.view(torch.float8_e4m3fn).float())
    # and along a row, through the vector loop's 16 and 8 wide steps and its tail (x one-hot)
    x = torch.eye(FINITE.numel())
    assert torch.equal(ext.fp8_linear(x, FINITE.reshape(1, -1), torch.ones(1), 0, 0)[:, 0], FINITE.view(torch.float8_e4m3fn).float())


def test_the_built_kernel_refuses_scales_of_another_shape(ext):
    weight = torch.zeros(8, 64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="1 or N"):
        ext.fp8_linear(torch.zeros(1, 64), weight, torch.ones(3), 0, 0)
    with pytest.raises(RuntimeError, match="block scales must be"):
        ext.fp8_linear(torch.zeros(1, 64), weight, torch.ones(2, 2), 128, 128)


@pytest.fixture(scope="module")
def shims(tmp_path_factory):
    """The header built for plain C++ and for AVX2: name -> library."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        missing_under_ci("no C++ compiler")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the instruction-set builds are x86 ones")
    folder = tmp_path_factory.mktemp("fp8_shims")
    (folder / "shim.cpp").write_text(SHIM)
    libs = {}
    for name, flag in FLAGS.items():
        lib = folder / f"{flag.split('=')[1]}.so"
        subprocess.run([cxx, "-O2", "-std=c++17", "-shared", "-fPIC", flag, f"-I{CSRC}", str(folder / "shim.cpp"), "-o", str(lib)], check=True)
        libs[name] = ctypes.CDLL(str(lib))
        libs[name].e4m3.restype = ctypes.c_float
    return libs


def _shim_product(lib, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    (m, k), n = x.shape, weight.shape[0]
    if block is not None:
        rows_per_scale, stride, seg = block[0], scale.shape[1], block[1]
    else:
        rows_per_scale, stride, seg = (n, 0, k) if scale.numel() == 1 else (1, 1, k)
    scale = scale.float().contiguous()
    y = torch.empty(m, n)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.fp8_matmul(ptr(x.data_ptr()), i64(m), i64(k), ptr(weight.data_ptr()), ptr(scale.data_ptr()), i64(rows_per_scale), i64(stride), i64(seg), i64(n), ptr(y.data_ptr()))
    return y


def test_the_plain_cpp_and_avx2_builds_agree_with_each_other_and_the_reference(shims):
    plain, avx2 = shims["plain C++"], shims["avx2"]
    decoded = torch.tensor([plain.e4m3(ctypes.c_uint8(b)) for b in range(256)])
    torch_decoded = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(decoded[FINITE.long()], torch_decoded[FINITE.long()])
    assert decoded[0x7F].isnan() and decoded[0xFF].isnan()
    for x, weight, scale, block in _cases():
        want = _reference(x, weight, scale, block)
        a, b = _shim_product(plain, x, weight, scale, block), _shim_product(avx2, x, weight, scale, block)
        _close(a, want)
        _close(b, want)
        _close(a, b)


# ------------------------------------------------------------ the layer
def test_fp8_layer_on_the_cpp_and_torch_paths_equals_the_dequantized_product(ext):
    gen = torch.Generator().manual_seed(1)
    weight = _fp8(200, 300, gen)
    for kind in KINDS:
        scale, block = _scale(kind, 200, 300, gen)
        bias = torch.randn(200, generator=gen)
        cpp = FP8Linear(weight, scale, block, bias, kernel="cpp")
        fallback = FP8Linear(weight, scale, block, bias, kernel="torch")
        assert cpp.kernel == "cpp" and fallback.kernel == "torch" and cpp.out_features == 200
        assert cpp.weight_bytes() == 200 * 300 + scale.numel() * 4
        for m in (1, 5, 40):  # 40: past dense_from, the dequantized chunks on the cpp layer too
            x = torch.randn(2, m, 300, generator=gen)
            want = _reference(x.reshape(-1, 300), weight, scale, block).reshape(2, m, 200) + bias
            for layer in (cpp, fallback):
                got = layer(x)
                assert got.shape == (2, m, 200) and got.dtype == x.dtype
                _close(got, want)
        torch.testing.assert_close(fallback.dequantize(), _reference(torch.eye(300), weight, scale, block).T)


def test_fp8_layer_torch_path_dequantizes_in_bounded_chunks(monkeypatch):
    import radixlm.runtime.layers.fp8_linear as mod

    monkeypatch.setattr(mod, "CHUNK_WEIGHTS", 300 * 130)  # 130 rows, a multiple of no block: rounded to 128
    seen = []
    real = mod.dequantize
    monkeypatch.setattr(mod, "dequantize", lambda *a, **kw: seen.append(a[3]) or real(*a, **kw))
    gen = torch.Generator().manual_seed(2)
    weight = _fp8(300, 300, gen)
    scale, block = _scale("block", 300, 300, gen)
    layer = FP8Linear(weight, scale, block, kernel="torch")
    x = torch.randn(3, 300, generator=gen)
    _close(layer(x), _reference(x, weight, scale, block))
    assert [(s.start, s.stop) for s in seen] == [(0, 128), (128, 256), (256, 384)]


def test_fp8_layer_returns_bf16_for_bf16_activations(ext):
    gen = torch.Generator().manual_seed(3)
    weight = _fp8(64, 96, gen)
    scale = torch.rand(64, generator=gen) * 1e-3
    x = torch.randn(3, 96, generator=gen).to(torch.bfloat16)
    for kernel in ("cpp", "torch"):
        got = FP8Linear(weight, scale, kernel=kernel)(x)
        assert got.dtype == torch.bfloat16
        want = _reference(x.float(), weight, scale, None)
        torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


def test_fp8_layer_keeps_its_bias_as_given_even_on_the_meta_device():
    bias = torch.nn.Parameter(torch.empty(16, device="meta"), requires_grad=False)
    layer = FP8Linear(torch.zeros(16, 32, dtype=torch.uint8), torch.ones(()), None, bias, kernel="torch")
    assert layer.bias is bias
    assert FP8Linear(torch.zeros(16, 32, dtype=torch.float8_e4m3fn), torch.ones(16), kernel="torch").weight.dtype == torch.uint8
    with pytest.raises(ValueError, match="1 or 16 elements"):
        FP8Linear(torch.zeros(16, 32, dtype=torch.uint8), torch.ones(4))


def test_concat_turns_per_tensor_scales_into_per_channel_ones_exactly():
    gen = torch.Generator().manual_seed(4)
    parts = [(_fp8(24, 40, gen), torch.tensor(0.5)), (_fp8(8, 40, gen), torch.rand(8, generator=gen)), (_fp8(8, 40, gen), torch.tensor([0.25]))]
    layer = FP8Linear.concat(parts, kernel="torch")
    assert layer.out_features == 40 and layer.scale.shape == (40,)
    want = torch.cat([dequantize(w, s, None) for w, s in parts])
    assert torch.equal(layer.dequantize(), want)


def test_concat_stacks_block_scale_rows_and_refuses_parts_off_the_block_rows():
    gen = torch.Generator().manual_seed(5)
    parts = [(_fp8(n, 200, gen), torch.rand(-(-n // 64), 4, generator=gen)) for n in (128, 64, 40)]  # the last may be ragged
    layer = FP8Linear.concat(parts, (64, 64), kernel="torch")
    assert layer.scale.shape == (2 + 1 + 1, 4)
    assert torch.equal(layer.dequantize(), torch.cat([dequantize(w, s, (64, 64)) for w, s in parts]))
    ragged = [(_fp8(96, 200, gen), torch.rand(2, 4, generator=gen)), (_fp8(64, 200, gen), torch.rand(1, 4, generator=gen))]
    with pytest.raises(ValueError, match=r"\(96, 200\).*not a multiple of block 64"):
        FP8Linear.concat(ragged, (64, 64))
    with pytest.raises(ValueError, match="in_features"):
        FP8Linear.concat([(_fp8(8, 32, gen), torch.ones(())), (_fp8(8, 64, gen), torch.ones(()))])


def test_dequantize_takes_rows_that_start_inside_a_block():
    gen = torch.Generator().manual_seed(6)
    weight = _fp8(300, 200, gen)
    scale, block = _scale("block", 300, 200, gen)
    whole = dequantize(weight, scale, block)
    assert torch.equal(dequantize(weight, scale, block, slice(100, 260)), whole[100:260])


def test_the_cpp_layer_runs_its_kernel_below_dense_from(ext, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    layer = FP8Linear(_fp8(40, 64, gen), torch.rand(40, generator=gen), kernel="cpp", dense_from=8)
    calls = []
    monkeypatch.setattr(ext, "fp8_linear", lambda *a: calls.append(a[0].shape[0]) or torch.zeros(a[0].shape[0], 40))
    layer(torch.randn(3, 64, generator=gen))
    layer(torch.randn(9, 64, generator=gen))
    assert calls == [3]
