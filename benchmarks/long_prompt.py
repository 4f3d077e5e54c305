"""How long short requests wait while one long prompt is prefilled (chunked prefill fairness).

One request with a long prompt (default 7,000 tokens, one output token) starts first; a few
seconds later short requests arrive one by one. Reported: each short request's time to first
token and total time, and the long request's total time. Before the scheduler left room for new
arrivals, short requests waited for the whole long prefill (issue 10: over 56 s behind a
7,350-token prompt).

    .venv/bin/python benchmarks/long_prompt.py --out benchmarks/results/reliability.md
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

import radixlm

sys.path.insert(0, str(Path(__file__).parent))
from report import emit  # noqa: E402


async def run(engine: radixlm.Engine, long_tokens: int, shorts: int, delay: float, gap: float) -> dict:
    vocab = engine.config.vocab_size
    long_ids = [(i * 7919) % (vocab - 100) + 50 for i in range(long_tokens)]
    t0 = time.monotonic()
    long_task = asyncio.ensure_future(engine.async_generate(input_ids=long_ids, sampling_params={"max_new_tokens": 1}))
    await asyncio.sleep(delay)
    short_tasks = []
    for k in range(shorts):
        short_tasks.append(asyncio.ensure_future(engine.async_generate(f"Short question number {k}: what is {k} plus {k}?", {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})))
        await asyncio.sleep(gap)
    short_outs = await asyncio.gather(*short_tasks)
    shorts_done = time.monotonic() - t0
    long_out = await long_task
    return {
        "long_e2e": long_out["meta_info"]["e2e_latency"],
        "long_done_at": time.monotonic() - t0,
        "shorts_done_at": shorts_done,
        "ttft": [o["meta_info"]["ttft"] for o in short_outs],
        "e2e": [o["meta_info"]["e2e_latency"] for o in short_outs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long-tokens", type=int, default=7000)
    parser.add_argument("--shorts", type=int, default=8)
    parser.add_argument("--delay", type=float, default=3.0, help="seconds between the long request and the first short one")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between short requests")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with radixlm.Engine(num_threads=args.threads, max_total_tokens=16384) as engine:
        res = asyncio.run(run(engine, args.long_tokens, args.shorts, args.delay, args.gap))
    ttft, e2e = res["ttft"], res["e2e"]
    text = "\n".join([
        f"## Short requests behind a {args.long_tokens:,}-token prompt (SmolLM2, fp32, {args.threads} threads, CPU `{torch.backends.cpu.get_cpu_capability()}`)",
        "",
        f"{args.shorts} short requests (8 new tokens) arrive {args.delay:g} s after the long one, {args.gap:g} s apart; chunked prefill {engine.args.chunked_prefill_size} tokens.",
        "",
        "| | p50 (s) | max (s) |",
        "|---|---:|---:|",
        f"| short: time to first token | {statistics.median(ttft):.2f} | {max(ttft):.2f} |",
        f"| short: total | {statistics.median(e2e):.2f} | {max(e2e):.2f} |",
        "",
        f"Long request: {res['long_e2e']:.1f} s in all; every short request had finished {res['shorts_done_at']:.1f} s after the long one started"
        f" (the long one finished at {res['long_done_at']:.1f} s).",
        "",
    ])
    emit(text, args.out)


if __name__ == "__main__":
    main()
