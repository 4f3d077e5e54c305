"""The Triton attention kernels, run on CPU tensors under Triton's interpreter, against PyTorch.

Shapes are tiny and q is fp32 (the interpreter's bf16 ``tl.dot`` is not trustworthy); pools are
fp32, or bf16/int8/fp8 read by fp32 dots. Every kernel launch costs a fraction of a second here,
so each test launches only a few. The reference is a dense fp64 attention written here
(``reference_attention``), with the attention spec's scale, sliding window, soft-cap and sinks.
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

from radixlm.kernels import triton_decode, triton_extend  # noqa: E402
from radixlm.kernels.triton_decode import decode_attention  # noqa: E402
from radixlm.kernels.triton_extend import extend_attention  # noqa: E402
from radixlm.radix_cache.pool import KVPool  # noqa: E402
from radixlm.runtime.layers.attention import TorchAttentionBackend, select_attention_backend  # noqa: E402
from radixlm.runtime.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixlm.runtime.layers.attention_spec import AttentionSpec  # noqa: E402
from radixlm.runtime.layers.forward_batch import ForwardBatch  # noqa: E402

pytestmark = pytest.mark.triton

NUM_HEADS = 4
HEAD_DIM = 24  # not a power of two: exercises the BLOCK_D masking
TOL = {"atol": 2e-5, "rtol": 2e-5}


def reference_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    prefix_len: int,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense fp64 attention of one row (transformers' eager rules): ``q`` ``[e, H, D]`` at positions
    ``prefix_len ..`` over the keys at ``slots`` ``[p + e]``; returns fp32 ``[e, H, D]``."""
    e, num_heads, head_dim = q.shape
    group = num_heads // k_pool.shape[1]
    k = k_pool[slots].double().repeat_interleave(group, dim=1)  # [n, H, D]
    v = v_pool[slots].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("ehd,nhd->hen", q.double(), k) * (head_dim**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = prefix_len + torch.arange(e)[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= q_pos - k_pos < window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_col = sinks.double()[:, None, None].expand(num_heads, e, 1)
        probs = torch.softmax(torch.cat([scores, sink_col], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return torch.einsum("hen,nhd->ehd", probs, v).float()


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


def _backend_forward(
    backend, pool: KVPool, layer: int, qkv, table, rows, out_slots, prefixes, extends, num_decode: int, spec: AttentionSpec | None = None
) -> torch.Tensor:
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
    return backend.forward(q, k, v, layer, batch, spec)


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


# ------------------------------------------------------------ attention specs (scale, window, softcap, sinks)
WINDOW = 13  # not a multiple of the interpreter's 16-token blocks
SINKS = torch.tensor([-2.0, 0.0, 1.5, 30.0])  # per head (a wrong head index shows); 30 outweighs every score
i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731


def _decode_case(seed: int, seq_lens: list[int], num_kv: int = NUM_HEADS // 2, kv_format: str = "auto", q_scale: float = 1.0):
    """A pool, a scattered slot table, decode queries and the pool's K/V as fp32 for the reference."""
    gen = torch.Generator().manual_seed(seed)
    pool = _random_pool(num_kv, gen, kv_format=kv_format)
    table, rows = _scattered_table(seq_lens, pool.num_slots, gen)
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM, generator=gen) * q_scale
    k_ref, v_ref = pool.read(0, slice(None), torch.float32)
    return pool, table, rows, q, k_ref, v_ref


def _check_decode(seq_lens: list[int], num_splits: int, seed: int = 30, kv_format: str = "auto", q_scale: float = 1.0, **spec) -> None:
    """Decode rows of ``seq_lens`` through ``num_splits`` splits under ``spec``, against the dense reference."""
    pool, table, rows, q, k_ref, v_ref = _decode_case(seed, seq_lens, kv_format=kv_format, q_scale=q_scale)
    out = torch.full_like(q, float("nan"))
    decode_attention(
        q, pool.k[0], pool.v[0], table, rows, i32(seq_lens), out, num_splits,
        k_scale=pool.k_scale[0], v_scale=pool.v_scale[0], **spec,
    )
    for b, length in enumerate(seq_lens):
        want = reference_attention(q[b : b + 1], k_ref, v_ref, table[rows[b], :length], length - 1, **spec)
        torch.testing.assert_close(out[b : b + 1], want, **TOL, msg=lambda m, b=b: f"decode row {b} (length {seq_lens[b]}): {m}")


def _check_extend(prefixes: list[int], extends: list[int], seed: int = 40, kv_format: str = "auto", q_scale: float = 1.0, **spec) -> None:
    """Extend rows (``prefixes`` cached, ``extends`` new) under ``spec``, against the dense reference."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefixes, extends)]
    pool = _random_pool(NUM_HEADS // 2, gen, kv_format=kv_format)
    k_ref, v_ref = pool.read(0, slice(None), torch.float32)
    table, rows = _scattered_table(seq_lens, pool.num_slots, gen)
    starts = [sum(extends[:i]) for i in range(len(extends))]
    q = torch.randn(sum(extends), NUM_HEADS, HEAD_DIM, generator=gen) * q_scale
    out = torch.full_like(q, float("nan"))
    extend_attention(
        q, pool.k[0], pool.v[0], out, table, rows, i32(prefixes), i32(extends), i32(starts), max(extends),
        k_scale=pool.k_scale[0], v_scale=pool.v_scale[0], **spec,
    )
    for i, (p, e) in enumerate(zip(prefixes, extends)):
        s = starts[i]
        want = reference_attention(q[s : s + e], k_ref, v_ref, table[rows[i], : p + e], p, **spec)
        torch.testing.assert_close(out[s : s + e], want, **TOL, msg=lambda m, i=i: f"extend row {i} (prefix {prefixes[i]}, new {extends[i]}): {m}")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_sliding_window_sees_only_the_last_window_positions(num_splits: int) -> None:
    """Rows shorter than, equal to, one past and far past the window; 3 splits share the window's range."""
    _check_decode([1, 5, WINDOW, WINDOW + 1, 40, 47], num_splits, window=WINDOW)


@pytest.mark.parametrize("blocks", [None, (32, 16, 4)])
def test_extend_sliding_window_over_prompts_and_cached_prefixes(blocks, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts shorter than, equal to and longer than the window (over several query blocks),
    prefixes inside the window and past it: each query sees exactly its last WINDOW positions.
    With query blocks taller than key blocks (as on GPUs for fp32 at D > 128) a block's later
    queries see no key of its first step: their empty rows must give 0, not NaN."""
    if blocks is not None:
        monkeypatch.setattr(triton_extend, "extend_block_sizes", lambda *_: blocks)
    _check_extend([0, 0, 0, 7, 30, 3], [5, WINDOW, 40, 3, 20, 1], window=WINDOW)


def test_window_of_one_sees_only_the_token_itself() -> None:
    """The smallest window: each query's output is its own value row (decode and extend)."""
    _check_decode([1, 20], 2, window=1)
    _check_extend([0, 17], [18, 2], window=1)


def test_softcap_caps_scores_in_decode_and_extend() -> None:
    """A soft-cap small enough to change every row (scores here reach well past it)."""
    _check_decode([1, 17, 40], 3, softcap=2.0)
    _check_extend([0, 19], [18, 3], softcap=2.0)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")  # the interpreter's numpy exp2
def test_softcap_tanh_stays_finite_for_huge_scores() -> None:
    """Scores around ±1e5 before the cap: the exp-based tanh saturates to ±1 instead of giving NaN."""
    _check_decode([1, 17, 40], 2, q_scale=1e4, softcap=5.0)
    _check_extend([0, 19], [18, 3], q_scale=1e4, softcap=5.0)


def test_sinks_join_the_denominator_in_decode_reduce_and_extend() -> None:
    """Per-head sink logits from small to dominant, over several decode splits and extend blocks."""
    _check_decode([1, 17, 40], 3, sinks=SINKS)
    _check_extend([0, 19], [18, 3], sinks=SINKS)


def test_custom_scale_replaces_the_default() -> None:
    """A family's own scale (Gemma's query_pre_attn_scalar style) instead of head_dim ** -0.5."""
    _check_decode([5, 40], 3, scale=0.5)
    _check_extend([0, 19], [18, 3], scale=0.5)


@pytest.mark.parametrize("kv_format", ["int8", "fp8_e4m3", "bfloat16"])
def test_every_spec_feature_together_on_quantized_pools(kv_format: str) -> None:
    """Scale, window, soft-cap and sinks at once over 8-bit (with scales) and 16-bit pools."""
    spec = {"scale": 0.3, "window": WINDOW, "softcap": 4.0, "sinks": SINKS}
    _check_decode([1, WINDOW, 40], 3, kv_format=kv_format, **spec)
    _check_extend([0, 19], [18, 3], kv_format=kv_format, **spec)


def test_kernels_refuse_malformed_spec_arguments() -> None:
    """Sinks not ``[H]``, a negative window or soft-cap raise instead of reading out of bounds."""
    pool, table, rows, q, _, _ = _decode_case(50, [3])
    args = (q, pool.k[0], pool.v[0], table, rows, i32([3]), torch.empty_like(q), 1)
    with pytest.raises(ValueError, match="sinks must be"):
        decode_attention(*args, sinks=torch.zeros(NUM_HEADS + 1))
    with pytest.raises(ValueError, match="window must be positive"):
        decode_attention(*args, window=-4)
    with pytest.raises(ValueError, match="softcap must be positive"):
        decode_attention(*args, softcap=-1.0)


def _mixed_batch(seed: int, prefixes: list[int], extends: list[int]):
    """A 2-layer pool, slot table, the new tokens' slots and their q/k/v for a decode-first batch."""
    gen = torch.Generator().manual_seed(seed)
    num_kv = NUM_HEADS // 2
    seq_lens = [p + e for p, e in zip(prefixes, extends)]
    pool = _random_pool(num_kv, gen, num_layers=2)
    table, rows = _scattered_table(seq_lens, pool.num_slots, gen)
    out_slots = torch.cat([table[r, p : p + e] for r, p, e in zip(rows.tolist(), prefixes, extends)])
    n = int(out_slots.numel())
    qkv = (torch.randn(n, h, HEAD_DIM, generator=gen) for h in (NUM_HEADS, num_kv, num_kv))
    return pool, table, rows, out_slots, tuple(qkv)


def test_backend_forward_applies_the_spec_to_decode_and_extend_rows() -> None:
    """Every spec feature through TritonAttentionBackend.forward on a mixed batch: decode rows
    inside and past the window, extend rows with and without a cached prefix."""
    prefixes, extends = [4, WINDOW - 1, 33, 0, 20], [1, 1, 1, 18, 5]  # rows 0-2 decode, 3-4 extend
    pool, table, rows, out_slots, (q, k, v) = _mixed_batch(60, prefixes, extends)
    spec = AttentionSpec(scale=0.3, window=WINDOW, softcap=4.0, sinks=SINKS)
    backend = TritonAttentionBackend(min_split_tokens=16)  # the 34-token row takes 3 splits
    got = _backend_forward(backend, pool, 1, (q, k, v), table, rows, out_slots, prefixes, extends, 3, spec)
    got = got.view(-1, NUM_HEADS, HEAD_DIM)
    start = 0
    for r, p, e in zip(rows.tolist(), prefixes, extends):
        want = reference_attention(q[start : start + e], pool.k[1], pool.v[1], table[r, : p + e], p, 0.3, WINDOW, 4.0, SINKS)
        torch.testing.assert_close(got[start : start + e], want, **TOL)
        start += e


def test_windowed_decode_through_static_metadata_follows_seq_lens_updated_in_place() -> None:
    """A CUDA graph's decode: metadata built once over fixed req_rows/seq_lens tensors, then the
    lengths advance in place; the window must follow them (it is applied inside the kernel)."""
    lengths = [[3, 12], [14, 30], [25, 41]]  # inside, across and far past the window
    pool, table, rows, _, (q, _, _) = _mixed_batch(70, [n - 1 for n in lengths[-1]], [1, 1])
    backend = TritonAttentionBackend(min_split_tokens=16)
    seq_lens = torch.zeros(2, dtype=torch.int32)
    meta = backend.static_decode_metadata(rows, seq_lens, max_seq_len=48, num_kv_heads=pool.num_kv_heads)
    k_pool, v_pool = pool.k[0], pool.v[0]
    spec = AttentionSpec(HEAD_DIM**-0.5, window=WINDOW)
    for step in lengths:
        seq_lens.copy_(i32(step))
        out_slots = torch.stack([table[r, n - 1] for r, n in zip(rows.tolist(), step)])
        k_new, v_new = k_pool[out_slots].clone(), v_pool[out_slots].clone()  # rewrite what is there
        batch = ForwardBatch(
            input_ids=torch.zeros(2, dtype=torch.int64), positions=torch.tensor(step) - 1, out_slots=out_slots,
            req_rows=rows, prefix_lens=[n - 1 for n in step], extend_lens=[1, 1], num_decode=2,
            logits_indices=torch.arange(2), req_to_token=table, kv_pool=pool, attn_backend=backend, attn_meta=meta,
        )
        got = backend.forward(q, k_new, v_new, 0, batch, spec).view(2, NUM_HEADS, HEAD_DIM)
        for b, (r, n) in enumerate(zip(rows.tolist(), step)):
            want = reference_attention(q[b : b + 1], k_pool, v_pool, table[r, :n], n - 1, window=WINDOW)
            torch.testing.assert_close(got[b : b + 1], want, **TOL)


class _LaunchRecorder:
    """Stands in for a jitted kernel: records each launch's constexpr flags, then launches it."""

    FLAGS = ("HAS_WINDOW", "SOFTCAP", "HAS_SINKS")

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append({f: kwargs[f] for f in self.FLAGS if f in kwargs})
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_plain_layers_launch_the_kernels_with_every_spec_flag_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """spec None and a plain spec compile to the plain kernels (no window, soft-cap or sink code);
    a windowed spec turns on only its own flag, in the split and extend kernels."""
    recorders = {}
    for module, name in ((triton_decode, "_decode_split_kernel"), (triton_decode, "_decode_reduce_kernel"), (triton_extend, "_extend_kernel")):
        recorders[name] = _LaunchRecorder(getattr(module, name))
        monkeypatch.setattr(module, name, recorders[name])
    prefixes, extends = [6, 0], [1, 5]
    pool, table, rows, out_slots, qkv = _mixed_batch(80, prefixes, extends)
    backend = TritonAttentionBackend()
    plain = [None, AttentionSpec.default(HEAD_DIM), AttentionSpec(0.5)]
    for spec in [*plain, AttentionSpec(0.5, window=4)]:
        batch = ForwardBatch(
            input_ids=torch.zeros(6, dtype=torch.int64), positions=torch.tensor([6, 0, 1, 2, 3, 4]), out_slots=out_slots,
            req_rows=rows, prefix_lens=prefixes, extend_lens=extends, num_decode=1, logits_indices=torch.arange(6),
            req_to_token=table, kv_pool=pool, attn_backend=backend,
        )
        backend.init_forward_metadata(batch)
        backend.forward(*qkv, 0, batch, spec)
    off = {"HAS_WINDOW": False, "SOFTCAP": False}
    assert recorders["_decode_split_kernel"].launches == [off] * 3 + [{**off, "HAS_WINDOW": True}]
    assert recorders["_decode_reduce_kernel"].launches == [{"HAS_SINKS": False}] * 4
    assert recorders["_extend_kernel"].launches == [{**off, "HAS_SINKS": False}] * 3 + [{**off, "HAS_WINDOW": True, "HAS_SINKS": False}]
