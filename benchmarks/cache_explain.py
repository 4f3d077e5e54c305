"""The cost of cache explanations: few-shot throughput with the per-node bookkeeping on and off.

Workload: the few-shot batch of ``offline_throughput.py`` (requests sharing a ~420-token prefix,
a distinct question each, greedy, EOS ignored) on the embedded SmolLM2-135M-Instruct. Two engines
in one process, one with ``disable_cache_explain``; runs alternate on/off (and which goes first) so drift hits both,
and the median of each is compared. The time spent in the bookkeeping itself (reuse counting and
building each explanation, measured around the scheduler's hook) is reported as a share too.

    .venv/bin/python benchmarks/cache_explain.py [--num-requests 32] [--new-tokens 16] [--rounds 4]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from report import write  # noqa: E402
from workloads import few_shot_prompts  # noqa: E402

import radixlm  # noqa: E402


def timed_hook(engine: radixlm.Engine) -> list[float]:
    """Wrap the scheduler's per-request bookkeeping hook; the list collects its seconds."""
    spent: list[float] = []
    sched = engine.scheduler
    inner = sched._note_match

    def hook(req, node) -> None:
        t = time.perf_counter()
        inner(req, node)
        spent.append(time.perf_counter() - t)

    sched._note_match = hook
    return spent


def one_run(engine: radixlm.Engine, prompts: list[str], new_tokens: int) -> tuple[float, int]:
    """Seconds and output tokens of the whole batch, from an empty cache."""
    engine.flush_cache()
    sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    t = time.perf_counter()
    outs = engine.generate(prompts, sp)
    return time.perf_counter() - t, sum(len(o["output_ids"]) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cache_explain.md"))
    args = ap.parse_args()

    prompts = few_shot_prompts(args.num_requests)
    on, off = radixlm.Engine(), radixlm.Engine(disable_cache_explain=True)
    for e in (on, off):
        e.generate(prompts[0], {"max_new_tokens": 4})  # warm-up
    spent = timed_hook(on)
    times: dict[str, list[float]] = {"on": [], "off": []}
    tokens = 0
    for i in range(args.rounds):
        pair = (("on", on), ("off", off))
        for name, engine in pair if i % 2 == 0 else pair[::-1]:  # who goes first alternates
            dt, tokens = one_run(engine, prompts, args.new_tokens)
            times[name].append(dt)
    on.shutdown()
    off.shutdown()

    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: tokens / med[k] for k in med}
    cost = 1 - tps["on"] / tps["off"]
    paired = statistics.median(b / a for a, b in zip(times["on"], times["off"]))  # off/on time per round
    hook_share = sum(spent) / sum(times["on"])
    lines = [
        "# Cost of cache explanations (per-node origin bookkeeping)",
        "",
        f"Command: `{' '.join(sys.argv)}`  ",
        f"Date: {datetime.date.today()}; machine: {platform.machine()}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} intra-op threads, torch {torch.__version__}; model: embedded SmolLM2-135M-Instruct.",
        "",
        f"Workload: {args.num_requests} few-shot requests (shared ~420-token prefix), {args.new_tokens} greedy new tokens each, "
        f"{args.rounds} rounds per setting, alternating; median shown.",
        "",
        "| setting | median wall (s) | output tok/s | all runs (s) |",
        "|---|---:|---:|---|",
        *(f"| explanations {k} | {med[k]:.2f} | {tps[k]:.1f} | {', '.join(f'{t:.2f}' for t in times[k])} |" for k in ("on", "off")),
        "",
        f"Throughput cost of the bookkeeping: {cost * 100:+.2f}% median vs median, {(1 - paired) * 100:+.2f}% as the median of the per-round "
        "ratios (adjacent on/off runs; the spread of the runs above shows how noisy this shared CPU is).",
        f"Time inside the bookkeeping hook itself: {sum(spent) * 1e3:.1f} ms over {len(spent)} admissions, "
        f"{hook_share * 100:.3f}% of the 'on' wall time ({statistics.mean(spent) * 1e6:.0f} µs per request).",
        "",
    ]
    write("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
