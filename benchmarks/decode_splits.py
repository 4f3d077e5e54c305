"""Batch-1 decode with the C++ paged-decode kernel splitting each row over its sequence (as
``cpu_decode_splits`` chooses) vs one chunk per (row, KV head), alternating runs in one engine.

    .venv/bin/python benchmarks/decode_splits.py [--runs 4] [--tokens 128] [--out benchmarks/results/decode_splits.md]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from report import write  # noqa: E402
from workloads import few_shot_prefix  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--out", default="benchmarks/results/decode_splits.md")
    args = ap.parse_args(argv)
    import radixlm
    import radixlm.kernels.torch_decode as td

    chosen = td.cpu_decode_splits
    prompt = few_shot_prefix() * 2 + "Question: What is the capital of Peru?\nAnswer:"
    speeds: dict[str, list[float]] = {"split": [], "one chunk": []}
    with radixlm.Engine(quantization=args.quantization, num_threads=args.threads) as eng:
        context = len(eng.tokenizer(prompt).input_ids)
        params = {"max_new_tokens": args.tokens, "temperature": 0, "ignore_eos": True}
        eng.generate(prompt, {**params, "max_new_tokens": 4})  # the prompt is cached from here on
        try:
            for _ in range(args.runs):
                for mode in speeds:
                    td.cpu_decode_splits = chosen if mode == "split" else (lambda *a, **k: 1)
                    t = time.perf_counter()
                    eng.generate(prompt, params)
                    speeds[mode].append(args.tokens / (time.perf_counter() - t))
        finally:
            td.cpu_decode_splits = chosen
    splits = chosen(eng.config.num_kv_heads, context, args.threads)
    lines = [
        "# Splitting a decode row over its sequence (C++ paged decode)",
        "",
        f"Command: `benchmarks/decode_splits.py --runs {args.runs} --tokens {args.tokens} --quantization {args.quantization}`; date {datetime.date.today()}; "
        f"SmolLM2-135M-Instruct, {args.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}; batch 1, "
        f"a cached {context}-token prompt, {args.tokens} greedy tokens per run, the two modes alternating in one engine.",
        "",
        f"With {eng.config.num_kv_heads} KV heads a batch-1 step has {eng.config.num_kv_heads} (row, KV head) tasks for {args.threads} threads; split, each row is cut into {splits} chunks.",
        "",
        "| mode | tok/s per run | median |",
        "|---|---|---:|",
        *[f"| {mode} | {' / '.join(f'{x:.1f}' for x in xs)} | {statistics.median(xs):.1f} |" for mode, xs in speeds.items()],
    ]
    write("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
