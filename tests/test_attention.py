"""The PyTorch attention path against a plain loop: decode (with shared prefixes) and extend."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.attention import reference_attention
from radixlm.kernels.torch_decode import decode_attention, plan_decode
from radixlm.radix_cache.pool import KVPool
from radixlm.runtime.layers.attention.torch_backend import TorchAttentionBackend
from radixlm.runtime.layers.forward_batch import ForwardBatch

H, HKV, D, SLOTS = 4, 2, 16, 400


def _pool(seed: int = 0) -> KVPool:
    torch.manual_seed(seed)
    pool = KVPool(SLOTS, 1, HKV, D, torch.float32)
    pool.k[0].normal_()
    pool.v[0].normal_()
    return pool


def _table(rows: list[list[int]]) -> torch.Tensor:
    table = torch.zeros(len(rows), 128, dtype=torch.int64)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r)
    return table


@pytest.mark.parametrize("cpp_kernel", [True, False], ids=["cpp", "torch-fallback"])
@pytest.mark.parametrize("every_row_shares", [True, False])
@pytest.mark.parametrize("contiguous", [True, False])
def test_decode_with_a_shared_prefix_matches_the_reference(contiguous, every_row_shares, cpp_kernel, monkeypatch):
    if not cpp_kernel:
        monkeypatch.setattr("radixlm.kernels.torch_decode.cpu_kernels", lambda: None)
    pool = _pool()
    prefix = list(range(10, 60)) if contiguous else list(range(300, 200, -2))
    rows = [prefix + [100 + i * 7 + j for j in range(i + 1)] for i in range(3)]
    rows += [] if every_row_shares else [list(range(150, 190))]
    table = _table(rows)
    plan = plan_decode(table, torch.arange(len(rows)), [len(r) for r in rows])
    assert len(plan.groups) == 1 and plan.groups[0].length == 50
    assert (plan.groups[0].start is not None) == contiguous
    q = torch.randn(len(rows), H, D)
    out = decode_attention(q, pool.k[0], pool.v[0], plan)
    for i, r in enumerate(rows):
        ref = reference_attention(q[i : i + 1], pool.k[0], pool.v[0], torch.tensor(r), len(r) - 1)
        torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=1e-5)


def test_short_common_prefixes_are_not_grouped():
    rows = [list(range(20)) + [50 + i] for i in range(3)]
    plan = plan_decode(_table(rows), torch.arange(3), [21] * 3)
    assert plan.groups == [] and plan.suffix_index.shape[1] == 21


def test_extend_rows_with_and_without_prefix_match_the_reference():
    pool = _pool(1)
    backend = TorchAttentionBackend()
    slots_a = list(range(5, 17))  # 8 cached + 4 new
    slots_b = list(range(40, 46))  # no prefix, 6 new
    table = _table([slots_a, slots_b])
    q = torch.randn(10, H, D)
    k_new, v_new = torch.randn(10, HKV, D), torch.randn(10, HKV, D)
    out_slots = torch.tensor(slots_a[8:] + slots_b)
    batch = ForwardBatch(
        input_ids=torch.zeros(10, dtype=torch.int64), positions=torch.zeros(10, dtype=torch.int64), out_slots=out_slots,
        req_rows=torch.tensor([0, 1]), prefix_lens=[8, 0], extend_lens=[4, 6], num_decode=0,
        logits_indices=torch.tensor([]), req_to_token=table, kv_pool=pool, attn_backend=backend,
    )
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k_new, v_new, 0, batch).view(10, H, D)
    ref_a = reference_attention(q[:4], pool.k[0], pool.v[0], torch.tensor(slots_a), 8)
    ref_b = reference_attention(q[4:], pool.k[0], pool.v[0], torch.tensor(slots_b), 0)
    torch.testing.assert_close(out[:4], ref_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[4:], ref_b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 24), (8, 1, 48), (4, 2, 20)])  # 24: not whole value chunks of 16; 20: a dot with a tail not of 8
def test_cpp_paged_decode_matches_the_reference_at_other_head_shapes(heads, kv_heads, dim, cpp_ext):
    gen = torch.Generator().manual_seed(dim)
    k, v = torch.randn(300, kv_heads, dim, generator=gen), torch.randn(300, kv_heads, dim, generator=gen)
    rows = [list(range(299, 100, -3)), list(range(40, 45))]
    table = _table(rows)
    q = torch.randn(2, heads, dim, generator=gen)
    lens = torch.tensor([len(r) for r in rows])
    for splits in (1, 4):
        out, _ = cpp_ext.paged_decode(q, k, v, table, torch.tensor([0, 1]), torch.zeros(2, dtype=torch.int64), lens, dim**-0.5, splits=splits)
        for i, r in enumerate(rows):
            ref = reference_attention(q[i : i + 1], k, v, torch.tensor(r), len(r) - 1)
            torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3, 8], ids=lambda s: f"{s}-chunks")  # rows of 1-71 positions: some chunks empty
@pytest.mark.parametrize("q_scale", [1.0, 60.0], ids=["plain", "peaked"])  # peaked: score gaps far below exp's range
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_paged_decode_kernel_matches_the_reference(dtype, q_scale, splits, cpp_ext):
    ext = cpp_ext
    pool = _pool(2)
    k, v = pool.k[0].to(dtype), pool.v[0].to(dtype)
    rows = [list(range(300, 200, -2)) + [7, 9], list(range(3, 40)), [150], list(range(60, 131))]
    table = _table(rows)
    order = torch.tensor([2, 0, 3, 1])  # queries address table rows out of order
    starts = torch.tensor([0, 5, 0, 33])  # part of each row, as after a shared prefix
    lens = torch.tensor([len(rows[i]) for i in order.tolist()]) - starts
    q = (torch.randn(4, H, D) * q_scale).to(dtype)
    out, lse = ext.paged_decode(q, k, v, table, order, starts, lens, D**-0.5, splits=splits)
    assert out.dtype == torch.float32 and lse.shape == (4, H)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, r in enumerate(order.tolist()):
        slots = torch.tensor(rows[r][starts[i] :])
        ref = reference_attention(q[i : i + 1].float(), k.float(), v.float(), slots, len(slots) - 1)
        torch.testing.assert_close(out[i : i + 1], ref, atol=tol, rtol=tol)
        ref_lse = torch.stack(
            [torch.logsumexp(k[slots, h // (H // HKV)].float() @ q[i, h].float() * D**-0.5, 0) for h in range(H)]
        )
        torch.testing.assert_close(lse[i], ref_lse, atol=tol, rtol=tol)
    empty_out, empty_lse = ext.paged_decode(q[:1], k, v, table, order[:1], torch.tensor([1]), torch.tensor([0]), 1.0, splits=splits)
    assert torch.all(empty_out == 0) and torch.all(torch.isinf(empty_lse))
    # continuing an earlier part (a shared prefix's output and lse) gives the same when split
    init_out, init_lse = ext.paged_decode(q, k, v, table, order, torch.zeros(4, dtype=torch.int64), starts, D**-0.5)
    cont = ext.paged_decode(q, k, v, table, order, starts, lens, D**-0.5, init_out.view(4, H, D), init_lse, splits=splits)
    whole = ext.paged_decode(q, k, v, table, order, torch.zeros(4, dtype=torch.int64), starts + lens, D**-0.5)
    for got, want in zip(cont, whole):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize(("heads", "kv_heads", "threads"), [(9, 3, 2), (9, 3, 4), (8, 2, 3), (10, 5, 4)])  # 5 heads in 4 groups of 2: one empty
def test_cpp_paged_decode_at_batch_one_splits_kv_heads_over_threads_to_the_bit(heads, kv_heads, threads, cpp_ext):
    gen = torch.Generator().manual_seed(heads * threads)
    k, v = torch.randn(100, kv_heads, 32, generator=gen), torch.randn(100, kv_heads, 32, generator=gen)
    slots = list(range(90, 20, -1))
    table, q = _table([slots]), torch.randn(1, heads, 32, generator=gen)
    args = (k, v, table, torch.tensor([0]), torch.tensor([30]), torch.tensor([len(slots) - 30]), 32**-0.5)
    first = cpp_ext.paged_decode(q, k, v, table, torch.tensor([0]), torch.tensor([0]), torch.tensor([30]), 32**-0.5)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpp_ext.paged_decode(q, *args, first[0], first[1])
        torch.set_num_threads(threads)
        split = cpp_ext.paged_decode(q, *args, first[0], first[1])
    finally:
        torch.set_num_threads(previous)
    for got, want in zip(split, alone):
        assert torch.equal(got, want), "each KV head's arithmetic is the same whichever thread runs it"
    ref = reference_attention(q, k, v, torch.tensor(slots), len(slots) - 1)
    torch.testing.assert_close(split[0], ref, atol=1e-5, rtol=1e-5)


def test_cpu_decode_splits_fill_the_threads_without_short_chunks():
    from radixlm.kernels.torch_decode import cpu_decode_splits

    assert cpu_decode_splits(tasks=1, longest=450, threads=2) == 7, "batch 1 on 2 threads: 8 wanted, 7 chunks of 64 positions at most"
    assert cpu_decode_splits(tasks=1, longest=100, threads=2) == 1, "chunks would be under 64 positions"
    assert cpu_decode_splits(tasks=8, longest=4000, threads=2) == 1, "enough tasks already"
    assert cpu_decode_splits(tasks=1, longest=4000, threads=1) == 1
    assert cpu_decode_splits(tasks=1, longest=4000, threads=16) == 62, "64 wanted, 62 chunks of 64 positions at most"


@pytest.mark.parametrize("cpp_kernel", [True, False], ids=["cpp", "torch-fallback"])
def test_short_extend_rows_attend_as_decode_queries_beside_decode_and_long_extend_rows(cpp_kernel, monkeypatch):
    """A verify row (few tokens over a cached prefix) runs as one decode query per token, scattered
    back into place among decode rows and a long extend row; each equals the reference."""
    from radixlm.runtime.layers.attention.torch_backend import VERIFY_AS_DECODE_MAX

    if not cpp_kernel:
        monkeypatch.setattr("radixlm.kernels.torch_decode.cpu_kernels", lambda: None)
    pool = _pool(2)
    backend = TorchAttentionBackend()
    long_e = VERIFY_AS_DECODE_MAX + 4
    rows = [list(range(10, 21)), list(range(60, 90, 3)) + [95], list(range(120, 131)), list(range(200, 205 + long_e))]
    prefix, extend = [10, 10, 8, 5], [1, 1, 3, long_e]  # two decode rows, a verify row, a long extend
    table = _table(rows)
    total = sum(extend)
    q = torch.randn(total, H, D)
    k_new, v_new = torch.randn(total, HKV, D), torch.randn(total, HKV, D)
    out_slots = torch.tensor([s for r, p in zip(rows, prefix) for s in r[p:]])
    batch = ForwardBatch(
        input_ids=torch.zeros(total, dtype=torch.int64), positions=torch.zeros(total, dtype=torch.int64), out_slots=out_slots,
        req_rows=torch.arange(4), prefix_lens=prefix, extend_lens=extend, num_decode=2,
        logits_indices=torch.tensor([]), req_to_token=table, kv_pool=pool, attn_backend=backend,
    )
    backend.init_forward_metadata(batch)
    assert batch.attn_meta.decode_tokens is not None and len(batch.attn_meta.extend_rows) == 1
    out = backend.forward(q, k_new, v_new, 0, batch).view(total, H, D)
    start = 0
    for r, p, e in zip(rows, prefix, extend):
        ref = reference_attention(q[start : start + e], pool.k[0], pool.v[0], torch.tensor(r), p)
        torch.testing.assert_close(out[start : start + e], ref, atol=1e-5, rtol=1e-5)
        start += e
