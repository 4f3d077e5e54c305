"""Which tokens of a forward pass take which adapter, and the grouped low-rank deltas.

``build_forward_batch`` orders rows decode-first, then by adapter, so each adapter's tokens form
at most two runs (its decode rows, its prefill rows). A run is a segment ``[start, end)`` of the
flat token axis; base-model rows have none::

    tokens:   d0 d1 d2 d3 | p0 p0 p0 | p1 p1
    adapter:  -  a  a  b  | a  a  a  | -  -
    segments: (1, 3, a), (3, 4, b), (4, 7, a)

Each targeted projection runs once for every token (the base matmul), then each segment adds
``(x[s:e] @ A.T) @ B.T`` to its own rows (``B`` carries the scaling). The same sums, four ways:

- on CPUs, the C++ kernel (``kernels/csrc/lora_add.cpp``): every segment in one call per
  projection, each adapter's weights read where they lie (``_add_cpu``);
- on GPUs, the Triton kernels (``kernels/triton_lora.py``, ``Grouped``): a shrink and one expand
  per output part, over the segments' bounds as they are (no padding), with the adapters' pairs
  stacked as below;
- where neither kernel can run, PyTorch, one segment at a time (``add_lora_deltas`` over
  ``segments``): right for prefill, where a segment has many tokens;
- or PyTorch, all segments in two batched matmuls (``Stacked``): the segments' tokens gathered
  into a ``[K, L, in]`` block (each padded to the longest, ``L``), times the segments' ``A`` stacked
  ``[K, R, in]`` (ranks padded with zeros) and ``B`` stacked ``[K, out, R]``, then added back to
  their rows. A decode step of many adapters takes this: its cost does not grow with the
  number of launches, and the stacks are built once per set of adapters and reused every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch

from radixlm.runtime.lora.adapter import LoraAdapter

Segment = tuple[int, int, LoraAdapter]
STACK_PAD_LIMIT = 2.0  # batch the segments when padding them at most doubles the tokens


StackedPairs = tuple[torch.Tensor, list[torch.Tensor | None], list[int]]  # A.T [K, in, R]; per output part, B.T [K, R_part, rows] (None: no adapter targets it); the parts' rows


@dataclass(kw_only=True)
class AdapterStacks:
    """The segments' adapters' pairs stacked module by module, built on first use and kept while the set of adapters stays."""

    adapters: tuple[LoraAdapter, ...]  # one per segment, in segment order
    part_rows: dict[str, list[int]]  # module under a layer ("self_attn.qkv_proj") -> its output parts' rows
    weights: dict[str, StackedPairs | None] = field(default_factory=dict)  # module -> its stacks

    def stacks(self, module: str) -> StackedPairs | None:
        """``module``'s stacked pairs (None: no segment's adapter targets it)."""
        if module not in self.weights:
            self.weights[module] = _stack(self.adapters, module, self.part_rows[module.split(".", 2)[2]])
        return self.weights[module]


@dataclass(kw_only=True)
class Stacked(AdapterStacks):
    """The segments of a pass gathered as one padded block, for two batched matmuls a module."""

    gather: torch.Tensor  # [K * L] token of each padded position (pads repeat a real token)
    keep: torch.Tensor | None  # [n] the padded positions that are real tokens (None: no padding)
    dest: torch.Tensor  # [n] the token each real position adds into
    length: int  # L


@dataclass(kw_only=True)
class Grouped(AdapterStacks):
    """The segments' bounds on the device, for the Triton kernels (``kernels/triton_lora.py``): no padding."""

    kernels: ModuleType
    start: torch.Tensor  # [K] int64
    end: torch.Tensor  # [K] int64


@dataclass
class LoraBatch:
    """The adapter segments of one forward pass (and their stacked form when it pays)."""

    segments: list[Segment]
    part_rows: dict[str, list[int]]  # module under a layer -> its output parts' rows (``module_sizes``)
    stacked: Stacked | Grouped | None = None
    kernels: ModuleType | None = None  # the C++ CPU kernels: the deltas in one call a projection (``_add_cpu``)

    def adapters(self) -> list[str]:
        """The distinct adapters' names, in segment order."""
        return list(dict.fromkeys(a.name for _, _, a in self.segments))


def segments_of(lengths: Sequence[int], adapters: Sequence[LoraAdapter | None]) -> list[Segment]:
    """Merge consecutive rows (``lengths`` tokens each) of the same adapter into segments."""
    segments: list[Segment] = []
    start = 0
    for length, adapter in zip(lengths, adapters):
        end = start + length
        if adapter is not None:
            if segments and segments[-1][2] is adapter and segments[-1][1] == start:
                segments[-1] = (segments[-1][0], end, adapter)
            else:
                segments.append((start, end, adapter))
        start = end
    return segments


def stacked_plan(segments: list[Segment], device: torch.device, part_rows: dict[str, list[int]], weights: dict[str, StackedPairs | None] | None = None) -> Stacked | None:
    """The padded block of ``segments`` (None when there is one segment, or padding would cost
    more than ``STACK_PAD_LIMIT`` times the tokens). ``part_rows``: each module's output parts'
    rows (``module_sizes``); ``weights``: stacks cached for this set of adapters."""
    if len(segments) < 2:
        return None
    length = max(e - s for s, e, _ in segments)
    tokens = sum(e - s for s, e, _ in segments)
    if len(segments) * length > STACK_PAD_LIMIT * tokens:
        return None
    gather, keep, dest = [], [], []
    for k, (s, e, _) in enumerate(segments):
        n = e - s
        gather.extend(range(s, e))
        gather.extend([s] * (length - n))
        keep.extend(range(k * length, k * length + n))
        dest.extend(range(s, e))
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    padded = len(gather) != len(keep)
    adapters = tuple(a for _, _, a in segments)
    return Stacked(adapters=adapters, part_rows=part_rows, weights={} if weights is None else weights, gather=as_tensor(gather), keep=as_tensor(keep) if padded else None, dest=as_tensor(dest), length=length)


def grouped_plan(segments: list[Segment], kernels: ModuleType, device: torch.device, part_rows: dict[str, list[int]], weights: dict[str, StackedPairs | None] | None = None) -> Grouped | None:
    """The segments' bounds for the Triton ``kernels`` (None without segments); ``weights``: stacks cached for this set of adapters."""
    if not segments:
        return None
    bounds = torch.tensor([[s for s, _, _ in segments], [e for _, e, _ in segments]], dtype=torch.int64).to(device, non_blocking=True)
    adapters = tuple(a for _, _, a in segments)
    return Grouped(adapters=adapters, part_rows=part_rows, weights={} if weights is None else weights, kernels=kernels, start=bounds[0], end=bounds[1])


def add_lora_deltas(x: torch.Tensor, out: torch.Tensor, module: str, batch: LoraBatch) -> torch.Tensor:
    """``out`` (the base projection of ``x``) plus each segment's adapter delta on its rows (in place)."""
    if batch.kernels is not None:
        return _add_cpu(batch.kernels, x, out, module, batch)
    if isinstance(batch.stacked, Grouped):
        return _add_grouped(x, out, module, batch.stacked)
    if batch.stacked is not None:
        return _add_stacked(x, out, module, batch.stacked)
    rows = batch.part_rows[module.split(".", 2)[2]]
    for start, end, adapter in batch.segments:
        stacks = _compact(adapter, module, rows)
        if stacks is None:
            continue
        a, parts, _ = stacks
        h = x[start:end] @ a[0]
        col = lo = 0
        for b, n in zip(parts, rows):
            if b is not None:
                out[start:end, lo : lo + n].addmm_(h[:, col : col + b.shape[1]], b[0])
                col += b.shape[1]
            lo += n
    return out


def _compact(adapter: LoraAdapter, module: str, rows: list[int]) -> StackedPairs | None:
    """``adapter``'s pairs of ``module`` without B's zero blocks, built on first use."""
    if module not in adapter.compact:
        adapter.compact[module] = _stack((adapter,), module, rows)
    return adapter.compact[module]


def _compact_tiles(adapter: LoraAdapter, module: str, rows: list[int]) -> tuple[torch.Tensor, list[torch.Tensor | None]] | None:
    """``_compact``'s pairs as the C++ kernel reads them: A.T ``[in, R]`` with zero columns padding
    R to a multiple of 16 (its register tile), and each part's B.T ``[r, n]``; built on first use."""
    key = f"{module}#tiles"
    if key not in adapter.compact:
        stacks = _stack((adapter,), module, rows)
        if stacks is None:
            adapter.compact[key] = None
        else:
            a = stacks[0][0]
            adapter.compact[key] = (torch.nn.functional.pad(a, (0, -a.shape[1] % 16)).contiguous(), [None if b is None else b[0] for b in stacks[1]])
    return adapter.compact[key]


def _add_cpu(kernels: ModuleType, x: torch.Tensor, out: torch.Tensor, module: str, batch: LoraBatch) -> torch.Tensor:
    """The segments' deltas by the C++ kernel (``kernels/csrc/lora_add.cpp``): one call, each adapter's weights read in place."""
    rows = batch.part_rows[module.split(".", 2)[2]]
    starts, ends, a_list, b_list, cols = [], [], [], [], []
    for start, end, adapter in batch.segments:
        stacks = _compact_tiles(adapter, module, rows)
        if stacks is None:
            continue
        a, parts = stacks
        starts.append(start)
        ends.append(end)
        a_list.append(a)
        col = 0
        for b in parts:
            b_list.append(_EMPTY if b is None else b)
            cols.append(col)
            col += 0 if b is None else b.shape[0]
    if starts:
        kernels.lora_add(x if x.stride(-1) == 1 else x.contiguous(), out, starts, ends, a_list, b_list, cols, _starts(rows))
    return out


_EMPTY = torch.empty(0)  # a part the adapter leaves alone


def _add_grouped(x: torch.Tensor, out: torch.Tensor, module: str, plan: Grouped) -> torch.Tensor:
    stacks = plan.stacks(module)
    if stacks is None:
        return out
    a, parts, rows = stacks
    h = plan.kernels.lora_shrink(x, a, plan.start, plan.end)
    col = lo = 0
    for b, n in zip(parts, rows):
        if b is not None:
            plan.kernels.lora_expand_(out, h, b, plan.start, plan.end, col, lo)
            col += b.shape[1]
        lo += n
    return out


def _add_stacked(x: torch.Tensor, out: torch.Tensor, module: str, plan: Stacked) -> torch.Tensor:
    stacks = plan.stacks(module)
    if stacks is None:
        return out
    a, parts, rows = stacks
    k, length = len(plan.adapters), plan.length
    block = x.index_select(0, plan.gather).view(k, length, -1)
    h = torch.bmm(block, a)  # [K, L, sum of the parts' ranks]
    col = lo = 0
    for b, n in zip(parts, rows):
        if b is not None:
            delta = torch.bmm(h[:, :, col : col + b.shape[1]], b).view(k * length, n)
            if plan.keep is not None:
                delta = delta.index_select(0, plan.keep)
            out[:, lo : lo + n].index_add_(0, plan.dest, delta)
            col += b.shape[1]
        lo += n
    return out


def _stack(adapters: tuple[LoraAdapter, ...], module: str, rows: list[int]) -> StackedPairs | None:
    """The adapters' pairs of ``module`` stacked part by part: B's zero blocks (a fused module's
    parts an adapter packs side by side, ``adapter.py``) are left out, ranks padded with zeros."""
    per_part: list[list[tuple[torch.Tensor, torch.Tensor] | None]] = [[] for _ in rows]
    for adapter in adapters:
        pair = adapter.weights.get(module)
        for p, (lo, n) in enumerate(zip(_starts(rows), rows)):
            per_part[p].append(_part_pair(pair, adapter.blocks.get(module, ()), lo, n))
    if all(p is None for part in per_part for p in part):
        return None
    real = next(p for part in per_part for p in part if p is not None)
    width, like = real[0].shape[1], real[0]
    ranks = [max((p[0].shape[0] for p in part if p is not None), default=0) for part in per_part]
    a_all = like.new_zeros(len(adapters), width, sum(ranks))  # stored transposed: the products read them contiguously
    b_parts: list[torch.Tensor | None] = []
    col = 0
    for part, rank, n in zip(per_part, ranks, rows):
        if rank == 0:
            b_parts.append(None)
            continue
        b_all = like.new_zeros(len(adapters), rank, n)
        for k, p in enumerate(part):
            if p is not None:
                a, b = p
                a_all[k, :, col : col + a.shape[0]] = a.t()
                b_all[k, : a.shape[0]] = b.t()
        b_parts.append(b_all)
        col += rank
    return a_all, b_parts, rows


def _starts(rows: list[int]) -> list[int]:
    return [sum(rows[:i]) for i in range(len(rows))]


def _part_pair(pair: tuple[torch.Tensor, torch.Tensor] | None, blocks, lo: int, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``(A, B)`` that gives output rows ``lo .. lo + n`` of a packed pair (None: zero there)."""
    if pair is None:
        return None
    a, b = pair
    for r0, r1, c0, c1 in blocks:
        if r0 <= lo and lo + n <= r1:
            return a[c0:c1], b[lo : lo + n, c0:c1]
    return None
