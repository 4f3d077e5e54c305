"""GGUF's quantized block formats multiplied as stored (kernels/csrc/gguf_blocks.h, gguf_linear.cpp):
each type and instruction-set path against ``x_rounded @ dequantize(blocks).T``, the exact
dequantization of selected rows, mixed-type parts, bad inputs, and the decode stack over GGUF
weights against the Python layers.

The engine's build compiles one path (-march=native); the others are built here from the same
header into small shared libraries (AVX2 without VNNI, plain C++), as test_q4_kernel.py does.
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import numpy as np
import pytest
import torch
from torch import nn

from helpers import missing_under_ci
from radixlm.kernels.cpu_ext import CSRC

gguf = pytest.importorskip("gguf")
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4, Q4_Z = 2, 3, 6, 7, 8, 12, 13, 14, 20, 23, 39, 1024
TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4, Q4_Z)
# each type's fp16 fields (byte offsets in a block) and, for Q4_1/Q5_1, which may be negative (a minimum)
HALVES = {Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q5_1: (0, 2), Q8_0: (0,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,),
          IQ4_NL: (0,), IQ4_XS: (0,), MXFP4: (), Q4_Z: (0,)}  # fmt: skip
ROWS = [1, 2, 3, 4, 5, 9, 17, 33]  # every pass size of the kernel (1..4 rows of x), remainders, and 16-row vectors (Q8_0 from 6 rows, the others from 12)
SMALL_SHAPES = [(1, 32), (13, 96), (37, 576), (6, 288)]  # (n, k) for blocks of 32: 1, 3, 18, 9 blocks a row (tails of 8)
K_SHAPES = [(1, 256), (13, 512), (7, 768)]  # super-blocks of 256

SHIM = r"""
#include <vector>
#include "gguf_blocks.h"
extern "C" int gguf_matmul(int type, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n, float* y) {
  if (!radixlm::gguf::supported(type)) return 1;
  std::vector<float> scratch((radixlm::gguf::scratch_bytes(rows, k) + 3) / 4);
  uint8_t* s = reinterpret_cast<uint8_t*>(scratch.data());
  radixlm::gguf::quantize_into(x, rows, k, s);
  radixlm::gguf::matmul_rows(type, w, 0, n, s, rows, k, y, n);
  return 0;
}
extern "C" int gguf_dequant(int type, const uint8_t* w, int64_t n, int64_t k, float* out) {
  if (!radixlm::gguf::supported(type)) return 1;
  int64_t bw, bb;
  radixlm::gguf::block_shape(type, bw, bb);
  for (int64_t r = 0; r < n; ++r) radixlm::gguf::dequantize_row(type, w + r * (k / bw * bb), k, out + r * k);
  return 0;
}
"""
FLAGS = {"avx2 without vnni": "-march=haswell", "plain C++": "-march=x86-64", "native": "-march=native"}


def block_shape(qtype: int) -> tuple[int, int]:
    """(weights, bytes) of one block."""
    return (32, 20) if qtype == Q4_Z else GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """``uint8 [n, row_bytes]`` of valid random blocks: random bytes, sane fp16 scales, Q4_Z zeros in 0..15."""
    weights, nbytes = block_shape(qtype)
    rng = np.random.default_rng(seed * 1000 + qtype)
    blocks = rng.integers(0, 256, size=(n * (k // weights), nbytes), dtype=np.uint8)
    for i, offset in enumerate(HALVES[qtype]):
        values = rng.uniform(0.01, 0.05, size=blocks.shape[0]) * rng.choice([-1.0, 1.0], size=blocks.shape[0])
        if qtype in (Q4_K, Q5_K) or (qtype == Q4_Z and i == 0):
            values = np.abs(values) * (1 if i == 0 else 0.5)
        blocks[:, offset : offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == Q4_Z:
        blocks[:, 2] = rng.integers(0, 16, size=blocks.shape[0])
        blocks[:, 3] = 0
    if qtype == MXFP4:  # E8M0 exponents of 2^-11..2^-4, and the two subnormal ones (0 and 1) in a few blocks
        blocks[:, 0] = rng.integers(117, 125, size=blocks.shape[0])
        blocks[::7, 0] = rng.integers(0, 2, size=len(blocks[::7]))
    return torch.from_numpy(blocks.reshape(n, -1))


def dequantize(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """The published dequantization (gguf's; Q4_Z: d * (q - z)) as float32 [n, k]."""
    data = blocks.numpy()
    if qtype == Q4_Z:
        flat = data.reshape(-1, 20)
        d = flat[:, :2].copy().view(np.float16).astype(np.float32)
        qs = flat[:, 4:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        values = d * (codes - flat[:, 2:3].astype(np.float32))
    else:
        values = gguf_dequantize(data, GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(blocks.shape[0], k))


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x rounded to 8 bits per block of 32 (scale max |x| / 127), as the kernel quantizes it, in float64."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127  # as the kernel: in fp32, codes round(x * (1 / scale))
    inv = torch.where(scale > 0, 1 / scale, 0)
    return (torch.round(blocks * inv).double() * scale.double()).reshape(x.shape)


def assert_matches(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, what: str = "") -> None:
    """``got`` equals the rounded x times ``dense`` up to fp32 summation order, and is close to the unrounded product."""
    xr = rounded(x)
    ref = xr @ dense.double().t()
    bound = xr.abs() @ dense.double().abs().t()  # the sum of the terms' magnitudes: what fp32 rounding scales with
    err = (got.double() - ref).abs()
    assert (err <= 1e-5 * bound + 1e-6).all(), f"{what}: differs from the reference by up to {(err / (bound + 1e-30)).max():.3g} of the terms"
    # and within x's rounding of the unrounded product: each x moved by at most half a step, max |x| / 254 of its block
    step = x.double().abs().reshape(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1) / 254
    err = (got.double() - x.double() @ dense.double().t()).abs()
    assert (err <= step @ dense.double().abs().t() + 1e-5 * bound + 1e-6).all(), f"{what}: far from the unrounded product"


def cases():
    """(type, x, blocks, n, k, dense) for every type, shape and row count (the blocks are the same for every run)."""
    gen = torch.Generator().manual_seed(0)
    for qtype in TYPES:
        shapes = K_SHAPES if block_shape(qtype)[0] == 256 else SMALL_SHAPES
        for s, (n, k) in enumerate(shapes):
            blocks = random_blocks(qtype, n, k, seed=s)
            dense = _dense(qtype, n, k, s)
            for m in ROWS:
                x = torch.randn(m, k, generator=gen) * 3
                x[0, :5] = 0  # exact zeros, and a block of them where k allows
                if k >= 64:
                    x[-1, 32:64] = 0
                yield qtype, x, blocks, n, k, dense


_DENSE: dict = {}


def _dense(qtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    key = (qtype, n, k, seed)
    if key not in _DENSE:
        _DENSE[key] = dequantize(random_blocks(qtype, n, k, seed), qtype, k)
    return _DENSE[key]


@pytest.fixture(scope="module")
def shims(tmp_path_factory):
    """The header built for each instruction set this machine can run: name -> library."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        missing_under_ci("no C++ compiler")
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    folder = tmp_path_factory.mktemp("gguf_shims")
    (folder / "shim.cpp").write_text(SHIM)
    libs = {}
    for name, flag in FLAGS.items():
        if not x86 and flag != "-march=native":
            continue
        lib = folder / f"{flag.split('=')[1]}.so"
        subprocess.run([cxx, "-O2", "-std=c++17", "-shared", "-fPIC", flag, f"-I{CSRC}", str(folder / "shim.cpp"), "-o", str(lib)], check=True)
        libs[name] = ctypes.CDLL(str(lib))
    return libs


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def test_every_instruction_set_path_equals_the_reference_for_every_type(shims):
    for name, lib in shims.items():
        for qtype, x, blocks, n, k, dense in cases():
            y = torch.empty(x.shape[0], n)
            rc = lib.gguf_matmul(qtype, _ptr(x), ctypes.c_int64(x.shape[0]), ctypes.c_int64(k), _ptr(blocks), ctypes.c_int64(n), _ptr(y))
            assert rc == 0
            assert_matches(y, x, dense, f"the {name} path, type {qtype}, n={n} k={k} m={x.shape[0]}")


def test_every_instruction_set_path_dequantizes_exactly(shims):
    for name, lib in shims.items():
        for qtype in TYPES:
            k = 512 if block_shape(qtype)[0] == 256 else 96
            blocks = random_blocks(qtype, 5, k, seed=7)
            out = torch.empty(5, k)
            assert lib.gguf_dequant(qtype, _ptr(blocks), ctypes.c_int64(5), ctypes.c_int64(k), _ptr(out)) == 0
            ref = dequantize(blocks, qtype, k)
            assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), f"the {name} path, type {qtype}: not bit for bit"
        assert lib.gguf_matmul(16, None, 1, 256, None, 1, None) == 1  # IQ2_XXS: not ours


# ---- the torch entry points of the engine's build ----


@pytest.fixture(scope="module")
def ext(cpp_ext):
    if not hasattr(cpp_ext, "gguf_linear"):
        pytest.fail("the C++ kernels have no gguf_linear")
    return cpp_ext


def test_the_built_kernel_equals_the_reference_for_every_type(ext):
    assert sorted(ext.gguf_native_types()) == sorted(TYPES)
    for qtype, x, blocks, n, k, dense in cases():
        y = ext.gguf_linear(x, [blocks], [qtype], n)
        assert y.shape == (x.shape[0], n)
        assert_matches(y, x, dense, f"type {qtype}, n={n} k={k} m={x.shape[0]}")


def test_parts_of_mixed_types_fill_their_own_rows(ext):
    k = 512
    parts = [(Q4_K, random_blocks(Q4_K, 40, k, 1)), (Q6_K, random_blocks(Q6_K, 9, k, 2)), (Q4_K, random_blocks(Q4_K, 23, k, 3)), (Q8_0, random_blocks(Q8_0, 5, k, 4))]
    dense = torch.cat([dequantize(b, t, k) for t, b in parts])
    for m in (1, 3, 8):
        x = torch.randn(m, k)
        y = ext.gguf_linear(x, [b for _, b in parts], [t for t, _ in parts], dense.shape[0])
        assert_matches(y, x, dense, f"mixed parts, m={m}")
    # each row is computed alone: a row's output does not depend on the batch it came in
    x = torch.randn(6, k)
    y = ext.gguf_linear(x, [b for _, b in parts], [t for t, _ in parts], dense.shape[0])
    alone = torch.cat([ext.gguf_linear(x[i : i + 1], [b for _, b in parts], [t for t, _ in parts], dense.shape[0]) for i in range(6)])
    assert torch.equal(y, alone)


def test_every_type_gives_each_row_the_same_output_at_any_batch_size(ext):
    # from 6 rows of x (Q8_0) or 12 (the others), a type takes another kernel (x interleaved, 16
    # rows a vector, weight rows decoded once per tile of 4): it must sum every row as the one-row
    # kernel does, for rows of whole chunks of 8 blocks and with a tail, and for a range of weight
    # rows that does not fill its tiles
    for qtype in TYPES:
        shapes = ((13, 512), (9, 1024)) if block_shape(qtype)[0] == 256 else ((37, 96), (9, 576), (22, 1024))
        for n, k in shapes:
            blocks = random_blocks(qtype, n, k, seed=3)
            dense = dequantize(blocks, qtype, k)
            x = torch.randn(37, k) * 2
            x[3] = 0
            y = ext.gguf_linear(x, [blocks], [qtype], n)
            assert_matches(y, x, dense, f"type {qtype} n={n} k={k} m=37")
            alone = torch.cat([ext.gguf_linear(x[i : i + 1], [blocks], [qtype], n) for i in range(x.shape[0])])
            assert torch.equal(y, alone), f"type {qtype} n={n} k={k}: rows differ by up to {(y - alone).abs().max():.3g} from their own"
            for m in (6, 11, 12, 16, 20):
                assert torch.equal(ext.gguf_linear(x[:m], [blocks], [qtype], n), alone[:m]), f"type {qtype} n={n} k={k} m={m}"


def test_dequantize_rows_equals_gguf_bit_for_bit(ext):
    for qtype in TYPES:
        k = 768 if block_shape(qtype)[0] == 256 else 576
        blocks = random_blocks(qtype, 50, k, seed=5)
        ids = torch.tensor([3, 0, 49, 3, 17])
        got = ext.gguf_dequantize_rows(blocks, qtype, ids, k)
        ref = dequantize(blocks[ids], qtype, k)
        assert got.shape == (5, k)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), f"type {qtype}: not bit for bit"
    with pytest.raises(RuntimeError, match="out of range"):
        ext.gguf_dequantize_rows(blocks, qtype, torch.tensor([50]), k)


def test_bad_inputs_are_refused_with_their_reason(ext):
    x = torch.randn(2, 256)
    q4k = random_blocks(Q4_K, 4, 256)
    with pytest.raises(RuntimeError, match="unsupported GGUF type 16"):
        ext.gguf_linear(x, [q4k], [16], 4)
    with pytest.raises(RuntimeError, match="unsupported GGUF type 16"):
        ext.gguf_dequantize_rows(q4k, 16, torch.tensor([0]), 256)
    with pytest.raises(RuntimeError, match="144 bytes"):  # one Q4_K super-block a row, the blocks are of another type
        ext.gguf_linear(x, [random_blocks(Q8_0, 4, 256)], [Q4_K], 4)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ext.gguf_linear(torch.randn(2, 96), [random_blocks(Q8_0, 4, 96)], [Q4_K], 4)
    with pytest.raises(RuntimeError, match="rows"):
        ext.gguf_linear(x, [q4k], [Q4_K], 5)
    with pytest.raises(RuntimeError, match="one type per part"):
        ext.gguf_linear(x, [q4k, q4k], [Q4_K], 8)
    with pytest.raises(RuntimeError, match="uint8"):
        ext.gguf_linear(x, [q4k.float()], [Q4_K], 4)
    with pytest.raises(RuntimeError, match="float32"):
        ext.gguf_linear(x.double(), [q4k], [Q4_K], 4)
    with pytest.raises(RuntimeError, match="row_bytes"):
        ext.gguf_dequantize_rows(q4k, Q4_K, torch.tensor([0]), 512)


# ---- the decode stack over GGUF weights ----


class _GGUFLayer(nn.Module):
    """A linear over GGUF parts as the GGUF layer computes it: ``gguf_linear``, then the bias."""

    def __init__(self, parts: list[tuple[int, torch.Tensor]], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.types = [t for t, _ in parts]
        self.parts = [b for _, b in parts]
        self.n = sum(b.shape[0] for b in self.parts)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from radixlm.kernels.cpu_ext import cpu_kernels

        y = cpu_kernels().gguf_linear(x.reshape(-1, x.shape[-1]).float(), self.parts, self.types, self.n).reshape(*x.shape[:-1], self.n)
        return y if self.bias is None else y + self.bias

    def decode_weight(self, rows: int):
        from radixlm.runtime.layers.decode_stack import GGUFStackWeight

        return GGUFStackWeight(self.parts, self.types, self.n, self.bias)


def _quantized(w: torch.Tensor, qtype: int) -> tuple[int, torch.Tensor]:
    from gguf.quants import quantize

    return qtype, torch.from_numpy(quantize(w.detach().float().numpy(), GGMLQuantizationType(qtype)))


def _gguf_decode_logits(model_path: str, stack: bool) -> tuple[list[torch.Tensor], int]:
    """Every forward's logits while two prompts decode greedily with the model's linears as GGUF
    parts of several types (q/k/v with a bias), and how many forwards the stack ran."""
    from radixlm.runtime.engine import build_parts
    from radixlm.runtime.request import Req
    from radixlm.runtime.sampling_params import SamplingParams
    from radixlm.runtime.server_args import ServerArgs

    rt = build_parts(ServerArgs(model_path=model_path, max_total_tokens=512, disable_decode_stack=not stack))
    model = rt.runner.model
    gen = torch.Generator().manual_seed(0)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        w, q, kv = attn.qkv_proj.weight, attn.q_size, attn.kv_size
        bias = torch.randn(w.shape[0], generator=gen) * 0.1
        attn.qkv_proj = _GGUFLayer([_quantized(w[:q], Q8_0), _quantized(w[q : q + kv], Q4_0), _quantized(w[q + kv :], Q5_1)], bias)
        attn.o_proj = _GGUFLayer([_quantized(attn.o_proj.weight, Q5_0)])
        half = mlp.gate_up_proj.weight.shape[0] // 2
        mlp.gate_up_proj = _GGUFLayer([_quantized(mlp.gate_up_proj.weight[:half], Q4_1), _quantized(mlp.gate_up_proj.weight[half:], Q8_0)])
        mlp.down_proj = _GGUFLayer([_quantized(mlp.down_proj.weight, Q8_0)])
    model.decode_stacks.clear()
    stacks = model.decode_stacks
    original, ran = stacks.run, [0]

    def run(x, rope, batch):
        out = original(x, rope, batch)
        ran[0] += out is not None
        return out

    stacks.run = run
    logits = []
    forward = rt.runner.forward
    rt.runner.forward = lambda batch: logits.append(forward(batch)) or logits[-1]
    for i, ids in enumerate(([5, 9, 14, 3, 22, 40, 7], [31, 8, 8, 60, 2])):
        rt.scheduler.add(Req(rid=str(i), input_ids=ids, params=SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True), sink=lambda out: None))
    while rt.scheduler.waiting or rt.scheduler.running:
        rt.scheduler.step()
    return logits, ran[0]


def test_the_decode_stack_over_gguf_parts_gives_the_python_layers_logits_bit_for_bit(ext, tiny_llama):
    fused, ran = _gguf_decode_logits(tiny_llama, True)
    plain, ran_plain = _gguf_decode_logits(tiny_llama, False)
    assert ran >= 5 and ran_plain == 0
    assert len(fused) == len(plain)
    for step, (a, b) in enumerate(zip(fused, plain)):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b), f"forward {step}: the stack's logits differ by up to {(a - b).abs().max():.3g}"


def test_a_gguf_stack_weight_reaches_the_stack_as_parts_and_types(ext):
    from radixlm.runtime.layers.decode_stack import GGUFStackWeight, stack_weight

    layer = _GGUFLayer([_quantized(torch.randn(8, 64), Q8_0), _quantized(torch.randn(4, 64), Q4_0)])
    w = stack_weight(layer, 1)
    assert isinstance(w, GGUFStackWeight) and w.types == [Q8_0, Q4_0] and w.n == 12 and w.bias is None
    stack = ext.DecodeStack(1, 1, 4)  # q/k/v: 4 + 2 * 4 = 12 rows
    norms, eps = [torch.ones(64), torch.ones(64), None, None, None, None], [1e-6] * 6
    plain = (0, 0.5, 0.0, None, "silu")  # RoPE table 0, scale, no soft-cap, no sinks, SiLU
    with pytest.raises(RuntimeError, match="rows in all"):  # parts that do not make n rows
        stack.add_layer(norms, eps, w.parts, w.types, 12, None, w.parts, w.types, 13, w.parts, w.types, 12, w.parts, w.types, 12, *plain)
    with pytest.raises(RuntimeError, match="one type per part"):
        stack.add_layer(norms, eps, w.parts, [Q8_0], 12, None, w.parts, w.types, 12, w.parts, w.types, 12, w.parts, w.types, 12, *plain)
