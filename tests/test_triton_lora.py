"""The Triton multi-LoRA kernels (SGMV shrink and expand), run under Triton's interpreter on CPU
tensors against a plain torch loop over the segments."""

import os

import pytest
import torch

# conftest sets it too, before anything imports triton
os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("CI"):  # CI installs Triton: a failed install must fail the run, not skip these
    import triton  # noqa: F401
else:
    pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot run")

from radixlm.kernels import triton_lora  # noqa: E402
from radixlm.kernels.triton_lora import lora_expand_, lora_shrink  # noqa: E402

pytestmark = pytest.mark.triton

# Rows 0..2: 3 tokens; row 3: no segment; rows 4..20: 17 tokens (two token blocks); row 21: 1
# token; row 22: no segment. Listed out of row order, so each program must load its own bounds.
SEGMENTS = [(4, 21), (21, 22), (0, 3)]
ROWS = 23
GAP_ROWS = [3, 22]


def _bounds(segments: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.tensor([s for s, _ in segments], dtype=torch.int64)
    end = torch.tensor([e for _, e in segments], dtype=torch.int64)
    return start, end


def _shrink_reference(
    x: torch.Tensor, a: torch.Tensor, segments: list[tuple[int, int]]
) -> torch.Tensor:
    h = torch.zeros(x.shape[0], a.shape[2])
    for k, (s, e) in enumerate(segments):
        h[s:e] = x[s:e].float() @ a[k].float()
    return h


def _expand_reference(
    out: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    segments: list[tuple[int, int]],
    col: int,
    lo: int,
) -> torch.Tensor:
    want = out.float().clone()
    r, n = b.shape[1], b.shape[2]
    for k, (s, e) in enumerate(segments):
        want[s:e, lo : lo + n] += h[s:e, col : col + r].float() @ b[k].float()
    return want


# 16-bit results: one rounding of an fp32 sum (bf16's truncated in the interpreter: up to one unit in the last place)
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


# rank 12: a masked rank tail inside one block; 64: two column blocks (shrink) and two reduction steps (expand)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("rank", [12, 64])
def test_shrink_matches_per_segment_matmul_and_zeroes_rows_outside_segments(rank, dtype):
    gen = torch.Generator().manual_seed(rank)
    # in = 40: a reduction tail after one 32-wide step
    x = torch.randn(ROWS, 40, generator=gen).to(dtype)
    a = (torch.randn(len(SEGMENTS), 40, rank, generator=gen) * 0.2).to(dtype)
    h = lora_shrink(x, a, *_bounds(SEGMENTS))
    assert h.shape == (ROWS, rank) and h.dtype == dtype
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(h.float(), _shrink_reference(x, a, SEGMENTS), atol=atol, rtol=rtol)
    assert torch.count_nonzero(h[GAP_ROWS]) == 0


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("rank", [12, 64])
def test_expand_adds_into_a_column_slice_and_leaves_other_rows_and_columns_untouched(rank, dtype):
    gen = torch.Generator().manual_seed(100 + rank)
    # h's rank slice starts at 5; out's slice [7, 47) of 56 ends in a column tail
    col, lo, n_cols = 5, 7, 40
    h = torch.randn(ROWS, col + rank + 3, generator=gen).to(dtype)
    b = (torch.randn(len(SEGMENTS), rank, n_cols, generator=gen) * 0.2).to(dtype)
    out = torch.randn(ROWS, 56, generator=gen).to(dtype)
    before = out.clone()
    got = lora_expand_(out, h, b, *_bounds(SEGMENTS), col, lo)
    assert got is out
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(
        out.float(), _expand_reference(before, h, b, SEGMENTS, col, lo), atol=atol, rtol=rtol
    )
    assert torch.equal(out[GAP_ROWS], before[GAP_ROWS])
    assert torch.equal(out[:, :lo], before[:, :lo])
    assert torch.equal(out[:, lo + n_cols :], before[:, lo + n_cols :])


def test_shrink_then_expand_is_the_lora_delta_of_each_segments_adapter():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(ROWS, 24, generator=gen)
    a = torch.randn(len(SEGMENTS), 24, 12, generator=gen) * 0.2
    b = torch.randn(len(SEGMENTS), 12, 20, generator=gen) * 0.2
    start, end = _bounds(SEGMENTS)
    out = lora_expand_(torch.zeros(ROWS, 20), lora_shrink(x, a, start, end), b, start, end, 0, 0)
    want = torch.zeros(ROWS, 20)
    for k, (s, e) in enumerate(SEGMENTS):
        want[s:e] = x[s:e] @ a[k] @ b[k]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_long_segment_beyond_the_grids_token_blocks_is_covered_by_the_in_program_loop(monkeypatch):
    # one program per segment walks all its blocks
    monkeypatch.setattr(triton_lora, "MAX_M_BLOCKS", 1)
    gen = torch.Generator().manual_seed(5)
    segments = [(1, 35), (35, 36)]  # 34 tokens: three 16-token blocks in one program
    x = torch.randn(37, 20, generator=gen)
    a = torch.randn(2, 20, 16, generator=gen)
    b = torch.randn(2, 16, 24, generator=gen)
    start, end = _bounds(segments)
    h = lora_shrink(x, a, start, end)
    torch.testing.assert_close(h, _shrink_reference(x, a, segments), atol=1e-5, rtol=1e-5)
    out = torch.randn(37, 24, generator=gen)
    want = _expand_reference(out, h, b, segments, 0, 0)
    torch.testing.assert_close(
        lora_expand_(out, h, b, start, end, 0, 0), want, atol=1e-5, rtol=1e-5
    )


def test_decode_batch_of_one_token_segments_uses_each_segments_own_adapter():
    gen = torch.Generator().manual_seed(9)
    segments = [(i, i + 1) for i in range(4)]  # n == K: a single token block per segment
    x = torch.randn(4, 16, generator=gen)
    a = torch.randn(4, 16, 8, generator=gen)
    h = lora_shrink(x, a, *_bounds(segments))
    torch.testing.assert_close(h, torch.einsum("ti,tir->tr", x, a), atol=1e-5, rtol=1e-5)


def test_kernels_follow_strides_of_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(3)
    start, end = _bounds(SEGMENTS)
    x = torch.randn(ROWS, 2 * 24, generator=gen)[:, ::2]  # column stride 2
    # A as stored, [K, r, in], viewed as [K, in, r]
    a = torch.randn(len(SEGMENTS), 12, 24, generator=gen).transpose(1, 2)
    h = lora_shrink(x, a, start, end)
    torch.testing.assert_close(h, _shrink_reference(x, a, SEGMENTS), atol=1e-5, rtol=1e-5)
    b = torch.randn(len(SEGMENTS), 20, 12, generator=gen).transpose(1, 2)  # B as stored: [K, N, r]
    out_t = torch.randn(30, ROWS, generator=gen)
    out = out_t.t()  # [ROWS, 30] with row stride 1
    want = _expand_reference(out, h, b, SEGMENTS, 0, 4)
    lora_expand_(out, h, b, start, end, 0, 4)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_no_segments_launch_nothing():
    x = torch.randn(3, 16)
    empty = torch.zeros(0, dtype=torch.int64)
    assert torch.count_nonzero(lora_shrink(x, torch.zeros(0, 16, 8), empty, empty)) == 0
    out = torch.randn(3, 8)
    assert torch.equal(
        lora_expand_(out.clone(), torch.randn(3, 4), torch.zeros(0, 4, 8), empty, empty, 0, 0), out
    )


def test_kernels_refuse_mismatched_shapes_slices_and_bounds():
    start, end = _bounds([(0, 2)])
    with pytest.raises(ValueError, match="same in"):
        lora_shrink(torch.zeros(2, 16), torch.zeros(1, 8, 4), start, end)
    with pytest.raises(ValueError, match="int64"):
        lora_shrink(torch.zeros(2, 16), torch.zeros(1, 16, 4), start.int(), end)
    with pytest.raises(ValueError, match="int64"):
        # two adapters, one segment
        lora_shrink(torch.zeros(2, 16), torch.zeros(2, 16, 4), start, end)
    with pytest.raises(ValueError, match="must lie within"):
        lora_expand_(torch.zeros(2, 8), torch.zeros(2, 4), torch.zeros(1, 4, 8), start, end, 0, 1)
    with pytest.raises(ValueError, match="must lie within"):
        lora_expand_(torch.zeros(2, 8), torch.zeros(2, 4), torch.zeros(1, 4, 8), start, end, 1, 0)


def test_runtime_grouped_plan_adds_each_segments_own_delta():
    """The runtime's GPU path (``grouped_plan``, stacked pairs, one shrink and an expand per part)
    adds each row's own adapter delta: adapters on some parts only, of different ranks, and an
    adapter with no pair on the module; base rows untouched."""
    from helpers import FakeAdapter
    from radixlm.runtime.lora.batch import LoraBatch, add_lora_deltas, grouped_plan, segments_of

    torch.manual_seed(3)
    part_rows = (20, 12)
    make = lambda name, ranks, module="layers.0.m": FakeAdapter(name, ranks, module, 24, part_rows)  # noqa: E731
    a, b, c = make("a", {0: 4, 1: 8}), make("b", {1: 3}), make("c", {None: 5})
    d = make("d", {0: 2}, module="layers.0.other")
    lengths, rows = [1, 1, 1, 1, 18, 2], [a, None, b, d, c, a]
    segments = segments_of(lengths, rows)
    n = sum(lengths)
    x, base = torch.randn(n, 24), torch.randn(n, sum(part_rows))
    want = base.clone()
    token = 0
    for length, ad in zip(lengths, rows):
        if ad is not None and "layers.0.m" in ad.weights:
            A, B = ad.weights["layers.0.m"]
            want[token : token + length] += x[token : token + length] @ A.T @ B.T
        token += length
    part = {"m": list(part_rows), "other": [sum(part_rows)]}
    plan = grouped_plan(segments, triton_lora, torch.device("cpu"), part)
    got = add_lora_deltas(x, base.clone(), "layers.0.m", LoraBatch(segments, part, plan))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[[1, 3]], base[[1, 3]])
    assert grouped_plan([], triton_lora, torch.device("cpu"), part) is None
