"""Quantized KV pools: round-trip error bounds, every CPU attention path on int8/fp8/bf16 pools
against the reference on the dequantized pool, and the engine's scheduling scenarios on them."""

from __future__ import annotations

import pytest
import torch
from test_parity import NEW_TOKENS, _run_scenario, _tiny_prompts

from helpers import Driver, built_cpp_kernels
from radixlm import ServerArgs
from radixlm.kernels.attention import reference_attention
from radixlm.kernels.kv_quant import KV_CACHE_DTYPES, dequantize, quantize, resolve_kv_format
from radixlm.radix_cache.pool import KVPool
from radixlm.runtime.engine import build_parts
from radixlm.runtime.layers.attention.torch_backend import (
    VERIFY_AS_DECODE_MAX,
    TorchAttentionBackend,
)
from radixlm.runtime.layers.forward_batch import ForwardBatch

H, HKV, D, SLOTS = 6, 2, 32, 512


EIGHT_BIT = ["int8", "fp8_e4m3", "fp8_e5m2"]


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_round_trip_error_stays_within_half_a_step_of_each_format(name):
    fmt = resolve_kv_format(name, torch.float32)
    torch.manual_seed(0)
    # heads of very different magnitudes, an outlier, and an all-zero head
    x = torch.randn(64, 4, D) * torch.tensor([1e-3, 1.0, 30.0, 0.0])[None, :, None]
    x[5, 1, 7] = 80.0
    values, scales = quantize(x, fmt)
    assert values.dtype == fmt.dtype and scales.dtype == torch.float16 and scales.shape == (64, 4)
    back = dequantize(values, scales, torch.float32)
    assert torch.isfinite(back).all() and torch.equal(back[:, 3], torch.zeros(64, D))
    step = scales.float()[..., None]  # one int8 step; fp8's relative step: 2^-mantissa bits
    if name == "int8":
        bound = step / 2 * 1.001
    else:
        mantissa = 3 if name == "fp8_e4m3" else 2
        subnormal_step = step * (2.0**-9 if name == "fp8_e4m3" else 2.0**-16)
        bound = torch.maximum(x.abs() * 2.0**-(mantissa + 1), subnormal_step / 2) * 1.001
    assert ((back - x).abs() <= bound).all()
    # each head's largest magnitude maps onto the format's largest value (full range used; the
    # 1e-3 head's scale is an fp16 subnormal, too coarse for that)
    assert torch.allclose(values.float().abs().amax(-1)[:, 1:3], torch.full((64, 2), fmt.qmax), rtol=2e-3)


@pytest.mark.parametrize("name", EIGHT_BIT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_quantizing_write_stores_exactly_what_the_pytorch_quantizer_computes(name, dtype):
    """CPU pools quantize with the fused C++ kernel; GPUs and the fallback with PyTorch ops: the
    same bits, so a pool's contents never depend on which path wrote them."""
    ext = built_cpp_kernels()
    fmt = resolve_kv_format(name, torch.float32)
    torch.manual_seed(1)
    x = (torch.randn(40, 4, D) * torch.tensor([1e-6, 1e-3, 3.0, 0.0])[None, :, None]).to(dtype)
    values, scales = quantize(x, fmt)
    pool_values, pool_scales = torch.zeros(64, 4, D, dtype=fmt.dtype), torch.zeros(64, 4, dtype=torch.float16)
    slots = torch.randperm(63)[:40] + 1
    ext.quantize_into(x, slots, pool_values, pool_scales, fmt.qmax)
    assert torch.equal(pool_values[slots].view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(pool_scales[slots], scales)


def test_bytes_per_token_counts_the_scales_and_beats_fp32_and_bf16_by_the_promised_factors():
    layers, heads, dim = 30, 3, 64  # SmolLM2-135M
    fp32 = KVPool.bytes_per_token(layers, heads, dim, torch.float32)
    bf16 = KVPool.bytes_per_token(layers, heads, dim, torch.float32, "bfloat16")
    int8 = KVPool.bytes_per_token(layers, heads, dim, torch.float32, "int8")
    assert int8 == 2 * layers * heads * (dim + 2)
    assert int8 == KVPool.bytes_per_token(layers, heads, dim, torch.float32, "fp8_e4m3")
    assert fp32 / int8 >= 3.5 and bf16 / int8 >= 1.9
    pool = KVPool(100, layers, heads, dim, torch.float32, kv_format="int8")
    assert pool.nbytes() == 100 * int8


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_format("int4", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ServerArgs.from_kwargs(kv_cache_dtype="fp8")
    assert set(KV_CACHE_DTYPES) == set(next(f for f in ServerArgs.__dataclass_fields__.values() if f.name == "kv_cache_dtype").metadata["choices"])


def _table(rows: list[list[int]]) -> torch.Tensor:
    table = torch.zeros(len(rows), 128, dtype=torch.int64)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r)
    return table


def _mixed_batch(pool: KVPool, seed: int):
    """Three decode rows sharing a 40-token prefix, a verify row, a long extend over a prefix and
    one without: every attention path of the torch backend in one pass."""
    torch.manual_seed(seed)
    prefix = list(range(300, 220, -2))  # scattered: not a slice
    long_e = VERIFY_AS_DECODE_MAX + 3
    rows = [prefix + [10 + i * 5 + j for j in range(i + 2)] for i in range(3)]
    rows += [list(range(100, 112)), list(range(130, 140 + long_e)), list(range(400, 409))]
    prefix_lens = [len(rows[0]) - 1, len(rows[1]) - 1, len(rows[2]) - 1, 9, 10, 0]
    extend_lens = [len(r) - p for r, p in zip(rows, prefix_lens)]
    pool.write(0, torch.arange(1, SLOTS), torch.randn(SLOTS - 1, HKV, D) * 2, torch.randn(SLOTS - 1, HKV, D))
    total = sum(extend_lens)
    out_slots = torch.tensor([s for r, p in zip(rows, prefix_lens) for s in r[p:]])
    batch = ForwardBatch(
        input_ids=torch.zeros(total, dtype=torch.int64), positions=torch.zeros(total, dtype=torch.int64), out_slots=out_slots,
        req_rows=torch.arange(len(rows)), prefix_lens=prefix_lens, extend_lens=extend_lens, num_decode=3,
        logits_indices=torch.tensor([]), req_to_token=_table(rows), kv_pool=pool, attn_backend=TorchAttentionBackend(),
    )
    q = torch.randn(total, H, D)
    k_new, v_new = torch.randn(total, HKV, D) * 2, torch.randn(total, HKV, D)
    return batch, rows, q, k_new, v_new


@pytest.mark.parametrize("cpp_kernel", [True, False], ids=["cpp", "torch-fallback"])
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2", "bfloat16"])
def test_every_torch_backend_path_on_a_quantized_pool_equals_the_reference_on_the_dequantized_pool(name, cpp_kernel, monkeypatch):
    if not cpp_kernel:
        monkeypatch.setattr("radixlm.kernels.torch_decode.cpu_kernels", lambda: None)
    else:
        built_cpp_kernels()
    pool = KVPool(SLOTS, 1, HKV, D, torch.float32, kv_format=name)
    batch, rows, q, k_new, v_new = _mixed_batch(pool, seed=3)
    backend = batch.attn_backend
    backend.init_forward_metadata(batch)
    assert len(batch.attn_meta.decode.groups) == 1 and len(batch.attn_meta.extend_rows) == 2
    out = backend.forward(q, k_new, v_new, 0, batch).view(-1, H, D)
    k_ref, v_ref = pool.read(0, torch.arange(SLOTS), torch.float32)  # the whole pool, for the reference only
    start = 0
    for r, p, e in zip(rows, batch.prefix_lens, batch.extend_lens):
        ref = reference_attention(q[start : start + e], k_ref, v_ref, torch.tensor(r), p)
        torch.testing.assert_close(out[start : start + e], ref, atol=2e-5, rtol=2e-5)
        start += e
    # the new tokens were quantized on write: the pool holds them in its own format
    assert pool.k[0].dtype == pool.format.dtype and (pool.k_scale[0] is not None) == pool.format.scaled


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_cpp_kernel_reads_every_finite_fp8_value_exactly_subnormals_included(dtype):
    """Attending to a single key returns its value row: each fp8 bit pattern, read by the kernel,
    equals torch's own conversion."""
    ext = built_cpp_kernels()
    bits = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(dtype)
    finite = bits[torch.isfinite(bits.float())]
    rows = -(-len(finite) // D)
    v = torch.zeros(rows * D, dtype=dtype)
    v.view(torch.uint8)[: len(finite)] = finite.view(torch.uint8)
    v = v.view(rows, 1, D)
    k = torch.zeros(rows, 1, D, dtype=dtype)
    ones = torch.ones(rows, 1, dtype=torch.float16)
    table = torch.arange(rows, dtype=torch.int64)[:, None]
    out, _ = ext.paged_decode(torch.randn(rows, 1, D), k, v, table, torch.arange(rows), torch.zeros(rows, dtype=torch.int64), torch.ones(rows, dtype=torch.int64), 1.0, None, None, ones, ones)
    assert torch.equal(out[:, 0], v[:, 0].float())


def test_the_cpp_kernel_refuses_an_8bit_pool_without_its_scales():
    ext = built_cpp_kernels()
    pool = KVPool(16, 1, HKV, D, torch.float32, kv_format="int8")
    table, rows, one = torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="scales"):
        ext.paged_decode(torch.randn(1, H, D), pool.k[0], pool.v[0], table, rows, rows, one, 1.0)


# ---------------------------------------------------------------- the engine on quantized pools

SCENARIOS = {
    "radix_cache_hit": ({}, "twice"),
    "chunked_prefill_16": ({"chunked_prefill_size": 16}, "staggered"),
    "page_size_16": ({"page_size": 16}, "twice"),
    "retraction": ({"max_total_tokens": 400, "max_running_requests": 12}, "all_at_once"),
    "ngram_speculation": ({"speculative_algorithm": "ngram"}, "one_by_one"),
}


NEAR_TIE = 0.02  # top-2 logprob gap under which an 8-bit rounding difference may flip greedy


@pytest.fixture(scope="module")
def alone_outputs(tiny_llama):
    """Each prompt run by itself, per KV format: its greedy tokens, and how many of them lie
    before the first near tie (where batching's float noise, rounded to 8 bits, may flip a token)."""
    prompts = [p + p[-12:] for p in _tiny_prompts()]  # each tail repeated: n-gram speculation proposes
    alone = {}
    for name in ("int8", "fp8_e4m3"):
        d = Driver(build_parts(ServerArgs(model_path=tiny_llama, max_total_tokens=8192, kv_cache_dtype=name)))
        runs = []
        for p in prompts:
            rid = d.add(p, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, return_logprob=True, top_logprobs_num=2)
            d.run()
            tops = d.results[rid].meta_info["output_top_logprobs"]
            sure = next((j for j, t in enumerate(tops) if t[0][0] - t[1][0] < NEAR_TIE), len(tops))
            runs.append((d.results[rid].output_ids, sure))
        alone[name] = runs
    return prompts, alone


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_scheduling_scenarios_on_a_quantized_pool_give_the_same_greedy_tokens_with_clean_accounting(name, scenario, tiny_llama, alone_outputs):
    """Radix sharing, chunked prefill, pages, retraction and speculation (rejected drafts' slots
    freed) move quantized KV with its scales: each prompt's greedy tokens equal its run alone, up
    to its first near tie."""
    prompts, alone = alone_outputs
    options, arrival = SCENARIOS[scenario]
    outputs, rt = _run_scenario(tiny_llama, prompts, {**options, "kv_cache_dtype": name}, arrival)
    assert rt.runner.kv_pool.format.name == name
    compared = 0
    for i, (ours, (ref, sure)) in enumerate(zip(outputs, alone[name])):
        assert ours[:sure] == ref[:sure], f"prompt {i} diverged at token {next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)}"
        compared += sure
    assert compared >= len(prompts) * NEW_TOKENS // 2, "too many near ties: the comparison says little"
    if scenario == "retraction":
        assert rt.scheduler.total_retracted > 0, "the pool was large enough that nothing was retracted"
    if scenario == "ngram_speculation":
        assert rt.scheduler.speculator.stats()["spec_draft_tokens"] > 0
    rt.scheduler.check_accounting()


def test_jump_forward_on_an_int8_pool_gives_the_tokens_of_decoding_the_forced_text(tiny_llama):
    outputs = []
    for disable in (False, True):
        rt = build_parts(ServerArgs(model_path=tiny_llama, max_total_tokens=2048, kv_cache_dtype="int8", disable_jump_forward=disable))
        d = Driver(rt)
        rid = d.add([5, 17, 42, 9], max_new_tokens=40, temperature=0.0, regex=r"The answer is (yes|no), surely\.")
        d.run()
        outputs.append(d.results[rid].output_ids)
        rt.scheduler.check_accounting()
    assert outputs[0] == outputs[1]


def test_engine_stats_report_the_kv_dtype_and_its_bytes_per_token(tiny_llama):
    import radixlm

    with radixlm.Engine(model_path=tiny_llama, max_total_tokens=512, kv_cache_dtype="fp8_e5m2") as engine:
        stats = engine.get_stats()
        cfg = engine.runner.config
    assert stats["kv_cache_dtype"] == "fp8_e5m2"
    assert stats["kv_bytes_per_token"] == 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 2)
