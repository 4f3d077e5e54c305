"""The 4-bit weight kernel (kernels/csrc/q4_matmul.h): each of its instruction-set paths against a
PyTorch reference of the same arithmetic, and the Int4Linear layer built on it.

The engine's build compiles one path, the one this CPU runs best (-march=native). The others are
built here from the same header into small shared libraries (AVX2 without VNNI, as on most
laptops and cloud VMs, and plain C++), so a machine with AVX-512 still runs every path.
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import pytest
import torch
from torch import nn

from helpers import missing_under_ci
from radixlm.kernels.cpu_ext import CSRC
from radixlm.runtime.layers.quantized_linear import (
    Int4Linear,
    q4_0_tiles,
    q4_1_quantize,
    q4_1_tiles,
)

SHAPES = [(1, 32), (3, 64), (4, 96), (101, 64), (576, 576), (130, 1536)]  # (out, in): tails of a tile, one block, many
ROWS = [1, 2, 3, 4, 5, 9, 33]  # every pass size of the row kernel, a remainder, and 16-row vectors (from 28 rows)

SHIM = r"""
#include <vector>
#include "q4_matmul.h"
extern "C" void q4_matmul(const float* x, int64_t rows, int64_t k, const uint8_t* tiles, int64_t n, float* y, int q4_0) {
  std::vector<float> scratch((radixlm::q4::scratch_bytes(rows, k) + 3) / 4);
  uint8_t* s = reinterpret_cast<uint8_t*>(scratch.data());
  radixlm::q4::quantize_into(x, rows, k, s);
  radixlm::q4::matmul_tiles(tiles, s, rows, k, n, 0, (n + 3) / 4, y, q4_0 != 0);
}
"""
FLAGS = {"avx2 without vnni": "-march=haswell", "plain C++": "-march=x86-64", "native": "-march=native"}


@pytest.fixture(scope="module")
def ext(cpp_ext):
    return cpp_ext


def _quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's tiles of ``w`` and the weights they stand for."""
    codes, scale, minimum = q4_1_quantize(w)
    dense = (codes.float() * scale.float()[..., None] + minimum.float()[..., None]).reshape(w.shape)
    return q4_1_tiles(codes, scale, minimum), dense


def _q4_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_0 codes and fp16 scales of ``w`` (``w ~ scale * (code - 8)``) and the weights they stand for."""
    n, k = w.shape
    groups = w.reshape(n, k // 32, 32)
    scale = (groups.abs().amax(-1) / 8).clamp(min=1e-6).half()
    codes = torch.round(groups / scale.float()[..., None] + 8).clamp(0, 15).to(torch.uint8)
    return codes, scale, (scale.float()[..., None] * (codes.float() - 8)).reshape(n, k)


def _reference(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """x rounded to 8 bits per block of 32 (scale max |x| / 127) times the dequantized weights."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(blocks / torch.where(scale > 0, scale, 1)) * scale
    return (xq.reshape(x.shape) @ dense.double().t()).float()


def _cases(q4_0: bool = False):
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.05
        if q4_0:
            codes, scale, dense = _q4_0(w)
            tiles = q4_0_tiles(codes, scale)
        else:
            tiles, dense = _quantized(w)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen) * 3
            x[0, :5] = 0  # exact zeros and a block of them, where k allows
            if k >= 64:
                x[-1, 32:64] = 0
            yield x, tiles, n, dense


def _assert_matches(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    ref = _reference(x, dense)
    # the same integer products and scales, summed in another order: fp32 rounding only
    torch.testing.assert_close(got, ref, atol=1e-4 * ref.abs().max().item() + 1e-6, rtol=1e-4)
    plain = x @ dense.t()  # and close to the product with unrounded x
    assert (got - plain).norm() <= 0.02 * plain.norm() + 1e-6


def test_the_built_kernel_equals_the_reference_for_every_tile_tail_and_row_count(ext):
    for x, tiles, n, dense in _cases():
        y = ext.q4_linear(x, tiles, n)
        assert y.shape == (x.shape[0], n)
        _assert_matches(y, x, dense)


def test_the_built_kernel_refuses_tiles_of_another_shape(ext):
    tiles, _ = _quantized(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="tiles must be"):
        ext.q4_linear(torch.randn(1, 96), tiles, 8)
    with pytest.raises(RuntimeError, match="tiles must be"):
        ext.q4_linear(torch.randn(1, 64), tiles, 9)


@pytest.fixture(scope="module")
def shims(tmp_path_factory):
    """The header built for each instruction set this machine can run: name -> library."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        missing_under_ci("no C++ compiler")
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    folder = tmp_path_factory.mktemp("q4_shims")
    (folder / "shim.cpp").write_text(SHIM)
    libs = {}
    for name, flag in FLAGS.items():
        if not x86 and flag != "-march=native":
            continue
        lib = folder / f"{flag.split('=')[1]}.so"
        subprocess.run([cxx, "-O2", "-std=c++17", "-shared", "-fPIC", flag, f"-I{CSRC}", str(folder / "shim.cpp"), "-o", str(lib)], check=True)
        libs[name] = ctypes.CDLL(str(lib))
    return libs


@pytest.mark.parametrize("q4_0", [False, True], ids=["q4_1 tiles", "q4_0 tiles"])
def test_every_instruction_set_path_equals_the_reference(shims, q4_0):
    for name, lib in shims.items():
        for x, tiles, n, dense in _cases(q4_0):
            y = torch.empty(x.shape[0], n)
            lib.q4_matmul(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]), ctypes.c_int64(x.shape[1]), ctypes.c_void_p(tiles.data_ptr()), ctypes.c_int64(n), ctypes.c_void_p(y.data_ptr()), ctypes.c_int(q4_0))
            try:
                _assert_matches(y, x, dense)
            except AssertionError as exc:
                raise AssertionError(f"the {name} path: {exc}") from None


def test_q4_0_tiles_compute_exactly_their_q4_1_form_in_the_files_bytes(ext):
    # Q4_0's minimum -8 d is worked out in the kernel: the same products as the 20-byte form, from 18
    gen = torch.Generator().manual_seed(5)
    for n, k in SHAPES:
        codes, scale, dense = _q4_0(torch.randn(n, k, generator=gen) * 0.05)
        tiles = q4_0_tiles(codes, scale)
        wide = q4_1_tiles(codes, scale, (scale.float() * -8).half())
        assert tiles.shape[1] * 20 == wide.shape[1] * 18
        for m in ROWS:
            x = torch.randn(m, k, generator=gen)
            assert torch.equal(ext.q4_linear(x, tiles, n), ext.q4_linear(x, wide, n)), (n, k, m)
        layer = Int4Linear.from_q4_0(codes, scale, kernel="cpp")
        assert layer.tiles.shape == tiles.shape and layer.weight_bytes() == n * k // 32 * 18 + (-n % 4) * k // 32 * 18
        other = Int4Linear.from_q4_0(codes, scale, kernel="torch")  # PyTorch's kernel: its Q4_1 form
        x = torch.randn(3, k, generator=gen)
        torch.testing.assert_close(other(x), x @ dense.t(), atol=0.05 * dense.abs().sum(1).max().item(), rtol=0.05)


def test_int4_linear_gives_each_row_the_same_output_at_any_batch_size(ext):
    # the C++ kernel computes every row alone: a request's logits do not depend on its batch
    torch.manual_seed(3)
    # (from 28 rows it takes the interleaved kernel of gguf_blocks.h: the same sums in the same order)
    layer = Int4Linear(nn.Linear(96, 40), kernel="cpp")
    x = torch.randn(40, 96)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
    for m in (7, 27, 28, 33, 40):
        assert torch.equal(layer(x[:m]), alone[:m]), m
    assert layer.kernel == "cpp" and layer.qweight is None  # one copy of the weights


def test_int4_linear_torch_kernel_stays_available_and_agrees(ext):
    torch.manual_seed(4)
    lin = nn.Linear(128, 48, bias=True)
    x = torch.randn(5, 128)
    ours, theirs = Int4Linear(lin, kernel="cpp"), Int4Linear(lin, kernel="torch")
    assert theirs.kernel == "torch" and theirs.tiles is None
    torch.testing.assert_close(ours(x), theirs(x), atol=0.05, rtol=0.05)  # same codes; 8-bit vs bf16 activations
    with pytest.raises(ValueError, match="kernel"):
        Int4Linear(lin, kernel="avx")
