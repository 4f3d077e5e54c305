"""The C++ paged decode kernel alone: one decode row over a context, every layer's pool, time and KV bytes read per second.

SmolLM2's heads by default (9 query, 3 KV, 64 dims, 30 layers), an fp32 pool with the row's
slots in order, the split count the engine would choose; median of the passes.

    .venv/bin/python benchmarks/paged_decode.py [--contexts 150 770 2000] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from report import emit, machine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[150, 770, 2000])
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("Q", "KV", "DIM"))
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from radixlm.kernels.cpu_ext import cpu_kernels
    from radixlm.kernels.torch_decode import cpu_decode_splits

    ext = cpu_kernels()
    if ext is None:
        print("the C++ kernels did not build here", file=sys.stderr)
        return 1
    heads, kv_heads, dim = args.heads
    rows = ["| context | splits | µs per layer | KV MB per step | KV GB/s |", "|---:|---:|---:|---:|---:|"]
    for ctx in args.contexts:
        pools = [(torch.randn(ctx, kv_heads, dim), torch.randn(ctx, kv_heads, dim)) for _ in range(args.layers)]
        table = torch.arange(ctx, dtype=torch.int64).view(1, ctx)
        q = torch.randn(1, heads, dim)
        zero, lens = torch.zeros(1, dtype=torch.int64), torch.tensor([ctx])
        splits = cpu_decode_splits(1, ctx, args.threads)
        call = (q, table, zero, zero, lens, dim**-0.5, None, None, None, None, splits)
        times = []
        for i in range(3 + args.passes):  # 3 warm-up passes
            t = time.perf_counter()
            for k, v in pools:
                ext.paged_decode(call[0], k, v, *call[1:])
            if i >= 3:
                times.append(time.perf_counter() - t)
        seconds = statistics.median(times)
        nbytes = args.layers * ctx * kv_heads * dim * 4 * 2
        rows.append(f"| {ctx} | {splits} | {seconds / args.layers * 1e6:.1f} | {nbytes / 1e6:.1f} | {nbytes / seconds / 1e9:.1f} |")
    head = f"Paged decode kernel, batch 1, {heads}/{kv_heads} heads x {dim}, {args.layers} layers, fp32 KV; {args.threads} threads; {machine()}."
    emit(head + "\n\n" + "\n".join(rows) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
