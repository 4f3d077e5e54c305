"""The Triton decode step of the gated delta rule, run under Triton's interpreter on CPU tensors
against the PyTorch recurrence (``delta_rule_recurrent``)."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest sets it too, before anything imports triton
if os.environ.get("CI"):  # CI installs Triton: a failed install must fail the run, not skip these
    import triton  # noqa: F401
else:
    pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot run")

from radixlm.kernels.triton_gated_delta import gated_delta_step  # noqa: E402
from radixlm.runtime.layers.gated_delta import delta_rule_recurrent, l2norm  # noqa: E402

pytestmark = pytest.mark.triton


@pytest.mark.parametrize(("batch", "heads", "key_heads", "dk", "dv"), [(1, 1, 1, 16, 8), (3, 4, 2, 32, 40), (5, 2, 2, 64, 16)])
def test_triton_step_equals_the_recurrence_and_leaves_the_pool_alone(batch, heads, key_heads, dk, dv):
    gen = torch.Generator().manual_seed(batch * 100 + dv)
    q = l2norm(torch.randn(batch, key_heads, dk, generator=gen)) * dk**-0.5
    k = l2norm(torch.randn(batch, key_heads, dk, generator=gen))
    v = torch.randn(batch, heads, dv, generator=gen)
    g = -torch.rand(batch, heads, generator=gen)
    beta = torch.rand(batch, heads, generator=gen)
    pool = torch.randn(7, heads, dk, dv, generator=gen)
    rows = torch.tensor([6, -1, 2, 0, 4][:batch])  # a request starting over (-1) reads zeros
    before = pool.clone()
    scratch = torch.full((batch, heads, dk, dv), float("nan"))
    out, new = gated_delta_step(q, k, v, g, beta, pool, rows, scratch)
    assert new.data_ptr() == scratch.data_ptr()
    start = torch.stack([pool[r] if r >= 0 else torch.zeros(heads, dk, dv) for r in rows.tolist()])
    groups = heads // key_heads
    q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    want, states = delta_rule_recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], start)
    torch.testing.assert_close(out, want[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new, states[:, 0], atol=1e-5, rtol=1e-5)
    assert torch.equal(pool, before)
    spare = torch.tensor([1, 3, 5][:batch]) if batch <= 3 else None  # the pool's own unread rows as the output
    if spare is not None:
        out, _ = gated_delta_step(q[:, ::groups].contiguous(), k[:, ::groups].contiguous(), v, g, beta, pool, rows, pool, spare)
        torch.testing.assert_close(pool[spare], states[:, 0], atol=1e-5, rtol=1e-5)
        untouched = [r for r in range(7) if r not in spare.tolist()]
        assert torch.equal(pool[untouched], before[untouched])
        with pytest.raises(ValueError, match="no request reads"):
            gated_delta_step(q[:, ::groups].contiguous(), k[:, ::groups].contiguous(), v, g, beta, pool, rows, pool, torch.tensor([int(rows[0])] + spare.tolist()[1:]))


def test_triton_step_refuses_shapes_it_cannot_run():
    q = torch.zeros(1, 2, 24)
    with pytest.raises(ValueError, match="power of two"):
        gated_delta_step(q, q, torch.zeros(1, 2, 8), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2, 24, 8), torch.tensor([0]))
    with pytest.raises(ValueError, match="fp32"):
        q = torch.zeros(1, 2, 16)
        gated_delta_step(q, q, torch.zeros(1, 2, 8), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2, 16, 8, dtype=torch.float16), torch.tensor([0]))
