"""The decode step of the gated delta rule in Triton (GPUs): one token per request, states read in place.

For request ``b`` and value head ``h`` (reading key head ``h // (H / Hk)``), with its state ``S``
(``[dk, dv]``, fp32) taken from the state pool at row ``rows[b]`` (zeros where ``rows[b]`` is -1:
a request starting its sequence)::

    S <- S * exp(g);  d = beta * (v - S^T k);  S <- S + k d^T;  o = S^T q

Each program owns one ``(b, h)`` and a block of ``BLOCK_V`` value columns: it loads that
``[dk, BLOCK_V]`` tile of ``S`` once, applies the decay, the read-out of ``k``, the rank-one
update and the read-out of ``q`` in registers, and writes the new tile to ``new_states`` at row
``out_rows[b]`` (``b`` without them; the pool's committed state is never written: the scheduler
commits the staged state after the pass, by taking the row it was written to).
The columns of ``S`` are independent in this update, so the tiles need no communication.
``dk`` is a power of two up to 256 (every published model: 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, rows_ptr, out_ptr, new_ptr, out_rows_ptr,
    H, GROUPS, DV,
    s_qb, s_qh, s_vb, s_vh, s_gb, s_gh, s_sr, s_sh, s_sk, s_ob, s_oh, s_nb, s_nh, s_nk,
    DK: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    keys = tl.arange(0, DK)
    cmask = cols < DV
    row = tl.load(rows_ptr + b)
    tile = tl.load(states_ptr + tl.maximum(row, 0) * s_sr + h * s_sh + keys[:, None] * s_sk + cols[None, :], mask=cmask[None, :], other=0.0)
    tile = tile.to(tl.float32) * (row >= 0).to(tl.float32)  # a request starting its sequence: zeros
    hk = h // GROUPS  # the key head this value head reads
    q = tl.load(q_ptr + b * s_qb + hk * s_qh + keys).to(tl.float32)
    k = tl.load(k_ptr + b * s_qb + hk * s_qh + keys).to(tl.float32)
    v = tl.load(v_ptr + b * s_vb + h * s_vh + cols, mask=cmask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * s_gb + h * s_gh).to(tl.float32)
    beta = tl.load(beta_ptr + b * s_gb + h * s_gh).to(tl.float32)
    tile = tile * tl.exp(g)
    delta = (v - tl.sum(tile * k[:, None], axis=0)) * beta
    tile = tile + k[:, None] * delta[None, :]
    out = tl.sum(tile * q[:, None], axis=0)
    tl.store(out_ptr + b * s_ob + h * s_oh + cols, out, mask=cmask)
    out_row = tl.load(out_rows_ptr + b)
    tl.store(new_ptr + out_row * s_nb + h * s_nh + keys[:, None] * s_nk + cols[None, :], tile, mask=cmask[None, :])


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    rows: torch.Tensor,
    out_state: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for ``B`` requests: ``q``/``k`` ``[B, Hk, dk]`` (each key head serving
    ``H / Hk`` consecutive value heads), ``v`` ``[B, H, dv]``, ``g``/``beta`` ``[B, H]``, ``states``
    ``[rows, H, dk, dv]`` fp32 (the pool's, read only) and ``rows`` ``[B]`` (each request's pool
    row, -1 for zeros). Returns the outputs ``[B, H, dv]`` and the new states ``[B, H, dk, dv]``
    (written into ``out_state`` where given), both fp32; with ``out_rows`` ``[B]``, request ``b``'s
    new state goes to row ``out_rows[b]`` of ``out_state`` ``[N, H, dk, dv]`` (which may be
    ``states`` itself, at rows no request reads)."""
    b, key_heads, dk = q.shape
    heads, dv = v.shape[1], v.shape[-1]
    if k.shape != q.shape or v.shape[0] != b or heads % key_heads or g.shape != (b, heads) or beta.shape != (b, heads):
        raise ValueError(f"q/k [B, Hk, dk], v [B, H, dv] (H a multiple of Hk), g/beta [B, H] expected, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(g.shape)}, {tuple(beta.shape)}")
    if states.dtype != torch.float32 or states.shape[1:] != (heads, dk, dv) or states.stride(-1) != 1:
        raise ValueError(f"states must be fp32 [rows, {heads}, {dk}, {dv}] with contiguous columns, got {states.dtype} {tuple(states.shape)}")
    if dk & (dk - 1) or dk > 256:
        raise ValueError(f"the key head dim must be a power of two up to 256, got {dk}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    rows = rows.to(device=q.device, dtype=torch.int64)
    out = torch.empty(b, heads, dv, dtype=torch.float32, device=q.device)
    new = torch.empty(b, heads, dk, dv, dtype=torch.float32, device=q.device) if out_state is None else out_state
    if out_rows is None:
        if new.shape != (b, heads, dk, dv):
            raise ValueError(f"out_state must be fp32 [{b}, {heads}, {dk}, {dv}], got {tuple(new.shape)}")
        out_rows = torch.arange(b, device=q.device)
    elif out_state is None or out_rows.shape != (b,) or len(set(out_rows.tolist())) != b:
        raise ValueError("out_rows needs out_state and [B] distinct rows")
    elif new.data_ptr() == states.data_ptr() and bool(torch.isin(out_rows.cpu(), rows.cpu()).any()):
        raise ValueError("out_rows into the states themselves must be rows no request reads")
    if new.shape[1:] != (heads, dk, dv) or new.dtype != torch.float32 or new.stride(-1) != 1:
        raise ValueError(f"out_state must be fp32 [N, {heads}, {dk}, {dv}] with contiguous columns, got {new.dtype} {tuple(new.shape)}")
    out_rows = out_rows.to(device=q.device, dtype=torch.int64)
    if b == 0:
        return out, new
    block_v = min(triton.next_power_of_2(dv), 32 if dk > 64 else 64)
    grid = (b * heads, triton.cdiv(dv, block_v))
    _step_kernel[grid](
        q, k, v, g, beta, states, rows, out, new, out_rows,
        heads, heads // key_heads, dv,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        states.stride(0), states.stride(1), states.stride(2), out.stride(0), out.stride(1), new.stride(0), new.stride(1), new.stride(2),
        DK=dk, BLOCK_V=block_v,
    )  # fmt: skip
    return out, new
