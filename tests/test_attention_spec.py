"""Every CPU attention path honours an AttentionSpec: scale, sliding window, soft-cap, sinks.

The plain-loop reference is checked against transformers' eager rule on whole sequences; the
extend path, the decode path (C++ and PyTorch, with shared prefixes and verify rows) and the
C++ kernel are checked against the reference.
"""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels import attention as attention_kernels
from radixlm.kernels.attention import extend_attention, reference_attention
from radixlm.kernels.torch_decode import decode_attention, plan_decode
from radixlm.radix_cache.pool import KVPool
from radixlm.runtime.layers.attention.torch_backend import TorchAttentionBackend
from radixlm.runtime.layers.attention_spec import AttentionSpec
from radixlm.runtime.layers.forward_batch import ForwardBatch

H, HKV, D, SLOTS = 4, 2, 16, 600
SINKS = torch.tensor([0.5, -1.0, 2.0, 3.5])
SPECS = {  # each piece alone, then all of them
    "scale": dict(scale=0.3),
    "window": dict(window=7),
    "softcap": dict(softcap=1.5),
    "sinks": dict(sinks=SINKS),
    "all": dict(scale=0.2, window=5, softcap=2.0, sinks=SINKS),
}


def _spec(name: str) -> AttentionSpec:
    return AttentionSpec(**{"scale": D**-0.5, **SPECS[name]})


def _kwargs(spec: AttentionSpec) -> dict:
    return dict(scale=spec.scale, window=spec.window, softcap=spec.softcap, sinks=spec.sinks)


def _pool(seed: int, scale: float = 3.0, kv_format: str = "auto") -> KVPool:
    """A one-layer pool of random KV, large enough that soft-capping and sinks matter."""
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(SLOTS, 1, HKV, D, torch.float32, kv_format=kv_format)
    k, v = torch.randn(SLOTS, HKV, D, generator=gen) * scale, torch.randn(SLOTS, HKV, D, generator=gen)
    pool.write(0, torch.arange(1, SLOTS), k[1:], v[1:])
    return pool


def _table(rows: list[list[int]]) -> torch.Tensor:
    table = torch.zeros(len(rows), 256, dtype=torch.int64)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r)
    return table


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """transformers' eager attention over a whole sequence (q, k, v ``[L, heads, D]``), as
    Gemma 2 (soft-cap), Mistral (window) and GPT-OSS (sinks) compute it."""
    length, group = q.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, k) * spec.scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    visible = (j <= i) & (j > i - spec.window if spec.window is not None else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    if spec.sinks is not None:
        scores = torch.cat([scores, spec.sinks.view(-1, 1, 1).expand(-1, length, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :length]
    return torch.einsum("hij,jhd->ihd", probs, v)


def _batch(pool: KVPool, rows: list[list[int]], prefix: list[int], extend: list[int], num_decode: int) -> tuple[ForwardBatch, torch.Tensor]:
    """A batch over ``rows`` (each row's slots) whose new tokens' KV is already in the pool, and its queries."""
    total = sum(extend)
    backend = TorchAttentionBackend()
    batch = ForwardBatch(
        input_ids=torch.zeros(total, dtype=torch.int64), positions=torch.zeros(total, dtype=torch.int64),
        out_slots=torch.tensor([s for r, p in zip(rows, prefix) for s in r[p:]]), req_rows=torch.arange(len(rows)),
        prefix_lens=prefix, extend_lens=extend, num_decode=num_decode, logits_indices=torch.tensor([]),
        req_to_token=_table(rows), kv_pool=pool, attn_backend=backend,
    )  # fmt: skip
    backend.init_forward_metadata(batch)
    return batch, torch.randn(total, H, D, generator=torch.Generator().manual_seed(len(rows))) * 2


def _forward(batch: ForwardBatch, q: torch.Tensor, spec: AttentionSpec | None) -> torch.Tensor:
    """The backend's output for ``q``, writing back the KV the pool already holds at the new slots."""
    k, v = batch.kv_pool.read(0, batch.out_slots, torch.float32)
    return batch.attn_backend.forward(q, k.clone(), v.clone(), 0, batch, spec).view(q.shape)


def _check_rows(out, q, pool, rows, prefix, extend, spec, tol=1e-5):
    start = 0
    for r, p, e in zip(rows, prefix, extend):
        ref = reference_attention(q[start : start + e], pool.k[0], pool.v[0], torch.tensor(r), p, **_kwargs(spec))
        torch.testing.assert_close(out[start : start + e], ref, atol=tol, rtol=tol, msg=lambda m, p=p, e=e: f"row of {p}+{e}: {m}")
        start += e


@pytest.mark.parametrize("name", list(SPECS))
def test_the_reference_is_transformers_eager_attention(name):
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(12, H, D, generator=gen) * 2, torch.randn(12, HKV, D, generator=gen) * 2, torch.randn(12, HKV, D, generator=gen)
    spec = _spec(name)
    want = _eager(q, k, v, spec)
    torch.testing.assert_close(reference_attention(q, k, v, torch.arange(12), 0, **_kwargs(spec)), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reference_attention(q[8:], k, v, torch.arange(12), 8, **_kwargs(spec)), want[8:], atol=1e-5, rtol=1e-5)
    plain = _eager(q, k, v, AttentionSpec(D**-0.5))
    assert not torch.allclose(want, plain, atol=1e-3), "the spec changes the result"


@pytest.mark.parametrize("name", list(SPECS))
def test_extend_attention_honours_the_spec_on_its_own(name, monkeypatch):
    spec = _spec(name)
    pool = _pool(4)
    slots = torch.arange(20, 44)
    q = torch.randn(10, H, D) * 2
    k, v = pool.k[0][slots], pool.v[0][slots]
    ref = reference_attention(q, pool.k[0], pool.v[0], slots, 14, **_kwargs(spec))
    torch.testing.assert_close(extend_attention(q, k, v, None, H // HKV, **_kwargs(spec)), ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(attention_kernels, "MAX_SCORES", 3 * HKV * len(slots))  # the manual path in blocks of 3 query rows
    torch.testing.assert_close(extend_attention(q, k, v, None, H // HKV, **_kwargs(spec)), ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(attention_kernels, "MIN_WINDOW_BLOCK", 2)  # a window: query blocks of `window` rows
    torch.testing.assert_close(extend_attention(q, k, v, None, H // HKV, **_kwargs(spec)), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cpp_kernel", [True, False], ids=["cpp", "torch-fallback"])
@pytest.mark.parametrize("name", list(SPECS))
def test_every_row_kind_of_the_torch_backend_honours_the_spec(name, cpp_kernel, monkeypatch):
    """Decode rows (two over one shared prefix, so cascade attention runs), a verify row (one
    decode query a token), and extend rows with and without a cached prefix, longer than the window."""
    if not cpp_kernel:
        monkeypatch.setattr("radixlm.kernels.torch_decode.cpu_kernels", lambda: None)
    spec = _spec(name)
    pool = _pool(5)
    shared = list(range(10, 50))
    rows = [shared + [60, 61], shared + [70], list(range(100, 109)), list(range(120, 150)), list(range(200, 230)), list(range(300, 312))]
    prefix, extend = [41, 40, 4, 20, 12, 0], [1, 1, 5, 10, 18, 12]
    batch, q = _batch(pool, rows, prefix, extend, num_decode=2)
    assert len(batch.attn_meta.decode.groups) == 1 and batch.attn_meta.decode_tokens is not None
    _check_rows(_forward(batch, q, spec), q, pool, rows, prefix, extend, spec)


@pytest.mark.parametrize("cpp_kernel", [True, False], ids=["cpp", "torch-fallback"])
def test_windowed_decode_reads_only_the_window_in_place(cpp_kernel, monkeypatch):
    if not cpp_kernel:
        monkeypatch.setattr("radixlm.kernels.torch_decode.cpu_kernels", lambda: None)
    pool = _pool(6)
    shared = list(range(10, 50))
    rows = [shared + [60], shared + [70, 71, 72], [400, 401, 402]]
    lens = [len(r) for r in rows]
    plan = plan_decode(_table(rows), torch.arange(3), lens, window=8)
    assert plan.groups == [], "no shared prefix in a windowed plan"
    assert plan.prefix_len.tolist() == [33, 35, 0] and plan.suffix_len.tolist() == [8, 8, 3]
    assert plan_decode(_table(rows), torch.arange(3), lens, window=44).groups, "a window no row outgrows shares prefixes"
    q = torch.randn(3, H, D)
    out = decode_attention(q, pool.k[0], pool.v[0], plan)
    for i, r in enumerate(rows):
        ref = reference_attention(q[i : i + 1], pool.k[0], pool.v[0], torch.tensor(r), len(r) - 1, window=8)
        torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=1e-5)


def test_windowed_plans_are_built_once_and_only_where_the_window_hides_something(monkeypatch):
    monkeypatch.setattr(attention_kernels, "MIN_WINDOW_BLOCK", 1)  # the long extend row in blocks of 5 queries
    pool = _pool(7)
    rows = [list(range(10, 30)), list(range(40, 46)), list(range(100, 140))]
    prefix, extend = [19, 3, 10], [1, 3, 30]
    batch, q = _batch(pool, rows, prefix, extend, num_decode=1)
    meta = batch.attn_meta
    assert meta.decode_plan(None) is meta.decode and meta.extend_plan(None) is meta.extend_rows
    assert meta.decode_plan(40) is meta.decode and meta.extend_plan(40) is meta.extend_rows, "a window longer than every row"
    windowed = meta.decode_plan(5)
    assert windowed is not meta.decode and meta.decode_plan(5) is windowed, "built once, then cached"
    (start, e, slots, mask), = meta.extend_plan(5)
    assert (start, e, mask) == (4, 30, None) and slots.tolist() == rows[2][6:], "only the positions the window can see: from p - W + 1"
    _check_rows(_forward(batch, q, AttentionSpec(D**-0.5, window=5)), q, pool, rows, prefix, extend, AttentionSpec(D**-0.5, window=5))


@pytest.mark.parametrize("kv_format", ["bfloat16", "int8"])
def test_windows_softcap_and_sinks_on_a_converted_pool(kv_format):
    spec = _spec("all")
    pool = _pool(8, kv_format=kv_format)
    rows = [list(range(10, 40)), list(range(50, 60)), list(range(100, 130))]
    prefix, extend = [29, 6, 0], [1, 4, 30]
    batch, q = _batch(pool, rows, prefix, extend, num_decode=1)
    out = _forward(batch, q, spec)
    k, v = pool.read(0, torch.arange(SLOTS), torch.float32)
    start = 0
    for r, p, e in zip(rows, prefix, extend):
        ref = reference_attention(q[start : start + e], k, v, torch.tensor(r), p, **_kwargs(spec))
        torch.testing.assert_close(out[start : start + e], ref, atol=1e-4, rtol=1e-4)
        start += e


@pytest.mark.parametrize("splits", [1, 3])
def test_cpp_paged_decode_soft_caps_its_scores(cpp_ext, splits):
    pool = _pool(9, scale=6.0)
    rows = [list(range(300, 200, -2)), list(range(3, 90))]
    table = _table(rows)
    lens = torch.tensor([len(r) for r in rows])
    q = torch.randn(2, H, D) * 2
    zero = torch.zeros(2, dtype=torch.int64)
    plain, plain_lse = cpp_ext.paged_decode(q, pool.k[0], pool.v[0], table, torch.arange(2), zero, lens, 0.25, splits=splits)
    same, same_lse = cpp_ext.paged_decode(q, pool.k[0], pool.v[0], table, torch.arange(2), zero, lens, 0.25, splits=splits, softcap=0.0)
    assert torch.equal(plain, same) and torch.equal(plain_lse, same_lse), "softcap 0 is no soft-cap"
    out, lse = cpp_ext.paged_decode(q, pool.k[0], pool.v[0], table, torch.arange(2), zero, lens, 0.25, splits=splits, softcap=1.5)
    for i, r in enumerate(rows):
        slots = torch.tensor(r)
        ref = reference_attention(q[i : i + 1], pool.k[0], pool.v[0], slots, len(r) - 1, scale=0.25, softcap=1.5)
        torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=1e-5)
        scores = torch.einsum("hd,jhd->hj", q[i], pool.k[0][slots].repeat_interleave(H // HKV, dim=1)) * 0.25
        torch.testing.assert_close(lse[i], torch.logsumexp(torch.tanh(scores / 1.5) * 1.5, dim=-1), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="softcap"):
        cpp_ext.paged_decode(q, pool.k[0], pool.v[0], table, torch.arange(2), zero, lens, 0.25, softcap=-1.0)
