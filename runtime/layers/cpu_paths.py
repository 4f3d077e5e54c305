"""Choosing the CPU matmul form of the linear layers from this machine, not from a constant.

Which form of a weight-only linear layer is fastest depends on the CPU and on how many rows
(tokens) a call multiplies: with AVX-512 BF16, bf16 math beats int4 from ~16 rows on; on an
AVX2-only CPU bf16 is 2.6-4x slower than fp32 or int4 at every size. So ``--quantization auto``
(and ``int4_bf16``'s switch to its bf16 copy) follow a micro-benchmark:

- ``measure`` times each candidate form (``fp32``, ``bf16``, ``int8``, ``int4``) on random
  weights of the model's own linear shapes, at the row counts of ``ROW_BUCKETS``, with the
  engine's thread count, and sums them as one forward pass's linears;
- ``choose`` takes the fastest form per bucket (a call uses the bucket at or below its rows);
- ``plan_for`` caches the timings per machine (CPU model and capability, torch version,
  threads, shapes) under the radixlm cache, so only the first start on a machine measures.

``AutoLinear`` holds the weights of the forms its plan uses and runs each call in its bucket's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from radixlm.kernels.cpu_ext import build_key, source_files
from radixlm.kernels.paths import cache_dir
from radixlm.runtime.layers.quantized_linear import Int4Linear, Int8Linear

logger = logging.getLogger(__name__)

FORMS = ("fp32", "bf16", "int8", "int4")
ROW_BUCKETS = (1, 4, 16, 64, 256)
MARGIN = 0.1  # choose: a bucket keeps the smaller bucket's form while within 10% of the fastest
WORKING_SET = 256 << 20  # measure: fp32 bytes of distinct weights per shape (beyond the caches, as in a pass)
Shapes = dict[tuple[int, int], int]  # (out_features, in_features) -> how many such layers
Timings = dict[str, dict[int, float]]  # form -> rows -> seconds for all the model's linears


@dataclass(frozen=True)
class PathPlan:
    """The matmul form of each row-count bucket (``buckets[i]`` rows and up use ``forms[i]``)."""

    buckets: tuple[int, ...]
    forms: tuple[str, ...]

    def form_for(self, rows: int) -> str:
        """The form a call with ``rows`` rows runs in."""
        form = self.forms[0]
        for bucket, f in zip(self.buckets, self.forms):
            if rows >= bucket:
                form = f
        return form

    @property
    def used(self) -> frozenset[str]:
        """The forms some bucket runs in (their weights are kept)."""
        return frozenset(self.forms)

    def describe(self) -> str:
        """e.g. ``int4 for 1-15 rows, fp32 from 16``."""
        parts = []
        for i, (bucket, form) in enumerate(zip(self.buckets, self.forms)):
            if i and form == self.forms[i - 1]:
                continue
            parts.append((bucket, form))
        text = []
        for j, (bucket, form) in enumerate(parts):
            nxt = parts[j + 1][0] if j + 1 < len(parts) else None
            text.append(f"{form} from {bucket} rows" if nxt is None else f"{form} for {bucket}-{nxt - 1} rows")
        return ", ".join(text)


def choose(timings: Timings, forms: tuple[str, ...] = FORMS, margin: float = MARGIN) -> PathPlan:
    """The fastest of ``forms`` per measured bucket, except that a bucket keeps the form of the
    bucket below it while that is within ``margin`` of the fastest (fewer forms: fewer weight
    copies, and no switch on a difference the noise could make). Ties go to the earlier form."""
    forms = tuple(f for f in forms if f in timings and any(math.isfinite(t) for t in timings[f].values()))
    if not forms:
        raise ValueError("no timings for any candidate form")
    buckets = tuple(sorted(set.intersection(*(set(timings[f]) for f in forms))))
    if not buckets:
        raise ValueError("the candidate forms share no measured row count")
    chosen: list[str] = []
    for b in buckets:
        best = min(forms, key=lambda f: (timings[f][b], forms.index(f)))
        if chosen and timings[chosen[-1]][b] <= timings[best][b] * (1 + margin):
            best = chosen[-1]
        chosen.append(best)
    return PathPlan(buckets, tuple(chosen))


def linear_shapes(model: nn.Module) -> Shapes:
    """The (out, in) shapes of the model's linear layers and how often each occurs (the tied
    output head counts as one more layer of the embedding's shape)."""
    shapes: Shapes = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            key = (module.out_features, module.in_features)
            shapes[key] = shapes.get(key, 0) + 1
    if getattr(model, "lm_head", None) is None and hasattr(model, "embed_tokens"):
        vocab, hidden = model.embed_tokens.weight.shape
        shapes[(vocab, hidden)] = shapes.get((vocab, hidden), 0) + 1
    return shapes


def _form_layer(form: str, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A callable computing ``x @ weight.T`` in ``form`` (fp32 in and out)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if form == "fp32":
        return linear
    if form == "bf16":
        w = weight.to(torch.bfloat16)
        return lambda x: torch.nn.functional.linear(x.to(torch.bfloat16), w).float()
    if form == "int8":
        return Int8Linear(linear)
    if form == "int4":
        return Int4Linear(linear)
    raise ValueError(f"unknown matmul form {form!r}")


def measure(shapes: Shapes, forms: tuple[str, ...] = FORMS, rows: tuple[int, ...] = ROW_BUCKETS, repeats: int = 5) -> Timings:
    """Seconds each form takes for all the model's linears at each row count.

    Each shape gets as many distinct random weights as the model has layers of it (at most
    ``WORKING_SET`` bytes of them), called one after another, so the weights stream from memory
    as in a forward pass rather than sitting in a cache; the time per layer is scaled to the
    model's count."""
    gen = torch.Generator().manual_seed(0)
    out: Timings = {f: {r: 0.0 for r in rows} for f in forms}
    with torch.inference_mode():
        for (n, k), count in shapes.items():
            copies = max(1, min(count, WORKING_SET // (4 * n * k)))
            weights = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(copies)]
            for form in forms:
                if form == "int4" and k % 32:
                    out[form] = {r: float("inf") for r in rows}
                    continue
                try:
                    layers = [_form_layer(form, w) for w in weights]
                    for r in rows:
                        x = torch.randn(r, k, generator=gen)
                        for layer in layers:  # warm up
                            layer(x)
                        samples = []
                        for _ in range(repeats):
                            t = time.perf_counter()
                            for layer in layers:
                                layer(x)
                            samples.append((time.perf_counter() - t) / copies)
                        out[form][r] += statistics.median(samples) * count
                except Exception as exc:  # a form this torch build or CPU cannot run is never chosen
                    logger.warning("CPU matmul form %s cannot run here (%s: %s); it is left out", form, type(exc).__name__, exc)
                    out[form] = {r: float("inf") for r in rows}
                layers = None
    return out


def machine_key(shapes: Shapes, threads: int) -> str:
    """What the timings depend on: the CPU, torch (and the instruction set it and oneDNN are
    capped at), the thread count, the shapes and our C++ kernels' build (the int4 form runs one)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    kernels = build_key(source_files())
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "")  # bf16 matmuls run on oneDNN, which this caps
    parts = [cpu, torch.backends.cpu.get_cpu_capability(), onednn, torch.__version__, str(threads), json.dumps(sorted(shapes.items())), kernels]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def load_or_measure(shapes: Shapes, threads: int | None = None, measure_fn: Callable[[Shapes], Timings] = measure) -> tuple[Timings, Path, bool]:
    """The timings of this machine for ``shapes`` (cached), where they are kept, and whether
    they were measured now."""
    threads = threads or torch.get_num_threads()
    path = cache_dir() / "cpu_paths" / f"{machine_key(shapes, threads)}.json"
    try:
        data = json.loads(path.read_text())
        return {f: {int(r): float(s) for r, s in by_rows.items()} for f, by_rows in data["timings"].items()}, path, False
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    timings = measure_fn(shapes)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{time.monotonic_ns()}.tmp")
        tmp.write_text(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": threads, "torch": torch.__version__, "timings": timings}, indent=1))
        tmp.replace(path)
    except OSError as exc:  # a read-only cache: measure again next time
        logger.warning("could not cache the CPU matmul timings at %s: %s", path, exc)
    return timings, path, True


def plan_for(model: nn.Module, forms: tuple[str, ...] = FORMS, measure_fn: Callable[[Shapes], Timings] = measure) -> PathPlan:
    """The plan for ``model``'s linears on this machine (measured once per machine, then cached)."""
    shapes = linear_shapes(model)
    timings, path, fresh = load_or_measure(shapes, measure_fn=measure_fn)
    plan = choose(timings, forms)
    logger.info(
        "CPU matmul forms (%s, %d threads; %s %s): %s",
        torch.backends.cpu.get_cpu_capability(),
        torch.get_num_threads(),
        "measured now, cached at" if fresh else "timings cached at",
        path,
        plan.describe(),
    )
    return plan


class AutoLinear(nn.Module):
    """``y = x @ W.T (+ b)`` in the form the plan gives the call's row count."""

    def __init__(self, linear: nn.Linear, plan: PathPlan) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        self.plan = plan
        self.impls = nn.ModuleDict()
        for form in sorted(plan.used):
            if form in ("fp32", "bf16"):
                self.register_buffer(f"w_{form}", weight if form == "fp32" else weight.to(torch.bfloat16))
            else:
                self.impls[form] = _form_layer(form, weight)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The product in the form of ``x``'s row count; returns ``x``'s dtype."""
        form = self.plan.form_for(x.numel() // x.shape[-1])
        if form == "fp32":
            return torch.nn.functional.linear(x.float(), self.w_fp32, self.bias).to(x.dtype)
        if form == "bf16":
            y = torch.nn.functional.linear(x.to(torch.bfloat16), self.w_bf16).to(x.dtype)
        else:
            y = self.impls[form](x)
        return y if self.bias is None else y + self.bias

    def decode_weight(self, rows: int) -> tuple[torch.Tensor, int, torch.Tensor | None] | None:
        """``(weight, out_features, bias)`` (fp32 [n, K] or Q4_1 tiles) when calls of ``rows`` rows
        run in one of those forms, else None (see ``radixlm.runtime.layers.decode_stack``)."""
        form = self.plan.form_for(rows)
        if form == "fp32":
            return self.w_fp32, self.out_features, self.bias
        inner = self.impls["int4"].decode_weight(rows) if form == "int4" else None
        return None if inner is None else (inner[0], inner[1], self.bias)
