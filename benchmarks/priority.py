"""Time to first token of an urgent request while 32 low-priority streams fill the batch and the pool.

Three measurements on the embedded SmolLM2, each on a fresh engine with the same settings
(``--max-running-requests 32`` and a KV pool just as large as the 32 streams grow to, so both
the batch and the pool are full when the urgent requests arrive):

- **unloaded**: the urgent requests alone, one after another;
- **priority**: ``--schedule-policy priority``; 32 streams of class 1 decode, then the urgent
  requests (class 0) arrive one after another; each preempts a stream to get in;
- **lpm** (the default policy, no classes): the same load and the same urgent requests, which
  wait for a stream to finish or be retracted.

Reported: the urgent requests' TTFT (median and max) in each, the ratio to unloaded (aim: at most
2x under the priority policy), preemptions, the streams' output tokens/s, and whether every
stream's greedy output is the same under both policies (preempted streams lose no tokens).

    .venv/bin/python benchmarks/priority.py --out benchmarks/results/priority.md
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import radixlm

sys.path.insert(0, str(Path(__file__).parent))
from report import emit, machine  # noqa: E402


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    """``n`` token ids unique to ``seed`` (no prefix shared with another seed)."""
    return [(seed * 7919 + i * 104729) % (vocab - 200) + 100 for i in range(n)]


async def _urgent(engine: radixlm.Engine, args, vocab: int, cls: int | None) -> list[dict]:
    outs = []
    for k in range(args.urgent):
        extra = {} if cls is None else {"priority": cls}
        params = {"max_new_tokens": args.urgent_new_tokens, "temperature": 0, "ignore_eos": True}
        outs.append(await engine.async_generate(input_ids=_ids(10_000 + k, args.urgent_prompt, vocab), sampling_params=params, **extra))
        await asyncio.sleep(args.gap)
    return outs


async def _loaded(engine: radixlm.Engine, args, vocab: int, by_class: bool) -> dict:
    """The streams, then (once all of them decode) the urgent requests; both sets of outputs."""
    params = {"max_new_tokens": args.stream_new_tokens, "temperature": 0, "ignore_eos": True}
    extra = {"priority": 1} if by_class else {}
    streams = [asyncio.ensure_future(engine.async_generate(input_ids=_ids(k, args.stream_prompt, vocab), sampling_params=params, **extra)) for k in range(args.streams)]
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        stats = engine.get_stats()
        if stats["num_running"] == args.streams and stats["num_waiting"] == 0:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(args.settle)  # every stream decodes: the batch is full
    start, tokens0 = time.monotonic(), engine.get_stats()
    urgent = await _urgent(engine, args, vocab, 0 if by_class else None)
    stream_outs = await asyncio.gather(*streams)
    stats = engine.get_stats()
    return {"urgent": urgent, "streams": stream_outs, "preempted": stats.get("total_preempted", 0), "retracted": stats["total_retracted"] - tokens0["total_retracted"], "window_s": time.monotonic() - start}


def _engine(args, policy: str) -> radixlm.Engine:
    return radixlm.Engine(num_threads=args.threads, schedule_policy=policy, max_running_requests=args.streams, max_total_tokens=args.pool)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--stream-prompt", type=int, default=96)
    parser.add_argument("--stream-new-tokens", type=int, default=160)
    parser.add_argument("--urgent", type=int, default=6, help="urgent requests, one after another")
    parser.add_argument("--urgent-prompt", type=int, default=128)
    parser.add_argument("--urgent-new-tokens", type=int, default=8)
    parser.add_argument("--pool", type=int, default=None, help="KV pool tokens (default: what the streams grow to)")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between urgent requests")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds the streams decode before the first urgent request")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.pool = args.pool or args.streams * (args.stream_prompt + args.stream_new_tokens)

    runs: dict[str, dict] = {}
    with _engine(args, "priority") as engine:
        vocab = engine.config.vocab_size
        engine.generate(input_ids=_ids(99_999, 64, vocab), sampling_params={"max_new_tokens": 4})  # warm-up
        runs["unloaded"] = {"urgent": asyncio.run(_urgent(engine, args, vocab, 0)), "preempted": 0, "retracted": 0}
        engine.flush_cache()
        runs["priority"] = asyncio.run(_loaded(engine, args, vocab, by_class=True))
        print(f"priority: {runs['priority']['preempted']} preempted, {runs['priority']['retracted']} retracted", flush=True)
    with _engine(args, "lpm") as engine:
        engine.generate(input_ids=_ids(99_999, 64, vocab), sampling_params={"max_new_tokens": 4})
        runs["lpm"] = asyncio.run(_loaded(engine, args, vocab, by_class=False))

    def ttfts(name: str) -> list[float]:
        return [o["meta_info"]["ttft"] for o in runs[name]["urgent"]]

    base = statistics.median(ttfts("unloaded"))
    same = [o["output_ids"] for o in runs["priority"]["streams"]] == [o["output_ids"] for o in runs["lpm"]["streams"]]
    lines = [
        f"## An urgent request's TTFT while {args.streams} low-priority streams run (the embedded SmolLM2-135M, its Q4_1 as stored, {args.threads} threads)",
        "",
        f"Machine: {machine()}. Streams: {args.stream_prompt}-token prompts, {args.stream_new_tokens} new tokens each (greedy),"
        f" `--max-running-requests {args.streams}`, a {args.pool}-token KV pool. Urgent: {args.urgent} requests of {args.urgent_prompt}"
        f" prompt tokens and {args.urgent_new_tokens} new tokens, {args.gap:g} s apart, sent once every stream decodes.",
        "",
        "| run | urgent TTFT median (s) | urgent TTFT max (s) | median / unloaded | streams preempted | streams retracted | streams' tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, run in runs.items():
        values = ttfts(name)
        rate = "" if "streams" not in run else f"{sum(o['meta_info']['completion_tokens'] for o in run['streams']) / max(o['meta_info']['e2e_latency'] for o in run['streams']):.1f}"
        lines.append(f"| {name} | {statistics.median(values):.3f} | {max(values):.3f} | {statistics.median(values) / base:.2f} | {run['preempted']} | {run['retracted']} | {rate} |")
    lines += [
        "",
        f"Aim (priority run, median / unloaded <= 2): {statistics.median(ttfts('priority')) / base:.2f}."
        f" Every stream's greedy output identical under both policies (preempted ones included): {'yes' if same else 'NO'}.",
        "",
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
