"""Side-by-side comparison with peers on five workloads, over the OpenAI API, in one run.

Workloads (same prompts for every system; data in benchmarks/workloads.py):
1. few-shot batch: 64 requests sharing a ~420-token prefix, 32 new tokens each;
2. multi-turn chat: 16 sessions x 4 turns, each turn resending the whole history;
3. agent loop: ReAct-style steps over a ~600-token tool description, 8 concurrent agents;
4. JSON extraction under a JSON schema (response_format json_schema);
5. single stream: one request, 256 new tokens (batch-1 decode speed).

Systems run one at a time on 127.0.0.1 (radixlm from .venv, peers from their install folders, see
benchmarks/peers/): each is started, runs every workload, and is stopped before the next starts
(an idle server can still take CPU from the one measured); the order alternates round by round.
Output: a markdown table and a PNG chart in benchmarks/results/.

    .venv/bin/python benchmarks/compare.py [--systems radixlm llama.cpp vllm] [--rounds 1]
        [--radixlm-args "--quantization int4"]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).parent))
from peers import servers  # noqa: E402
from report import machine  # noqa: E402
from workloads import (  # noqa: E402
    EXTRACTION_SCHEMA,
    SYSTEM_PROMPT,
    agent_preamble,
    agent_tasks,
    chat_questions,
    extraction_prompts,
    few_shot_prompts,
)

MODEL = "smollm2"


class Recorder:
    """Collects output tokens, first-token times and cache figures of one workload run."""

    def __init__(self) -> None:
        self.tokens = 0
        self.prompt = 0
        self.cached = 0
        self.cache_reported = False
        self.ttfts: list[float] = []
        self.gaps: list[float] = []  # between successive content chunks of a stream

    async def completion(self, client: openai.AsyncOpenAI, extra: dict, **kw) -> str:
        """A streamed completion; returns its text."""
        return await self._stream(client.completions.create, extra, lambda c: c.choices[0].text if c.choices else "", **kw)

    async def chat(self, client: openai.AsyncOpenAI, extra: dict, **kw) -> str:
        """A streamed chat completion; returns its text."""
        return await self._stream(client.chat.completions.create, extra, lambda c: (c.choices[0].delta.content or "") if c.choices else "", **kw)

    async def _stream(self, create, extra: dict, piece, **kw) -> str:
        start = time.perf_counter()
        first = None
        last = start
        text = []
        usage = None
        stream = await create(model=MODEL, stream=True, stream_options={"include_usage": True}, temperature=0, extra_body=extra or None, **kw)
        async for chunk in stream:
            p = piece(chunk)
            if p:
                text.append(p)
                now = time.perf_counter()
                if first is None:
                    first = now - start
                else:
                    self.gaps.append(now - last)
                last = now
            if getattr(chunk, "usage", None):
                usage = chunk.usage
        if usage is not None:
            self.tokens += usage.completion_tokens
            self.prompt += usage.prompt_tokens
            details = getattr(usage, "prompt_tokens_details", None)
            if details is not None and getattr(details, "cached_tokens", None) is not None:
                self.cache_reported = True
                self.cached += details.cached_tokens
        self.ttfts.append(first if first is not None else time.perf_counter() - start)
        return "".join(text)


async def few_shot(client, extra, rec: Recorder) -> None:
    await asyncio.gather(*(rec.completion(client, {**extra, "ignore_eos": True}, prompt=p, max_tokens=32) for p in few_shot_prompts(64)))


async def multi_turn(client, extra, rec: Recorder) -> None:
    async def session(i: int) -> None:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        for turn in range(4):
            messages.append({"role": "user", "content": chat_questions(64)[(i * 4 + turn) % 64]})
            reply = await rec.chat(client, extra, messages=messages, max_tokens=32)
            messages.append({"role": "assistant", "content": reply})

    await asyncio.gather(*(session(i) for i in range(16)))


async def agent_loop(client, extra, rec: Recorder) -> None:
    preamble = agent_preamble()

    async def agent(i: int, task: str) -> None:
        transcript = f"Question: {task}\n"
        for step in range(4):
            text = await rec.completion(client, extra, prompt=preamble + transcript, max_tokens=48, stop=["Observation:"])
            transcript += text.rstrip() + f"\nObservation: {['no result', '42', '18 degrees, cloudy', 'free'][(i + step) % 4]}\n"

    await asyncio.gather(*(agent(i, t) for i, t in enumerate(agent_tasks(8))))


async def json_extraction(client, extra, rec: Recorder) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": EXTRACTION_SCHEMA, "strict": True}}
    sem = asyncio.Semaphore(8)

    async def one(p: str) -> None:
        async with sem:
            text = await rec.chat(client, extra, messages=[{"role": "user", "content": p}], max_tokens=96, response_format=fmt)
            json.loads(text)  # every system must return valid JSON here

    await asyncio.gather(*(one(p) for p in extraction_prompts(16)))


async def single_stream(client, extra, rec: Recorder) -> None:
    await rec.completion(client, {**extra, "ignore_eos": True}, prompt="Tell me a long story about a dragon who learns to cook.", max_tokens=256)


WORKLOADS = {
    "1. few-shot batch (64 x 32 tok)": few_shot,
    "2. multi-turn chat (16 x 4 turns)": multi_turn,
    "3. agent loop (8 agents x 4 steps)": agent_loop,
    "4. JSON extraction (16, schema)": json_extraction,
    "5. single stream (256 tok)": single_stream,
}


async def run_workload(server: servers.Launched, fn) -> dict:
    rec = Recorder()
    async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=1800, max_retries=3) as client:
        start = time.perf_counter()
        await fn(client, server.extra_body, rec)
        wall = time.perf_counter() - start
    return {
        "tok_s": rec.tokens / wall,
        "tokens": rec.tokens,
        "wall": wall,
        "ttft_p50": statistics.median(rec.ttfts),
        "ttft_p90": statistics.quantiles(rec.ttfts, n=10)[-1] if len(rec.ttfts) > 1 else rec.ttfts[0],
        "itl_p50": statistics.median(rec.gaps) if rec.gaps else None,
        "hit_rate": rec.cached / rec.prompt if rec.cache_reported and rec.prompt else None,
    }


def report(results: dict, systems: list[servers.Launched], args: argparse.Namespace) -> str:
    names = [s.name for s in systems]
    lines = ["# radixlm vs peers", "", f"Command: `{' '.join(sys.argv)}`  ", f"Date: {datetime.date.today()}; {machine()}; SmolLM2-135M-Instruct; temperature 0; {args.rounds} round(s); one system at a time (order alternating by round), each started cold; best round shown.", ""]
    lines += ["Systems:", *[f"- **{s.name}**: `{s.config}`" for s in systems], ""]
    head = "| workload | " + " | ".join(f"{n} tok/s | {n} TTFT p50 (s)" for n in names) + " | " + " | ".join(f"radixlm / {n}" for n in names if n != "radixlm") + " |"
    lines += [head, "|---|" + "---:|" * (2 * len(names) + len(names) - 1)]
    for w in WORKLOADS:
        cells = []
        best = {n: max(results[w][n], key=lambda r: r["tok_s"]) for n in names}
        for n in names:
            cells += [f"{best[n]['tok_s']:.1f}", f"{best[n]['ttft_p50']:.2f}"]
        ratios = [f"{best['radixlm']['tok_s'] / best[n]['tok_s']:.2f}x" for n in names if n != "radixlm"]
        lines.append(f"| {w} | " + " | ".join(cells + ratios) + " |")
    lines += ["", "Every figure of the best round (ITL: inter-token latency, the gap between successive streamed chunks; hit rate: cached / prompt tokens, where the server reports it):", ""]
    lines += ["| workload | system | output tok/s | TTFT p50 (s) | TTFT p90 (s) | ITL p50 (ms) | total time (s) | output tokens | cache hit rate |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for w in WORKLOADS:
        for n in names:
            r = max(results[w][n], key=lambda r: r["tok_s"])
            itl = f"{1e3 * r['itl_p50']:.1f}" if r.get("itl_p50") is not None else "n/a"
            hit = f"{r['hit_rate']:.3f}" if r["hit_rate"] is not None else "n/a"
            lines.append(f"| {w} | {n} | {r['tok_s']:.1f} | {r['ttft_p50']:.2f} | {r['ttft_p90']:.2f} | {itl} | {r['wall']:.1f} | {r['tokens']} | {hit} |")
    lines += ["", "Cache hit rate (cached / prompt tokens, where the server reports it):", ""]
    for w in WORKLOADS:
        parts = []
        for n in names:
            hr = max(results[w][n], key=lambda r: r["tok_s"])["hit_rate"]
            parts.append(f"{n} {hr:.3f}" if hr is not None else f"{n} n/a")
        lines.append(f"- {w}: " + ", ".join(parts))
    return "\n".join(lines) + "\n"


def chart(results: dict, names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        vals = [max(results[w][n], key=lambda r: r["tok_s"])["tok_s"] for w in WORKLOADS]
        ax.bar([x + i * width for x in range(len(WORKLOADS))], vals, width, label=n)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(WORKLOADS))])
    ax.set_xticklabels([w.split(" (")[0] for w in WORKLOADS], fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_title("SmolLM2-135M on 2 CPU cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", nargs="+", default=None, help="Default: radixlm and every installed peer.")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--radixlm-args", default="", help="Extra `radixlm serve` options, e.g. '--quantization int4'.")
    ap.add_argument("--workloads", nargs="+", type=int, default=None, help="Workload numbers to run (default: all).")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    global WORKLOADS
    if args.workloads:
        WORKLOADS = {k: v for i, (k, v) in enumerate(WORKLOADS.items(), 1) if i in args.workloads}
    names = args.systems or servers.installed()
    results = {w: {n: [] for n in names} for w in WORKLOADS}
    configs: dict[str, servers.Launched] = {}
    for r in range(args.rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            print(f"round {r}: starting {n} ...", flush=True)
            server = servers.start(n, args.threads, tuple(shlex.split(args.radixlm_args)))
            configs[n] = server
            try:
                for w, fn in WORKLOADS.items():
                    res = asyncio.run(run_workload(server, fn))
                    results[w][n].append(res)
                    print(f"round {r} {w} {n}: {res['tok_s']:.1f} tok/s, TTFT p50 {res['ttft_p50']:.2f} s", flush=True)
            finally:
                servers.stop(server)
    launched = [configs[n] for n in names]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = report(results, launched, args)
    (out / "compare.md").write_text(text + "\n![chart](compare.png)\n")
    (out / "compare.json").write_text(json.dumps(results, indent=1))
    chart(results, names, out / "compare.png")
    print(text)


if __name__ == "__main__":
    main()
