"""Rotary position embeddings (rotate-half layout) for every ``rope_type`` transformers defines.

``rope_frequencies`` computes the inverse frequencies and the attention factor (which yarn and
longrope multiply into cos and sin) as transformers' ``ROPE_INIT_FUNCTIONS`` do, in fp32:
``default``, ``linear``, ``dynamic``, ``yarn``, ``longrope`` (alias ``su``), ``llama3`` and
``proportional`` (whose ``rotary_dim`` is the whole head: its ``partial_rotary_factor`` zeroes
the last angles instead). ``max_position_embeddings`` is the config's: the NTK reference length of
``dynamic`` and the yarn/longrope factor where the scaling gives none. ``RotaryEmbedding`` keeps
an fp32 cos/sin table indexed by position (the attention factor folded in), rotating the first
``rotary_dim`` dims of each head (partial rotary, e.g. Phi-4-mini's 0.75) and passing the rest
through; the C++ ``ext.rope`` serves only whole-head rotation.

Two types depend on the sequence length, which transformers takes as ``max(position_ids) + 1``
of the whole forward: ``dynamic`` (NTK) recomputes the base for lengths past
``max_position_embeddings``, and ``longrope`` switches from ``short_factor`` to ``long_factor``
for lengths past ``original_max_position_embeddings``. A serving batch mixes sequences, and a
cached key keeps the rotation it was written with, so the length is taken per token instead:

- ``table(positions, dtype)``: a token at position ``p`` is rotated as the last token of a
  ``p + 1``-token sequence, i.e. as transformers rotates it when decoding one token at a time.
  A token's rotation depends on its position alone, so batching, chunking and shared prefixes
  never change it, and sequences within the original length get exactly transformers' values.
  Past that length a sequence's early tokens keep the short (or unscaled) frequencies while its
  later ones use the long (or NTK) ones.
- ``table(positions, dtype, seq_lens)``: every token is rotated with the frequencies of its
  sequence's ``seq_lens`` entry, as transformers rotates a whole ``seq_len``-token forward. An
  engine that fixes one length per sequence (e.g. prompt plus ``max_new_tokens`` at admission)
  rotates each sequence consistently in one regime, which is what transformers' Phi-3 reaches by
  recomputing its cache at the switch (vLLM instead uses the long factors for all sequences once
  its context exceeds the original length, and a fixed NTK base for ``dynamic``). KV written
  under different regimes must not be shared: ``frequency_key(seq_len)`` tells them apart.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from radixlm.kernels.cpu_ext import cpu_kernels

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
_ALIASES = {"su": "longrope"}  # Phi-3's first name for longrope
_CPU = torch.device("cpu")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The configured ``rope_type`` (``type`` in older configs), ``default`` when unset."""
    if not scaling:
        return "default"
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    kind = _ALIASES.get(kind, kind)
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    return kind


def rope_frequencies(
    rotary_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    *,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp32) and cos/sin attention factor, as ``ROPE_INIT_FUNCTIONS[type](config, seq_len=seq_len)``."""
    kind = rope_type(scaling)
    params = scaling or {}
    if kind == "default":
        return _plain_inv_freq(theta, rotary_dim), 1.0
    if kind == "linear":
        return _plain_inv_freq(theta, rotary_dim) / params["factor"], 1.0
    if kind == "llama3":
        return _llama3_scale(_plain_inv_freq(theta, rotary_dim), params, _original_length(params, max_position_embeddings)), 1.0
    if kind == "dynamic":
        return _dynamic_init(rotary_dim, theta, params, _required(max_position_embeddings, kind), seq_len), 1.0
    if kind == "yarn":
        return _yarn(rotary_dim, theta, params, max_position_embeddings)
    if kind == "longrope":
        original = _original_length(params, max_position_embeddings)
        use_long = bool(seq_len) and seq_len > original
        return _longrope_inv_freq(rotary_dim, theta, params, long=use_long), _longrope_attention_factor(params, original, max_position_embeddings)
    return _proportional(rotary_dim, theta, params), 1.0


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, after the configured scaling."""
    return rope_frequencies(head_dim, theta, scaling)[0]


def _plain_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=_CPU).to(torch.float32) / dim
    return 1.0 / (theta**exponents)


def _required(value: int | None, kind: str) -> int:
    if value is None:
        raise ValueError(f"rope_type {kind!r} needs max_position_embeddings")
    return value


def _original_length(params: dict[str, Any], max_position_embeddings: int | None) -> int:
    """The pre-training length: the scaling's own, else the config's maximum (as transformers defaults it)."""
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    if original is None:
        raise ValueError(f"rope_type {rope_type(params)!r} needs original_max_position_embeddings")
    return int(original)


def _llama3_scale(inv_freq: torch.Tensor, params: dict[str, Any], old_len: int) -> torch.Tensor:
    factor = float(params["factor"])
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _dynamic_init(dim: int, theta: float, params: dict[str, Any], max_len: int, seq_len: int | None) -> torch.Tensor:
    """NTK frequencies for an integer length, in double precision as transformers computes them at init."""
    length = max(seq_len or max_len, max_len)
    factor = params["factor"]
    base = theta * ((factor * length / max_len) - (factor - 1)) ** (dim / (dim - 2))
    return _plain_inv_freq(base, dim)


def _dynamic_rows(lengths: torch.Tensor, dim: int, theta: float, factor: float, max_len: int) -> torch.Tensor:
    """NTK frequencies ``[N, dim/2]`` for lengths past ``max_len``, bit for bit as transformers' forward
    computes them from a tensor length (its scalar ``pow`` rounds a double result to fp32)."""
    scale = (factor * lengths / max_len) - (factor - 1)
    base = theta * (scale.double() ** (dim / (dim - 2))).to(torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=lengths.device).to(torch.float32) / dim
    return 1.0 / (base[:, None] ** exponents[None, :])


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, params: dict[str, Any], max_position_embeddings: int | None) -> tuple[torch.Tensor, float]:
    original = _original_length(params, max_position_embeddings)
    factor = params.get("factor")
    if factor is None:
        factor = _required(max_position_embeddings, "yarn") / original
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=_CPU) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=_CPU).to(torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of each frequency left unscaled
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def _longrope_inv_freq(dim: int, theta: float, params: dict[str, Any], *, long: bool) -> torch.Tensor:
    name = "long_factor" if long else "short_factor"
    factors = params[name]
    if len(factors) != dim // 2:
        raise ValueError(f"longrope {name} has {len(factors)} entries; rotary dim {dim} needs {dim // 2}")
    ext = torch.tensor(factors, dtype=torch.float32, device=_CPU)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=_CPU).float() / dim
    return 1.0 / (ext * theta**exponents)


def _longrope_attention_factor(params: dict[str, Any], original: int, max_position_embeddings: int | None) -> float:
    attention = params.get("attention_factor")
    if attention is not None:
        return float(attention)
    factor = params.get("factor")
    if factor is None:
        factor = _required(max_position_embeddings, "longrope") / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _proportional(dim: int, theta: float, params: dict[str, Any]) -> torch.Tensor:
    angles = int(params.get("partial_rotary_factor", 1.0) * dim // 2)
    turning = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64, device=_CPU).to(torch.float32) / dim))
    still = torch.zeros(dim // 2 - angles, dtype=torch.float32, device=_CPU)
    return torch.cat((turning, still)) / params.get("factor", 1.0)


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to query and key heads at given positions from a precomputed fp32 table."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None,
        *,
        rotary_dim: int | None = None,
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even, from 2 to head_dim {head_dim}; got {self.rotary_dim}")
        self.max_positions, self.theta, self.scaling = max_positions, theta, scaling
        self.max_position_embeddings = max_positions if max_position_embeddings is None else max_position_embeddings
        self.rope_type = rope_type(scaling)
        if self.rope_type == "proportional" and self.rotary_dim != head_dim:
            raise ValueError("proportional RoPE turns the whole head (its partial_rotary_factor zeroes angles); pass rotary_dim=head_dim")
        self.attention_factor = 1.0
        for name in ("cos", "sin", "inv_freq", "long_inv_freq"):
            self.register_buffer(name, torch.empty(0), persistent=False)
        self.rebuild()

    @property
    def _switch_length(self) -> int:
        """The length past which ``dynamic``/``longrope`` change frequencies."""
        if self.rope_type == "dynamic":
            return self.max_position_embeddings
        return _original_length(self.scaling, self.max_position_embeddings)

    def rebuild(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the cos/sin tables in fp32, e.g. after ``to_empty`` discarded them."""
        device = device if device is not None else self.cos.device
        inv_freq, self.attention_factor = rope_frequencies(
            self.rotary_dim, self.theta, self.scaling, max_position_embeddings=self.max_position_embeddings
        )
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=_CPU)
        freqs = torch.outer(positions, inv_freq)
        long_inv_freq = torch.empty(0, device=_CPU)
        if self.rope_type == "longrope":
            long_inv_freq = _longrope_inv_freq(self.rotary_dim, self.theta, self.scaling, long=True)
        start = self._switch_length if self.rope_type in ("dynamic", "longrope") else self.max_positions
        if start < self.max_positions:  # rows from here are rotated as the last of p + 1 > original tokens
            if self.rope_type == "longrope":
                freqs[start:] = torch.outer(positions[start:], long_inv_freq)
            else:
                lengths = torch.arange(start + 1, self.max_positions + 1, dtype=torch.int64, device=_CPU)
                freqs[start:] = positions[start:, None] * _dynamic_rows(lengths, self.rotary_dim, self.theta, self.scaling["factor"], start)
        self.cos = self._scaled(freqs.cos()).to(device)
        self.sin = self._scaled(freqs.sin()).to(device)
        self.inv_freq = inv_freq.to(device)
        self.long_inv_freq = long_inv_freq.to(device)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.attention_factor == 1.0 else x * self.attention_factor

    def table(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, rotary_dim/2]`` at the tokens' positions (``seq_lens``: per token, its sequence's length)."""
        if seq_lens is None or self.rope_type not in ("dynamic", "longrope"):
            cos = self.cos.index_select(0, positions)
            sin = self.sin.index_select(0, positions)
        else:
            freqs = positions.to(torch.float32)[:, None] * self._inv_freq_rows(seq_lens.to(positions.device))
            cos, sin = self._scaled(freqs.cos()), self._scaled(freqs.sin())
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)

    def _inv_freq_rows(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Per token, the inverse frequencies of a ``seq_lens``-token forward ``[T, rotary_dim/2]``."""
        beyond = (seq_lens > self._switch_length)[:, None]
        if self.rope_type == "longrope":
            return torch.where(beyond, self.long_inv_freq[None, :], self.inv_freq[None, :])
        lengths = seq_lens.to(torch.int64).clamp(min=self._switch_length)
        rows = _dynamic_rows(lengths, self.rotary_dim, self.theta, self.scaling["factor"], self._switch_length)
        return torch.where(beyond, rows, self.inv_freq[None, :])

    def frequency_key(self, seq_len: int) -> int:
        """Key of the frequencies ``seq_lens=seq_len`` selects: equal keys rotate alike, 0 within the original length."""
        if self.rope_type not in ("dynamic", "longrope") or seq_len <= self._switch_length:
            return 0
        return 1 if self.rope_type == "longrope" else seq_len


def apply_rotary(q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rotary_dim`` dims of ``q`` ``[T, H, D]`` and ``k`` ``[T, Hkv, D]`` with a ``RotaryEmbedding.table``."""
    cos, sin = rope
    rotary_dim = 2 * cos.shape[-1]
    ext = cpu_kernels() if q.device.type == "cpu" else None
    if ext is not None:  # the C++ kernel (the decode stack rotates with it too: the same values to the bit)
        cos2, sin2 = cos.reshape(cos.shape[0], cos.shape[-1]), sin.reshape(sin.shape[0], sin.shape[-1])
        if rotary_dim == q.shape[-1]:
            return ext.rope(q, cos2, sin2), ext.rope(k, cos2, sin2)
        return tuple(torch.cat((ext.rope(x[..., :rotary_dim], cos2, sin2), x[..., rotary_dim:]), dim=-1) for x in (q, k))
    if rotary_dim != q.shape[-1]:
        return _rotate_partial(q, cos, sin, rotary_dim), _rotate_partial(k, cos, sin, rotary_dim)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    return torch.cat((_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
