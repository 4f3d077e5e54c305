"""The scale shapes an FP8 weight may carry (per tensor, per output row, or per block), checked once
for the CPU and Triton paths alike."""

from __future__ import annotations

import torch


def check_scale(scale: torch.Tensor, n: int, k: int, block: tuple[int, int] | None) -> None:
    """Raise ValueError unless ``scale`` is per tensor, per row, or ``block``'s scales of a ``[n, k]`` weight."""
    if block is not None:
        bn, bk = block
        if bn <= 0 or bk <= 0:
            raise ValueError(f"block must be two positive sizes, got {block}")
        want = (-(-n // bn), -(-k // bk))
        if tuple(scale.shape) != want:
            raise ValueError(f"block scales of a [{n}, {k}] weight in {bn}x{bk} blocks must be {list(want)}, got {tuple(scale.shape)}")
    elif scale.numel() not in (1, n) or scale.numel() == n > 1 and scale.dim() > 1 and tuple(scale.shape) != (n, 1):
        raise ValueError(f"scale of a [{n}, {k}] weight must have 1 or {n} elements (or block scales with a block), got {tuple(scale.shape)}")
