"""Gated DeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5, over per-request states.

Each layer keeps, per running request, a recurrent state ``S`` (``[heads, key_dim, value_dim]``)
and the last ``K - 1`` inputs of its short causal convolution. A token ``t`` is mixed as::

    x_t            -> in_proj -> (qkv, z, b, a)
    qkv            -> causal depthwise conv over the last K inputs -> SiLU -> q, k, v
    q, k           -> L2-normalised over each head (q also scaled by key_dim ** -1/2)
    g_t = -exp(A_log) * softplus(a + dt_bias)   (log decay, per value head)
    beta_t = sigmoid(b)
    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
    o_t            -> RMSNorm(o_t) * SiLU(z_t) -> out_proj

A decode step applies that recurrence once per request, all requests at once. A prompt runs the
**chunked** form (the same sums regrouped into blocks of 64 tokens, as transformers computes
them): within a block the delta updates are solved as one triangular system, and the state is
carried from block to block. The states live in a ``StatePool`` (``radixlm.radix_cache.state_pool``)
slot per request-table row; this layer reads the committed state of each row and **stages** the
new one, which the scheduler commits once it knows how many of the row's tokens were kept: a row
that verifies drafts (jump-forward, speculation) stages the state after each of its last
``1 + drafts`` tokens, so a rejected draft leaves no trace.

The decode step is one fused kernel where one runs (``decode_kernel``): C++ on CPUs
(``gated_delta_decode``, kernels/csrc/gated_delta.cpp), Triton on GPUs
(kernels/triton_gated_delta.py). Each reads a decode row's state where the pool holds it, once,
and writes the new state once, into a spare slot of the pool (or its scratch room), which is
what gets staged and, once committed, becomes the row's state without a copy. On CPUs in float32
the steps before it are one C++ call too (``gated_delta_prepare``: the convolution over the conv
states read in place, SiLU, the q/k norms, g and beta), and a pass of decode rows only ends in
the C++ output norm (``gated_rms_norm``): some twenty small tensor operations a layer, each
costing more in dispatch than in arithmetic at batch 1;
``delta_rule_recurrent`` is the reference they match and the path everywhere else. A pass of
decode rows alone usually never reaches ``forward``: the fused decode stack
(``radixlm.runtime.layers.decode_stack``) calls the same three kernels for every layer of the
step in one C++ call, and stages the new states through ``stage_decode`` afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels.cpu_ext import cpu_kernels

if TYPE_CHECKING:
    from radixlm.runtime.distributed.group import TPGroup
    from radixlm.runtime.layers.forward_batch import ForwardBatch

CHUNK = 64  # tokens per block of the chunked form (transformers' default)


@dataclass(frozen=True)
class GatedDeltaSpec:
    """The shapes of a model's Gated DeltaNet layers."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads {self.num_v_heads} is not a multiple of linear_num_key_heads {self.num_k_heads}")
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be at least 2, got {self.conv_kernel}")

    @property
    def key_dim(self) -> int:
        """Width of all query (or key) heads together."""
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        """Width of all value heads together."""
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """One request's convolution state in one layer: its last ``K - 1`` inputs."""
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """One request's recurrent state in one layer."""
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def state_bytes(self, conv_dtype: torch.dtype) -> int:
        """Bytes of one request's states in one layer (the recurrent state is fp32)."""
        conv = self.conv_dim * (self.conv_kernel - 1) * torch.empty((), dtype=conv_dtype).element_size()
        return conv + self.num_v_heads * self.head_k_dim * self.head_v_dim * 4


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x`` over the norm of its last dimension (as the FLA kernels normalise q and k)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time. ``q``/``k`` ``[B, n, H, dk]`` (normalised and
    scaled), ``v`` ``[B, n, H, dv]``, ``g``/``beta`` ``[B, n, H]``, ``state`` ``[B, H, dk, dv]``
    (fp32); returns the outputs ``[B, n, H, dv]`` and the state after every token ``[B, n, H, dk, dv]``."""
    n = q.shape[1]
    outs, states = [], []
    for t in range(n):
        state = state * g[:, t].exp()[..., None, None]
        k_t = k[:, t].unsqueeze(-1)
        remembered = (state * k_t).sum(dim=-2)
        delta = (v[:, t] - remembered) * beta[:, t].unsqueeze(-1)
        state = state + k_t * delta.unsqueeze(-2)
        outs.append((state * q[:, t].unsqueeze(-1)).sum(dim=-2))
        states.append(state)
    return torch.stack(outs, dim=1), torch.stack(states, dim=1)


def delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence in blocks of ``chunk`` tokens. ``q``/``k``
    ``[n, H, dk]``, ``v`` ``[n, H, dv]``, ``g``/``beta`` ``[n, H]``, ``state`` ``[H, dk, dv]``
    (fp32); returns the outputs ``[n, H, dv]`` and the final state."""
    n = q.shape[0]
    pad = (chunk - n % chunk) % chunk
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, n + pad, d]
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))  # [H, n + pad]
    heads, blocks = q.shape[0], (n + pad) // chunk
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(heads, blocks, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(heads, blocks, chunk).cumsum(dim=-1)  # log of the decay from the block's start
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    between = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()  # [i, j]: decay from j to i
    system = (k_beta @ k.transpose(-1, -2)) * between
    within = (q @ k.transpose(-1, -2)) * between
    # the block's delta updates as one unit lower-triangular system: (I + strictly-lower(system)) X = rhs
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp().unsqueeze(-1), upper=False, unitriangular=True)
    out = torch.empty_like(new_values)
    q = q * decay.exp().unsqueeze(-1)  # reads the state as it was at the block's start
    k = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)  # writes it decayed to the block's end
    block_decay = decay[..., -1].exp()[..., None, None]
    for i in range(blocks):
        corrected = new_values[:, i] - k_decayed[:, i] @ state  # the part of the values the state does not predict
        out[:, i] = q[:, i] @ state + within[:, i] @ corrected
        state = state * block_decay[:, i] + k[:, i].transpose(-1, -2) @ corrected
    return out.reshape(heads, -1, out.shape[-1])[:, :n].transpose(0, 1), state


DecodeStep = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def decode_kernel(x: torch.Tensor, states: torch.Tensor) -> DecodeStep | None:
    """The fused decode step for tensors on ``x``'s device and ``states``': the C++ kernel on CPUs,
    the Triton kernel on GPUs (``(q, k, v, g, beta, states, rows, out_state, out_rows) -> (out,
    out_state)``); None where neither runs: the PyTorch path."""
    if x.device.type != states.device.type:
        return None
    if x.device.type == "cpu":
        ext = cpu_kernels()
        return ext.gated_delta_decode if ext is not None and hasattr(ext, "gated_delta_decode") else None
    if x.device.type == "cuda":
        try:
            from radixlm.kernels.triton_gated_delta import gated_delta_step
        except ImportError:  # no Triton: the PyTorch path
            return None
        return gated_delta_step if states.shape[-2] & (states.shape[-2] - 1) == 0 else None
    return None


def prepare_kernel(x: torch.Tensor, conv_states: torch.Tensor) -> DecodeStep | None:
    """The C++ kernel that turns the decode rows' in_proj output into the decode step's q, k, v, g,
    beta and new conv states (``gated_delta_prepare``), where it runs: float32 on CPUs; else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or conv_states.dtype != torch.float32:
        return None
    ext = cpu_kernels()
    return getattr(ext, "gated_delta_prepare", None) if ext is not None else None


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output, multiplied by SiLU of the gate ``z``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``weight * rmsnorm(x) * silu(z)`` over the last dimension, computed as transformers does."""
        dtype = x.dtype
        normed = self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(dtype)
        return (normed * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer: projections, short convolution, gated delta rule, gated norm.

    ``in_proj`` holds q, k, v (the convolution's channels), z, b and a in that order (Qwen3.5's
    four projections; Qwen3-Next's interleaved pair is reordered into them at load).
    ``state_layer`` indexes this layer's states in the pool. Under tensor parallelism ``spec`` is
    this rank's heads (``radixlm.runtime.models.sharding``) and ``group`` sums the ranks' outputs."""

    def __init__(self, hidden_size: int, spec: GatedDeltaSpec, state_layer: int, eps: float, group: TPGroup | None = None) -> None:
        super().__init__()
        self.spec, self.state_layer, self.group = spec, state_layer, group
        self.in_proj = nn.Linear(hidden_size, spec.conv_dim + spec.value_dim + 2 * spec.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(spec.conv_dim, spec.conv_dim, spec.conv_kernel, groups=spec.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(spec.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(spec.num_v_heads))
        self.norm = GatedRMSNorm(spec.head_v_dim, eps)
        self.out_proj = nn.Linear(spec.value_dim, hidden_size, bias=False)

    def part_sizes(self) -> list[int]:
        """Rows of ``in_proj``'s parts: qkv, z, b, a."""
        s = self.spec
        return [s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Mix each row's new tokens into its request's state; stages the new states in the pool."""
        s = self.spec
        mixed, z, b, a = self.in_proj(x).split(self.part_sizes(), dim=-1)
        pool = batch.state_pool
        nd = batch.num_decode
        step = decode_kernel(x, pool.state) if nd else None
        prepare = prepare_kernel(x, pool.conv) if step is not None else None
        first = nd if step is not None else 0  # the rows whose recurrent states the kernel reads in place
        conv_first = nd if prepare is not None else 0  # ... and whose conv states too
        conv_state, state = pool.read(self.state_layer, states_from=first, conv_from=conv_first)  # rows first.. / conv_first..
        weight = self.conv1d.weight[:, 0, :]  # [C, K]
        outs = []
        if prepare is not None:  # every decode row's one token at once, from in_proj's output to the new state in one kernel each
            out = self._decode_fused(prepare, step, mixed[:nd], a[:nd], b[:nd], weight, pool, batch)
            if nd == batch.batch_size:  # no prompt rows: the output norm fused too (prepare came from the same extension)
                return self._project(cpu_kernels().gated_rms_norm(out, z, self.norm.weight, self.norm.eps), x)
            outs.append(out)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        beta = b.float().sigmoid()
        if nd and prepare is None:  # every decode row's one token at once
            window = torch.cat([conv_state[:nd], mixed[:nd].unsqueeze(-1).to(conv_state.dtype)], dim=-1)  # [B, C, K]
            conv = F.silu((window * weight).sum(dim=-1).float())
            if step is not None:
                source, rows = pool.in_place(self.state_layer, nd)
                q, k, v = self._qkv(conv, repeat=False)  # the kernel maps value heads to key heads itself
                target, slots = pool.decode_targets(self.state_layer, nd)
                out, states = step(q, k, v, g[:nd], beta[:nd], source, rows, target, slots)  # the new states in target's slots (row i's at i without them)
                outs.append(out)
                self.stage_decode(pool, window[:, :, 1:], states, slots)
            else:
                out, states = self._recur(conv.unsqueeze(1), g[:nd].unsqueeze(1), beta[:nd].unsqueeze(1), state[:nd])
                outs.append(out[:, 0])
                for i in range(nd):
                    pool.stage(self.state_layer, i, window[i, :, 1:].unsqueeze(0), states[i])
        start = nd
        for i in range(nd, batch.batch_size):
            n, keep = batch.extend_lens[i], batch.state_keep(i)
            seq = torch.cat([conv_state[i - conv_first], mixed[start : start + n].t().to(conv_state.dtype)], dim=-1)  # [C, K - 1 + n]
            conv = F.silu(F.conv1d(seq.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=s.conv_dim)[0].float()).t()  # [n, C]
            tails = seq.unfold(1, s.conv_kernel - 1, 1)[:, -keep:].permute(1, 0, 2)  # the conv state after each of the last keep tokens
            q, k, v = self._qkv(conv)
            head = n - keep  # the chunked form up to the last keep tokens, then one at a time (each state kept)
            marks = batch.state_marks_of(i)
            row_state, parts, marked = state[i - first], [], {}
            lo = 0
            for hi in sorted({h for h in marks if h < head} | ({head} if head else set())):  # chunked, split at the marks
                o, row_state = delta_rule_chunked(q[lo:hi], k[lo:hi], v[lo:hi], g[start + lo : start + hi], beta[start + lo : start + hi], row_state)
                parts.append(o)
                marked[hi] = row_state
                lo = hi
            o, states = delta_rule_recurrent(
                q[None, head:], k[None, head:], v[None, head:], g[None, start + head : start + n], beta[None, start + head : start + n], row_state
            )
            parts.append(o[0])
            outs.append(torch.cat(parts))
            pool.stage(self.state_layer, i, tails.contiguous(), states[0])
            if marks:  # the states after h of the row's tokens: conv inputs h .. h + K - 2 and the recurrent state
                pool.stage_marks(self.state_layer, i, {h: (seq[:, h : h + s.conv_kernel - 1], marked[h] if h <= head else states[0, h - head - 1]) for h in marks})
            start += n
        core = torch.cat(outs).to(x.dtype)  # [T, Hv, dv]
        return self._project(self.norm(core, z.reshape(-1, s.num_v_heads, s.head_v_dim)), x)

    def _decode_fused(self, prepare: DecodeStep, step: DecodeStep, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      weight: torch.Tensor, pool, batch: ForwardBatch) -> torch.Tensor:  # fmt: skip
        """The decode rows' outputs ``[nd, Hv, dv]``: the C++ kernels from in_proj's output to the
        new states (read and written in the pool's slots), each row's states staged."""
        s, nd = self.spec, mixed.shape[0]
        conv_source, conv_rows = pool.in_place_conv(self.state_layer, nd)
        q, k, v, g, beta, tails = prepare(mixed, conv_source, conv_rows, weight, a, b, self.A_log, self.dt_bias, s.num_k_heads, s.head_k_dim, s.head_v_dim)
        source, rows = pool.in_place(self.state_layer, nd)
        target, slots = pool.decode_targets(self.state_layer, nd)
        out, states = step(q, k, v, g, beta, source, rows, target, slots)
        self.stage_decode(pool, tails, states, slots)
        return out

    def stage_decode(self, pool, tails: torch.Tensor, states: torch.Tensor, slots: torch.Tensor | None) -> None:
        """Stage each decode row's new conv tail (``tails[i]``) and the new state the kernel wrote
        (at ``slots[i]`` of ``states``, or at ``i`` without slots)."""
        at = range(tails.shape[0]) if slots is None else slots.tolist()
        for i, j in enumerate(at):
            pool.stage(self.state_layer, i, tails[i : i + 1], states[j : j + 1])

    def _project(self, normed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out_proj of the gated norm's output ``normed``, summed over the ranks under tensor parallelism."""
        out = self.out_proj(normed.reshape(x.shape[0], self.spec.value_dim))
        return out if self.group is None else self.group.all_reduce(out)

    def _qkv(self, conv: torch.Tensor, repeat: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (normalised, q scaled, repeated to the value heads unless ``repeat`` is false) and v
        of convolved ``[..., C]``."""
        s = self.spec
        q, k, v = conv.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        lead = conv.shape[:-1]
        q = l2norm(q.reshape(*lead, s.num_k_heads, s.head_k_dim)) * s.head_k_dim**-0.5
        k = l2norm(k.reshape(*lead, s.num_k_heads, s.head_k_dim))
        groups = s.num_v_heads // s.num_k_heads
        if repeat and groups > 1:
            q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
        return q, k, v.reshape(*lead, s.num_v_heads, s.head_v_dim)

    def _recur(self, conv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self._qkv(conv)
        return delta_rule_recurrent(q, k, v, g, beta, state)
