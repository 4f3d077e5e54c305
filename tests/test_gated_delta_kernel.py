"""The C++ decode step of the gated delta rule (gated_delta_decode) against delta_rule_recurrent,
alone and inside GatedDeltaNet over a state pool."""

from __future__ import annotations

import pytest
import torch

from radixlm.radix_cache.state_pool import StatePool
from radixlm.runtime.layers import gated_delta
from radixlm.runtime.layers.gated_delta import (
    GatedDeltaNet,
    GatedDeltaSpec,
    delta_rule_recurrent,
    l2norm,
)

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def ext(cpp_ext):
    return cpp_ext


def _inputs(b: int, heads: int, dk: int, dv: int, key_heads: int | None = None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hk = heads if key_heads is None else key_heads
    q = l2norm(torch.randn(b, hk, dk, generator=gen)) * dk**-0.5
    k = l2norm(torch.randn(b, hk, dk, generator=gen))
    v = torch.randn(b, heads, dv, generator=gen)
    g = -torch.rand(b, heads, generator=gen) * 2
    beta = torch.rand(b, heads, generator=gen)
    state = torch.randn(b, heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def _reference(q, k, v, g, beta, state):
    """delta_rule_recurrent over one token, key heads repeated to the value heads: (o, new state)."""
    groups = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    out, states = delta_rule_recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], state)
    return out[:, 0], states[:, 0]


@pytest.mark.parametrize("dv", [8, 128])
@pytest.mark.parametrize("dk", [16, 128])
@pytest.mark.parametrize("heads", [1, 4, 16])
@pytest.mark.parametrize("b", [1, 3, 32])
def test_decode_step_equals_the_recurrence(ext, b, heads, dk, dv):
    q, k, v, g, beta, state = _inputs(b, heads, dk, dv, seed=b * heads + dk + dv)
    before = state.clone()
    out, new = ext.gated_delta_decode(q, k, v, g, beta, state)
    want_out, want_state = _reference(q, k, v, g, beta, state)
    assert torch.equal(state, before), "the input state must be left as it was"
    assert out.shape == (b, heads, dv) and new.shape == (b, heads, dk, dv)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(new, want_state, **TOL)


@pytest.mark.parametrize("dv", [40, 100])  # one full tile of 32 columns and a narrower one; none full
def test_decode_step_with_a_partial_column_tile_and_an_odd_key_dim(ext, dv):
    q, k, v, g, beta, state = _inputs(3, 2, 7, dv, seed=dv)
    out, new = ext.gated_delta_decode(q, k, v, g, beta, state)
    want_out, want_state = _reference(q, k, v, g, beta, state)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(new, want_state, **TOL)


def test_strided_inputs_grouped_key_heads_and_pool_rows_as_the_layer_passes_them(ext):
    """q, k of 2 key heads serving 8 value heads, v a view into the convolution's output, g and beta
    columns of wider tensors, the states read in place from a pool through row indices (-1: zeros),
    written into a given strided output; the pool stays as it was."""
    b, hk, heads, dk, dv = 5, 2, 8, 32, 64
    q, k, _, _, _, _ = _inputs(b, hk, dk, dv, seed=7)
    gen = torch.Generator().manual_seed(8)
    conv = torch.randn(b, 2 * hk * dk + heads * dv + 3, generator=gen)
    v = conv[:, 2 * hk * dk : 2 * hk * dk + heads * dv].view(b, heads, dv)
    g = (-torch.rand(b, 2 * heads, generator=gen) * 2)[:, ::2]  # every other column
    beta = torch.rand(b, 2 * heads, generator=gen)[:, heads:]
    pool = torch.randn(9, heads, dk, dv, generator=gen)
    before = pool.clone()
    rows = torch.tensor([4, -1, 0, 8, 4])
    out_state = torch.full((b, heads, dk, dv + 3), float("nan"))[..., :dv]
    assert not any(t.is_contiguous() for t in (v, g, beta, out_state))
    out, new = ext.gated_delta_decode(q, k, v, g, beta, pool, rows, out_state)
    assert new.data_ptr() == out_state.data_ptr() and torch.equal(pool, before)
    start = torch.stack([pool[r] if r >= 0 else torch.zeros(heads, dk, dv) for r in rows.tolist()])
    want_out, want_state = _reference(q, k, v.contiguous(), g.contiguous(), beta, start)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(out_state, want_state, **TOL)


def test_decode_step_in_place(ext):
    q, k, v, g, beta, state = _inputs(3, 4, 16, 32, seed=5)
    want_out, want_state = _reference(q, k, v, g, beta, state)
    out, new = ext.gated_delta_decode(q, k, v, g, beta, state, out_state=state)
    assert new.data_ptr() == state.data_ptr()
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(state, want_state, **TOL)


def test_decode_step_writes_each_new_state_at_its_out_row_of_the_pool_itself(ext):
    """The pool's spare slots as the output: each request's new state lands at its out row, the
    rows read stay as they were, and out rows that are read or repeated are refused."""
    q, k, v, g, beta, _ = _inputs(3, 2, 16, 24, seed=9)
    pool = torch.randn(7, 2, 16, 24, generator=torch.Generator().manual_seed(10))
    before = pool.clone()
    rows, out_rows = torch.tensor([2, -1, 0]), torch.tensor([6, 4, 5])
    out, new = ext.gated_delta_decode(q, k, v, g, beta, pool, rows, pool, out_rows)
    start = torch.stack([before[2], torch.zeros(2, 16, 24), before[0]])
    want_out, want_state = _reference(q, k, v, g, beta, start)
    assert new.data_ptr() == pool.data_ptr()
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(pool[[6, 4, 5]], want_state, **TOL)
    assert torch.equal(pool[:4], before[:4]), "rows that are no request's out row were written"
    with pytest.raises(RuntimeError, match="both read and written"):
        ext.gated_delta_decode(q, k, v, g, beta, pool, rows, pool, torch.tensor([6, 2, 5]))
    with pytest.raises(RuntimeError, match="two requests write"):
        ext.gated_delta_decode(q, k, v, g, beta, pool, rows, pool, torch.tensor([6, 6, 5]))


def test_decode_step_refuses_bad_operands(ext):
    q, k, v, g, beta, state = _inputs(2, 4, 16, 8)
    with pytest.raises(RuntimeError, match="float32"):
        ext.gated_delta_decode(q.double(), k, v, g, beta, state)
    with pytest.raises(RuntimeError, match="Hk dividing"):
        ext.gated_delta_decode(q[:, :3], k[:, :3], v, g, beta, state)
    with pytest.raises(RuntimeError, match="past the state"):
        ext.gated_delta_decode(q, k, v, g, beta, state, torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="single memory location"):
        ext.gated_delta_decode(q, k, v, g, beta, state, torch.tensor([1, 0]), state)


class _Batch:
    """The ForwardBatch fields GatedDeltaNet and its StatePool read."""

    def __init__(self, pool: StatePool, rows: list[int], prefix: list[int], extend: list[int], num_decode: int) -> None:
        self.state_pool, self.num_decode = pool, num_decode
        self.pool_rows = torch.tensor(rows)
        self.prefix_lens, self.extend_lens = prefix, extend
        self.seq_lens = [p + e for p, e in zip(prefix, extend)]
        self.batch_size = len(rows)

    def state_keep(self, i: int) -> int:
        return 1

    def state_marks_of(self, i: int) -> list[int]:
        return []


def _random_layer_and_pool(seed: int, layers: int) -> tuple[GatedDeltaSpec, GatedDeltaNet, StatePool]:
    """A Qwen3.5-like layer (2 key heads, 4 value heads) with random weights, the pool's last
    layer, over a pool of 6 rows of random states."""
    torch.manual_seed(seed)
    spec = GatedDeltaSpec(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=24, conv_kernel=4)
    layer = GatedDeltaNet(48, spec, state_layer=layers - 1, eps=1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    pool = StatePool(rows=6, layers=layers, conv_shape=spec.conv_state_shape, state_shape=spec.state_shape, conv_dtype=torch.float32)
    pool.conv.normal_()
    pool.state.normal_()
    return spec, layer, pool


def test_the_layer_decodes_with_the_kernel_as_with_the_pytorch_path(ext, monkeypatch):
    """A mixed batch (three decode rows, one of them fresh, and a prompt) through a Qwen3.5-like
    layer (2 key heads, 4 value heads): the same outputs and staged states with the kernel as
    without it, and the committed states untouched until commit. The kernel writes the decode
    rows' new states into spare slots, which commit makes theirs without a copy."""
    spec, layer, pool = _random_layer_and_pool(seed=0, layers=2)
    committed = pool.state.clone()
    batch = _Batch(pool, rows=[3, 0, 5, 1], prefix=[9, 0, 4, 6], extend=[1, 1, 1, 5], num_decode=3)
    x = torch.randn(8, 48)

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        pool.begin(batch)
        with torch.no_grad():
            y = layer(x, batch)
        homes = pool.home[:]
        assert torch.equal(pool.state[:, homes], committed[:, homes]), "a pass must not write the committed states"
        return y, [pool._staged[1][i][1] for i in range(batch.batch_size)]

    calls = []
    real = ext.gated_delta_decode
    monkeypatch.setattr(gated_delta, "cpu_kernels", lambda: type("Ext", (), {"gated_delta_decode": staticmethod(lambda *a: calls.append(1) or real(*a))}))
    y, staged = run()
    assert calls, "the kernel was not used"
    assert all(got.data_ptr() == pool.state[1, slot].data_ptr() for got, slot in zip(staged, pool._targets)), "not written into spare slots"
    monkeypatch.setattr(gated_delta, "cpu_kernels", lambda: None)
    want_y, want_staged = run()
    torch.testing.assert_close(y, want_y, **TOL)
    for got, want in zip(staged, want_staged):
        assert got.shape == want.shape == (1, *spec.state_shape)
        torch.testing.assert_close(got, want, **TOL)
    monkeypatch.setattr(gated_delta, "cpu_kernels", lambda: type("Ext", (), {"gated_delta_decode": staticmethod(real)}))
    run()
    for layer_id in (0, 1):  # the pool's other layer: the pass staged nothing there, so the commit must not need it
        for i in range(batch.batch_size):
            pool._staged[layer_id].setdefault(i, (torch.zeros(1, *spec.conv_state_shape), torch.zeros(1, *spec.state_shape)))
    targets = list(pool._targets)
    pool.commit([10, 1, 5, None])  # the prompt row's request ended: nothing kept
    assert [pool.home[r] for r in (3, 0, 5)] == targets and pool.home[1] == 1, "kept decode states move into their slots"
    torch.testing.assert_close(pool.committed(3)[1][1], want_staged[0][0], **TOL)
    assert sorted(pool._spare) == [0, 3, 5, 9], "the old homes are spare now, every other slot still owned"


@pytest.mark.parametrize("prompt_row", [True, False], ids=["mixed_batch", "decode_only"])
def test_the_fused_decode_path_equals_the_pytorch_path_from_in_proj_to_the_norm(ext, monkeypatch, prompt_row):
    """The decode rows from in_proj's output to the new states in C++ (``gated_delta_prepare``:
    the conv over states read in place, SiLU, q/k norms, g, beta; then the step), and with no
    prompt row in the pass the output norm too (``gated_rms_norm``): the layer's output and the
    staged conv and recurrent states are the PyTorch path's."""
    spec, layer, pool = _random_layer_and_pool(seed=1, layers=1)
    if prompt_row:
        batch = _Batch(pool, rows=[3, 0, 5, 1], prefix=[9, 0, 4, 6], extend=[1, 1, 1, 5], num_decode=3)
    else:
        batch = _Batch(pool, rows=[3, 0, 5], prefix=[9, 0, 4], extend=[1, 1, 1], num_decode=3)
    x = torch.randn(sum(batch.extend_lens), 48)
    calls: list[str] = []

    class Counting:
        def __getattr__(self, name):
            fn = getattr(ext, name)
            return lambda *a, **kw: calls.append(name) or fn(*a, **kw)

    def run(kernels) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        monkeypatch.setattr(gated_delta, "cpu_kernels", lambda: kernels)
        pool.begin(batch)
        with torch.no_grad():
            y = layer(x, batch)
        return y, [tuple(t.clone() for t in pool._staged[0][i]) for i in range(batch.batch_size)]

    y, staged = run(Counting())
    assert "gated_delta_prepare" in calls and ("gated_rms_norm" in calls) == (not prompt_row)
    want_y, want_staged = run(None)
    torch.testing.assert_close(y, want_y, **TOL)
    for (conv, state), (want_conv, want_state) in zip(staged, want_staged):
        torch.testing.assert_close(conv, want_conv, rtol=0, atol=0)
        torch.testing.assert_close(state, want_state, **TOL)
