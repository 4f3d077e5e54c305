"""What one GGUF block type costs in the C++ kernels: a linear layer at GPT-OSS-20B's expert
shape (2,880 x 2,880) as stored in Q4_0, IQ4_NL, MXFP4 and Q8_0, against the same weights dense in
fp32, at 1 and 8 rows of x. Rounds alternate the types, so every type sees the same machine.

    cd /tmp && /work/main/.venv/bin/python /work/main/benchmarks/gguf_types.py --out /work/main/benchmarks/results/gguf_types.md
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from radixlm.runtime.layers.gguf_linear import GGUFLinear, block_shape

TYPES = {"Q4_0": 2, "IQ4_NL": 20, "MXFP4": 39, "Q8_0": 8}


def _blocks(name: str, w: np.ndarray) -> torch.Tensor:
    """``w`` as rows of ``name`` blocks (IQ4_NL, which the gguf package cannot quantize: random codes under w's scales)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if name != "IQ4_NL":
        return torch.from_numpy(quantize(w, GGMLQuantizationType[name]).copy())
    rng = np.random.default_rng(0)
    groups = w.reshape(w.shape[0], -1, 32)
    blocks = rng.integers(0, 256, size=(*groups.shape[:2], 18), dtype=np.uint8)
    blocks[..., :2] = (np.abs(groups).max(-1) / 127).astype(np.float16).view(np.uint8).reshape(*groups.shape[:2], 2)
    return torch.from_numpy(blocks.reshape(w.shape[0], -1))


def _time(fn, x: torch.Tensor, repeats: int) -> float:
    """Median µs of ``fn(x)`` over ``repeats`` calls."""
    fn(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2880)
    parser.add_argument("--k", type=int, default=2880)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    w = torch.randn(args.n, args.k) * 0.02
    layers = {name: GGUFLinear([(qtype, _blocks(name, w.numpy()))], args.k) for name, qtype in TYPES.items()}
    forms = {**{name: layer for name, layer in layers.items()}, "fp32": lambda x: x @ w.t()}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for rows in (1, 8):
            x = torch.randn(rows, args.k)
            for name, fn in forms.items():
                times.setdefault((name, rows), []).append(_time(fn, x, args.repeats))
    cpu = torch.backends.cpu.get_cpu_capability()
    lines = [
        "# GGUF block types in the C++ kernels",
        "",
        f"`{' '.join(['benchmarks/gguf_types.py', f'--n {args.n}', f'--k {args.k}', f'--rounds {args.rounds}', f'--repeats {args.repeats}'])}`; "
        f"CPU capability {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}. A {args.n} x {args.k} linear layer "
        "(GPT-OSS-20B's expert shape); each figure the median over rounds of each round's median µs per call; types alternate within a round.",
        "",
        "| form | bytes a weight | µs, 1 row | GB/s, 1 row | µs, 8 rows | vs fp32, 1 row |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    fp32 = statistics.median(times["fp32", 1])
    for name in forms:
        if name == "fp32":
            per = 4.0
        else:
            weights, nbytes = block_shape(TYPES[name])
            per = nbytes / weights
        one, eight = statistics.median(times[name, 1]), statistics.median(times[name, 8])
        lines.append(f"| {name} | {per:.3f} | {one:.0f} | {args.n * args.k * per / one / 1e3:.1f} | {eight:.0f} | {fp32 / one:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
