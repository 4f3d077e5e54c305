"""The CPU matmul micro-benchmark on SmolLM2's shapes, the plan ``--quantization auto`` makes from
it, and decode speed per quantization mode side by side (batch 1 and batch 8, greedy).

    .venv/bin/python benchmarks/cpu_paths.py [--threads 2] [--out benchmarks/results/cpu_paths.md]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from report import machine, write  # noqa: E402

PROMPTS = ["The history of the printing press", "A recipe for bread", "How rivers form", "The rules of chess", "Why the sky is blue", "A letter to a friend", "The life of bees", "How engines work"]


def decode_speed(mode: str | None, threads: int, batch: int, tokens: int) -> tuple[float, list[list[int]]]:
    """Output tokens per second of ``batch`` greedy requests of ``tokens`` tokens each, and their tokens."""
    import radixlm

    with radixlm.Engine(quantization=mode, num_threads=threads, disable_radix_cache=True) as eng:
        params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
        eng.generate(PROMPTS[:batch], {**params, "max_new_tokens": 4})  # warm up
        t = time.perf_counter()
        outs = eng.generate(PROMPTS[:batch], params)
        return batch * tokens / (time.perf_counter() - t), [o["output_ids"] for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """Outputs identical, and the mean share of each output's tokens before it first differs."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) / len(x) for x, y in zip(a, b)]
    return same, sum(prefix) / len(prefix)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", default="benchmarks/results/cpu_paths.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from radixlm.runtime.layers import cpu_paths
    from radixlm.runtime.loader import default_model_path, load_model

    # The engines first: once this (main) thread has run torch's parallel ops it keeps an OpenMP
    # team of its own, libgomp then counts more threads than CPUs and stops spinning between
    # parallel regions, and an engine's loop thread decodes a batch of 1 about 2.7x slower (see
    # the results file); so the micro-benchmark, which runs here, comes after them.
    speeds, reference = [], None
    for mode in (None, "int8", "int4", "int4_bf16", "auto"):
        (b1, _), (b8, outs) = decode_speed(mode, args.threads, 1, args.tokens), decode_speed(mode, args.threads, 8, args.tokens)
        reference = reference or outs
        same, prefix = agreement(outs, reference)
        speeds.append(f"| {mode or 'none (fp32)'} | {b1:.1f} | {b8:.1f} | {same}/{len(outs)} | {prefix:.0%} |")
        print(speeds[-1], file=sys.stderr)
    model, _ = load_model(default_model_path(), torch.float32, torch.device("cpu"))
    shapes = cpu_paths.linear_shapes(model)
    del model
    t = time.perf_counter()
    timings = cpu_paths.measure(shapes)
    took = time.perf_counter() - t
    plan, pair = cpu_paths.choose(timings), cpu_paths.choose(timings, ("int4", "bf16"))
    rows = [f"| {form} | " + " | ".join(f"{timings[form][r] * 1e3:.1f}" for r in cpu_paths.ROW_BUCKETS) + " |" for form in cpu_paths.FORMS]
    lines = [
        "# CPU matmul forms chosen from the machine",
        "",
        f"Command: `benchmarks/cpu_paths.py --threads {args.threads} --tokens {args.tokens}`; date {datetime.date.today()}; "
        f"{machine()}, mkldnn bf16 {torch.ops.mkldnn._is_mkldnn_bf16_supported()}; "
        f"{args.threads} threads; torch {torch.__version__}; SmolLM2-135M-Instruct.",
        "",
        f"The micro-benchmark (`cpu_paths.measure`, what `--quantization auto` runs once per machine): ms for one forward "
        f"pass's linear layers ({sum(shapes.values())} layers in {len(shapes)} shapes, the tied head included), median of 5, per row count; it took {took:.1f} s.",
        "",
        "| form | " + " | ".join(f"{r} rows" for r in cpu_paths.ROW_BUCKETS) + " |",
        "|---|" + "---:|" * len(cpu_paths.ROW_BUCKETS),
        *rows,
        "",
        f"Choice of `auto` here: **{plan.describe()}**. `int4_bf16` here: {pair.describe()}.",
        "",
        f"Decode speed, output tokens/s, greedy, {args.tokens} tokens per request, no radix cache, one engine at a time in this run; "
        "and how the batch-8 greedy outputs compare with fp32's (identical, and the mean share of tokens before the first difference):",
        "",
        "| --quantization | batch 1 | batch 8 | identical to fp32 | tokens before a difference |",
        "|---|---:|---:|---:|---:|",
        *speeds,
    ]
    write("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
