"""How long short requests wait while one long prompt is prefilled (chunked prefill fairness).

One request with a long prompt (default 7,000 tokens, one output token) starts first; a few
seconds later short requests arrive one by one. Reported: each short request's time to first
token and total time (p50, p90, max), and the long request's total time, side by side for the
scheduler as it was ("before": the long prompt keeps half the chunk budget every step while
others run, ``prefill_yield_share = 0``) and as it is ("after": the long prompt sits steps out
while others decode or a short prompt waits, for at most ``prefill_yield_share`` (default 0.2) of its own
prefill time). The two alternate ``--repeats`` times on one engine, with the cache flushed
before each run; the table shows each run and the medians.

    .venv/bin/python benchmarks/long_prompt.py --out benchmarks/results/long_prompt.md
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

import radixlm
from radixlm.runtime.server_args import ServerArgs

sys.path.insert(0, str(Path(__file__).parent))
from report import emit, machine  # noqa: E402

POLICIES = {"before": 0.0, "after": ServerArgs.prefill_yield_share}  # the default


async def run(engine: radixlm.Engine, long_tokens: int, shorts: int, short_new: int, delay: float, gap: float) -> dict:
    """One long request, then ``shorts`` short ones ``delay`` s later and ``gap`` s apart."""
    vocab = engine.config.vocab_size
    long_ids = [(i * 7919) % (vocab - 100) + 50 for i in range(long_tokens)]
    long_task = asyncio.ensure_future(engine.async_generate(input_ids=long_ids, sampling_params={"max_new_tokens": 1}))
    await asyncio.sleep(delay)
    short_tasks = []
    for k in range(shorts):
        params = {"max_new_tokens": short_new, "temperature": 0, "ignore_eos": True}
        short_tasks.append(asyncio.ensure_future(engine.async_generate(f"Short question number {k}: what is {k} plus {k}?", params)))
        await asyncio.sleep(gap)
    short_outs = await asyncio.gather(*short_tasks)
    long_out = await long_task
    return {
        "long_e2e": long_out["meta_info"]["e2e_latency"],
        "ttft": [o["meta_info"]["ttft"] for o in short_outs],
        "e2e": [o["meta_info"]["e2e_latency"] for o in short_outs],
        "outputs": [o["output_ids"] for o in short_outs],
    }


def p90(values: list[float]) -> float:
    """The 90th percentile (inclusive method: within the range of the values)."""
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long-tokens", type=int, default=7000)
    parser.add_argument("--shorts", type=int, default=8)
    parser.add_argument("--short-new-tokens", type=int, default=4)
    parser.add_argument("--delay", type=float, default=3.0, help="seconds between the long request and the first short one")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between short requests")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each policy, alternating")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in POLICIES}
    with radixlm.Engine(num_threads=args.threads, max_total_tokens=16384) as engine:
        chunk = engine.args.chunked_prefill_size
        # Warm up (kernels built or loaded, buffers allocated) so the first measured run is not the cold one.
        engine.generate(input_ids=list(range(50, 50 + 2 * chunk + 7)), sampling_params={"max_new_tokens": 4})
        for i in range(args.repeats):
            for name, share in POLICIES.items():
                engine.flush_cache()
                engine.scheduler.prefill_yield_share = share  # read by the loop at its next step; it is idle now
                res = asyncio.run(run(engine, args.long_tokens, args.shorts, args.short_new_tokens, args.delay, args.gap))
                results[name].append(res)
                print(f"run {i + 1} {name}: short p90 {p90(res['e2e']):.2f} s, long {res['long_e2e']:.1f} s", flush=True)
    same = all(r["outputs"] == results["before"][0]["outputs"] for runs in results.values() for r in runs)
    lines = [
        f"## Short requests behind a {args.long_tokens:,}-token prompt (SmolLM2-135M, fp32, {args.threads} threads)",
        "",
        f"Machine: {machine()}. {args.shorts} short requests ({args.short_new_tokens} new tokens, greedy) arrive {args.delay:g} s after the"
        f" long one, {args.gap:g} s apart; chunked prefill {chunk} tokens; {args.repeats} runs of each policy, alternating.",
        "",
        "| policy | run | short TTFT p50 (s) | short TTFT p90 (s) | short total p50 (s) | short total p90 (s) | short total max (s) | long prompt (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    medians = {}
    for name, runs in results.items():
        for i, r in enumerate(runs):
            lines.append(f"| {name} | {i + 1} | {statistics.median(r['ttft']):.2f} | {p90(r['ttft']):.2f} | {statistics.median(r['e2e']):.2f} | {p90(r['e2e']):.2f} | {max(r['e2e']):.2f} | {r['long_e2e']:.1f} |")
        medians[name] = (statistics.median(p90(r["e2e"]) for r in runs), statistics.median(r["long_e2e"] for r in runs))
        lines.append(f"| **{name}** | median | | | | **{medians[name][0]:.2f}** | | **{medians[name][1]:.1f}** |")
    lines += [
        "",
        f"Long prompt, after / before (medians): {medians['after'][1] / medians['before'][1]:.2f}."
        f" Short requests' greedy outputs identical in every run: {'yes' if same else 'NO'}.",
        "",
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
