"""The Triton attention kernels, run on CPU tensors under Triton's interpreter, against PyTorch.

Shapes are tiny and q is fp32 (the interpreter's bf16 ``tl.dot`` is not trustworthy); pools are
fp32, or bf16/int8/fp8 read by fp32 dots. Every kernel launch costs a fraction of a second here,
so each test launches only a few.
"""

import inspect
import os
import subprocess
import sys

# Must be set before triton is first imported: triton.language and every @triton.jit kernel
# choose between the interpreter and GPU compilation when they are defined.
_TRITON_IMPORTED_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("CI"):  # CI installs Triton: a failed install must fail the run, not skip these
    import triton
else:
    triton = pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot run")
if _TRITON_IMPORTED_EARLY:
    pytest.fail(
        "triton was imported before this module set TRITON_INTERPRET=1, so its kernels are built for a "
        "GPU; set TRITON_INTERPRET=1 in conftest.py or run this file in its own pytest process",
        pytrace=False,
    )

from radixlm.kernels.attention import reference_attention  # noqa: E402
from radixlm.kernels.triton_decode import decode_attention  # noqa: E402
from radixlm.kernels.triton_extend import extend_attention  # noqa: E402
from radixlm.radix_cache.pool import KVPool  # noqa: E402
from radixlm.runtime.layers.attention import TorchAttentionBackend, select_attention_backend  # noqa: E402
from radixlm.runtime.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixlm.runtime.layers.forward_batch import ForwardBatch  # noqa: E402

pytestmark = pytest.mark.triton

NUM_HEADS = 4
HEAD_DIM = 24  # not a power of two: exercises the BLOCK_D masking
TOL = {"atol": 2e-5, "rtol": 2e-5}


def _scattered_table(seq_lens: list[int], num_slots: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A slot table whose rows (in shuffled order) map to shuffled, non-contiguous pool slots."""
    num_rows = len(seq_lens) + 2
    table = torch.zeros(num_rows, max(seq_lens) + 3, dtype=torch.int64)
    rows = torch.randperm(num_rows, generator=gen)[: len(seq_lens)]
    free = torch.randperm(num_slots - 1, generator=gen) + 1  # slot 0 is the pad slot
    used = 0
    for row, length in zip(rows.tolist(), seq_lens):
        table[row, :length] = free[used : used + length]
        used += length
    return table, rows


def _random_pool(
    num_kv: int, gen: torch.Generator, num_slots: int = 160, num_layers: int = 1, kv_format: str = "auto"
) -> KVPool:
    """A pool of random K/V (fp32 model), written through ``pool.write`` so 8-bit ones get their scales."""
    pool = KVPool(num_slots, num_layers, num_kv, HEAD_DIM, torch.float32, kv_format=kv_format)
    slots = torch.arange(num_slots)
    for layer in range(num_layers):
        k, v = (torch.randn(num_slots, num_kv, HEAD_DIM, generator=gen) * 3 for _ in range(2))
        pool.write(layer, slots, k, v)
    return pool


@pytest.mark.parametrize("group", [1, 2])
def test_split_kv_decode_matches_reference_for_ragged_lengths_and_gqa(group: int) -> None:
    """Decode over 3 KV splits: rows of length 1 and 17 leave empty splits the reduce must skip."""
    gen = torch.Generator().manual_seed(group)
    seq_lens = [1, 5, 17, 40]
    pool = _random_pool(NUM_HEADS // group, gen)
    table, rows = _scattered_table(seq_lens, pool.num_slots, gen)
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM, generator=gen)
    out = torch.full_like(q, float("nan"))
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    decode_attention(q, pool.k[0], pool.v[0], table, rows, lens, out, num_splits=3)
    for b, length in enumerate(seq_lens):
        want = reference_attention(q[b : b + 1], pool.k[0], pool.v[0], table[rows[b], :length], length - 1)
        torch.testing.assert_close(out[b : b + 1], want, **TOL)


def test_the_split_count_is_a_runtime_argument_so_any_count_reuses_the_kernels() -> None:
    """No recompilation per split count (and a CUDA graph captured with one count stays right for
    any lengths): the counts 1, 2 and 5 give the reference result through the same kernels."""
    from radixlm.kernels.triton_decode import _decode_reduce_kernel, _decode_split_kernel

    for kernel in (_decode_split_kernel, _decode_reduce_kernel):
        params = inspect.signature(kernel.fn).parameters  # the Python function, JIT or interpreted
        assert "num_splits" in params and "constexpr" not in str(params["num_splits"].annotation)
    gen = torch.Generator().manual_seed(7)
    seq_lens = [3, 33]
    pool = _random_pool(NUM_HEADS, gen)
    table, rows = _scattered_table(seq_lens, pool.num_slots, gen)
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    for splits in (1, 2, 5):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, pool.k[0], pool.v[0], table, rows, lens, out, num_splits=splits)
        for b, length in enumerate(seq_lens):
            want = reference_attention(q[b : b + 1], pool.k[0], pool.v[0], table[rows[b], :length], length - 1)
            torch.testing.assert_close(out[b : b + 1], want, **TOL)


@pytest.mark.parametrize("group", [1, 2])
def test_extend_is_causal_over_cached_prefix_and_new_tokens(group: int) -> None:
    """Extend rows with and without a prefix, spanning several query and key blocks."""
    gen = torch.Generator().manual_seed(10 + group)
    prefixes, extends = [0, 7, 19, 0], [5, 20, 1, 18]
    seq_lens = [p + e for p, e in zip(prefixes, extends)]
    pool = _random_pool(NUM_HEADS // group, gen)
    table, rows = _scattered_table(seq_lens, pool.num_slots, gen)
    starts = [sum(extends[:i]) for i in range(len(extends))]
    q = torch.randn(sum(extends), NUM_HEADS, HEAD_DIM, generator=gen)
    out = torch.full_like(q, float("nan"))
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    extend_attention(q, pool.k[0], pool.v[0], out, table, rows, i32(prefixes), i32(extends), i32(starts), max(extends))
    for i, (p, e) in enumerate(zip(prefixes, extends)):
        s = starts[i]
        want = reference_attention(q[s : s + e], pool.k[0], pool.v[0], table[rows[i], : p + e], p)
        torch.testing.assert_close(out[s : s + e], want, **TOL)


def _backend_forward(backend, pool: KVPool, layer: int, qkv, table, rows, out_slots, prefixes, extends, num_decode: int) -> torch.Tensor:
    """One attention layer of a batch (decode rows first) through ``backend``'s forward."""
    q, k, v = qkv
    num_tokens = int(out_slots.numel())
    batch = ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefixes, extends)]),
        out_slots=out_slots,
        req_rows=rows,
        prefix_lens=prefixes,
        extend_lens=extends,
        num_decode=num_decode,
        logits_indices=torch.arange(num_tokens),
        req_to_token=table,
        kv_pool=pool,
        attn_backend=backend,
    )
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, layer, batch)


def test_backend_mixed_batch_matches_torch_backend_and_writes_pool() -> None:
    """Decode + extend rows through TritonAttentionBackend.forward equal TorchAttentionBackend's."""
    gen = torch.Generator().manual_seed(7)
    group, layer = 2, 1
    num_kv = NUM_HEADS // group
    prefixes, extends = [0, 8, 32, 0, 11], [1, 1, 1, 13, 6]  # rows 0-2 decode, 3-4 extend
    seq_lens = [p + e for p, e in zip(prefixes, extends)]
    pool = _random_pool(num_kv, gen, num_layers=2)
    table, rows = _scattered_table(seq_lens, pool.num_slots, gen)
    out_slots = torch.cat([table[r, p : p + e] for r, p, e in zip(rows.tolist(), prefixes, extends)])
    num_tokens = int(out_slots.numel())
    # q/k/v are strided views of one fused projection, as the model hands them over.
    qkv = torch.randn(num_tokens, (NUM_HEADS + 2 * num_kv) * HEAD_DIM, generator=gen)
    q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, num_kv * HEAD_DIM, num_kv * HEAD_DIM], dim=-1)
    q, k, v = (t.view(num_tokens, -1, HEAD_DIM) for t in (q, k, v))

    def run(backend, kv_pool: KVPool) -> torch.Tensor:
        return _backend_forward(backend, kv_pool, layer, (q, k, v), table, rows, out_slots, prefixes, extends, num_decode=3)

    torch_pool = KVPool(pool.num_slots, 2, num_kv, HEAD_DIM, torch.float32)
    for src, dst in zip(pool.k + pool.v, torch_pool.k + torch_pool.v):
        dst.copy_(src)
    triton_backend = TritonAttentionBackend(min_split_tokens=16)  # the 33-token row takes 3 splits
    got = run(triton_backend, pool)
    want = run(TorchAttentionBackend(), torch_pool)
    assert got.shape == (num_tokens, NUM_HEADS * HEAD_DIM)
    assert pool.k[layer][out_slots].equal(k) and pool.v[layer][out_slots].equal(v)
    torch.testing.assert_close(got, want, **TOL)
    start = 0
    for r, p, e in zip(rows.tolist(), prefixes, extends):
        ref = reference_attention(q[start : start + e], pool.k[layer], pool.v[layer], table[r, : p + e], p)
        torch.testing.assert_close(got[start : start + e].view(e, NUM_HEADS, HEAD_DIM), ref, **TOL)
        start += e


def test_select_attention_backend_returns_triton_backend_on_request() -> None:
    """``attention_backend='triton'`` gives the Triton backend when triton is installed."""
    assert isinstance(select_attention_backend("triton", torch.device("cpu")), TritonAttentionBackend)


def test_importing_radixlm_never_imports_triton() -> None:
    """The package and its kernels module load on machines without a GPU without touching triton."""
    code = "import sys, radixlm, radixlm.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    assert result.returncode == 0, result.stderr


def test_tiny_model_generates_the_same_tokens_with_the_triton_backend(tiny_llama):
    """The whole engine path (pool writes, mixed decode/extend rows) on the Triton kernels."""
    from helpers import Driver
    from radixlm import ServerArgs
    from radixlm.runtime.engine import build_parts

    outputs = {}
    for backend in ("torch", "triton"):
        rt = build_parts(ServerArgs(model_path=tiny_llama, max_total_tokens=256, attention_backend=backend))
        d = Driver(rt)
        a = d.add([5, 9, 30, 41, 7, 8], max_new_tokens=3, temperature=0, ignore_eos=True)
        d.step()  # the first request decodes while the second (sharing its prefix) is prefilled
        b = d.add([5, 9, 30, 41, 7, 8, 60, 61, 62], max_new_tokens=2, temperature=0, ignore_eos=True)
        d.run()
        outputs[backend] = (d.results[a].output_ids, d.results[b].output_ids)
    assert outputs["triton"] == outputs["torch"]


# A 16-bit pool under an fp32 model (q fp32, K/V bf16) and the 8-bit formats with their scales.
QUANTIZED_FORMATS = ["int8", "fp8_e4m3", "bfloat16"]


@pytest.mark.parametrize("kv_format", QUANTIZED_FORMATS)
def test_decode_on_quantized_pool_matches_reference_on_dequantized_pool(kv_format: str) -> None:
    """Decode reads the pool as stored and dequantizes per block: equal to attention over ``pool.read``."""
    gen = torch.Generator().manual_seed(20)
    seq_lens = [1, 17, 40]
    pool = _random_pool(NUM_HEADS // 2, gen, kv_format=kv_format)
    k_deq, v_deq = pool.read(0, slice(None), torch.float32)
    table, rows = _scattered_table(seq_lens, pool.num_slots, gen)
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM, generator=gen)
    out = torch.full_like(q, float("nan"))
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    decode_attention(q, pool.k[0], pool.v[0], table, rows, lens, out, 2, k_scale=pool.k_scale[0], v_scale=pool.v_scale[0])
    for b, length in enumerate(seq_lens):
        want = reference_attention(q[b : b + 1], k_deq, v_deq, table[rows[b], :length], length - 1)
        torch.testing.assert_close(out[b : b + 1], want, **TOL)


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "bfloat16"])  # int8: the backend test's extend row
def test_extend_on_quantized_pool_matches_reference_on_dequantized_pool(kv_format: str) -> None:
    """Extend over a cached prefix on a quantized pool equals attention over ``pool.read``."""
    gen = torch.Generator().manual_seed(21)
    prefixes, extends = [0, 19], [18, 3]
    seq_lens = [p + e for p, e in zip(prefixes, extends)]
    pool = _random_pool(NUM_HEADS // 2, gen, kv_format=kv_format)
    k_deq, v_deq = pool.read(0, slice(None), torch.float32)
    table, rows = _scattered_table(seq_lens, pool.num_slots, gen)
    starts = [sum(extends[:i]) for i in range(len(extends))]
    q = torch.randn(sum(extends), NUM_HEADS, HEAD_DIM, generator=gen)
    out = torch.full_like(q, float("nan"))
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    extend_attention(
        q, pool.k[0], pool.v[0], out, table, rows, i32(prefixes), i32(extends), i32(starts), max(extends),
        k_scale=pool.k_scale[0], v_scale=pool.v_scale[0],
    )
    for i, (p, e) in enumerate(zip(prefixes, extends)):
        s = starts[i]
        want = reference_attention(q[s : s + e], k_deq, v_deq, table[rows[i], : p + e], p)
        torch.testing.assert_close(out[s : s + e], want, **TOL)


def test_kernels_refuse_an_8bit_pool_without_its_scales() -> None:
    """Reading int8 values without their scales would be silently wrong: both kernels raise instead."""
    gen = torch.Generator().manual_seed(22)
    pool = _random_pool(NUM_HEADS, gen, num_slots=8, kv_format="int8")
    one = torch.ones(1, dtype=torch.int32)
    table, rows = torch.ones(1, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    q = torch.randn(1, NUM_HEADS, HEAD_DIM, generator=gen)
    with pytest.raises(ValueError, match="needs its k_scale and v_scale"):
        decode_attention(q, pool.k[0], pool.v[0], table, rows, one, torch.empty_like(q), 1)
    with pytest.raises(ValueError, match="needs its k_scale and v_scale"):
        extend_attention(q, pool.k[0], pool.v[0], torch.empty_like(q), table, rows, one * 0, one, one * 0, 1)


def test_backend_mixed_batch_on_int8_pool_matches_reference_on_dequantized_pool() -> None:
    """TritonAttentionBackend.forward quantizes the new KV once and attends over the int8 pool with its scales."""
    gen = torch.Generator().manual_seed(23)
    layer, num_kv = 1, NUM_HEADS // 2
    prefixes, extends = [0, 20, 9], [1, 1, 7]  # rows 0-1 decode, 2 extend
    seq_lens = [p + e for p, e in zip(prefixes, extends)]
    pool = _random_pool(num_kv, gen, num_layers=2, kv_format="int8")
    table, rows = _scattered_table(seq_lens, pool.num_slots, gen)
    out_slots = torch.cat([table[r, p : p + e] for r, p, e in zip(rows.tolist(), prefixes, extends)])
    num_tokens = int(out_slots.numel())
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(num_tokens, num_kv, HEAD_DIM, generator=gen) for _ in range(2))
    backend = TritonAttentionBackend(min_split_tokens=16)  # the 21-token row takes 2 splits
    got = _backend_forward(backend, pool, layer, (q, k, v), table, rows, out_slots, prefixes, extends, num_decode=2)
    got = got.view(num_tokens, NUM_HEADS, HEAD_DIM)
    assert pool.k[layer].dtype == torch.int8
    k_new, _ = pool.read(layer, out_slots, torch.float32)
    torch.testing.assert_close(k_new, k, atol=0.03 * k.abs().max().item(), rtol=0)  # stored, quantized
    k_deq, v_deq = pool.read(layer, slice(None), torch.float32)
    start = 0
    for r, p, e in zip(rows.tolist(), prefixes, extends):
        want = reference_attention(q[start : start + e], k_deq, v_deq, table[r, : p + e], p)
        torch.testing.assert_close(got[start : start + e], want, **TOL)
        start += e
