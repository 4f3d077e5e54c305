"""Scale-out side by side in one run: data-parallel replicas behind the router, and a
prefill/decode (PD) pair against one colocated engine. Every process on 127.0.0.1, SmolLM2.

A. Replicas: 2 workers (``radixlm serve --num-threads 1`` each) behind ``radixlm router`` with
   ``cache_aware`` and with ``round_robin`` (the same workers, caches flushed before each run,
   the policies alternating by round), and one engine with 2 threads alone (the hit rate a
   single cache gets), on the multi-turn chat and few-shot workloads of benchmarks/compare.py.
   Figures: cache hit rate (cached / prompt tokens, from usage), output tokens/s, TTFT p50/p90.
B. PD: short streamed chats while long prompts arrive, on one engine with 2 threads
   (colocated) and on a prefill worker + a decode worker (1 thread each) behind
   ``radixlm router --pd-disaggregation``. Figures: inter-token latency p50/p90 of the short
   chats, TTFT of the long prompts, KV transfer bytes and seconds (the decode worker's stats).

    .venv/bin/python benchmarks/scale_out.py [--rounds 1] [--out benchmarks/results/scale_out.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai
import torch

sys.path.insert(0, str(Path(__file__).parent))
from compare import MODEL, Recorder, few_shot, multi_turn  # noqa: E402
from peers import servers  # noqa: E402
from report import write  # noqa: E402
from workloads import SYSTEM_PROMPT, chat_questions, few_shot_prefix  # noqa: E402

RADIXLM = str(Path(sys.executable).parent / "radixlm")
REPLICA_WORKLOADS = {"multi-turn chat (16 x 4 turns)": multi_turn, "few-shot batch (64 x 32 tok)": few_shot}


def spawn_radixlm(name: str, *args: str, threads: int | None = None) -> servers.Launched:
    """Start a ``radixlm`` command (serve or router) on a free port and wait for /health."""
    port = servers.free_port()
    cmd = [RADIXLM, *args, "--port", str(port)]
    env = {"RADIXLM_NUM_THREADS": str(threads)} if threads else None
    if threads:
        cmd += ["--num-threads", str(threads)]
    return servers._spawn(name, cmd, env, port, " ".join(["radixlm", *args]), "/health", 300)


async def measure(base_url: str, fn) -> dict:
    """Run one workload against ``base_url``; its throughput, TTFTs and hit rate."""
    rec = Recorder()
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", timeout=1800, max_retries=0) as client:
        start = time.perf_counter()
        await fn(client, {}, rec)
        wall = time.perf_counter() - start
    return {
        "tok_s": rec.tokens / wall,
        "ttft_p50": statistics.median(rec.ttfts),
        "ttft_p90": statistics.quantiles(rec.ttfts, n=10)[-1],
        "hit_rate": rec.cached / rec.prompt if rec.prompt else 0.0,
    }


def metric_cells(r: dict) -> str:
    """A ``measure`` result as table cells: hit rate | tok/s | TTFT p50 | TTFT p90."""
    return f"{r['hit_rate']:.3f} | {r['tok_s']:.1f} | {r['ttft_p50']:.2f} | {r['ttft_p90']:.2f}"


def flush(urls: list[str]) -> None:
    """Empty the workers' prefix caches so each policy starts cold."""
    for url in urls:
        httpx.post(url + "/flush_cache", timeout=60).raise_for_status()


def replicas(rounds: int) -> dict[str, dict[str, list[dict]]]:
    """Part A: single engine vs 2 replicas under each policy, per workload."""
    results: dict[str, dict[str, list[dict]]] = {w: {} for w in REPLICA_WORKLOADS}

    def record(system: str, url: str, caches: list[str]) -> None:
        for w, fn in REPLICA_WORKLOADS.items():
            flush(caches)
            res = asyncio.run(measure(url, fn))
            results[w].setdefault(system, []).append(res)
            print(f"{system} {w}: {res['tok_s']:.1f} tok/s, hit {res['hit_rate']:.3f}, TTFT p50 {res['ttft_p50']:.2f} s", flush=True)

    for r in range(rounds):
        single = spawn_radixlm("single", "serve", "--served-model-name", MODEL, threads=2)
        try:
            record("single engine (2 threads)", single.base_url, [single.base_url])
        finally:
            servers.stop(single)
        workers = [spawn_radixlm(f"worker{i}", "serve", "--served-model-name", MODEL, threads=1) for i in range(2)]
        urls = [w.base_url for w in workers]
        try:
            policies = ["cache_aware", "round_robin"]
            for policy in policies if r % 2 == 0 else policies[::-1]:
                router = spawn_radixlm(f"router-{policy}", "router", "--worker-urls", *urls, "--policy", policy)
                try:
                    record(f"2 replicas, {policy}", router.base_url, urls)
                finally:
                    servers.stop(router)
        finally:
            for w in workers:
                servers.stop(w)
    return results


def long_prompts(n: int) -> list[str]:
    """``n`` distinct ~1,500-token prompts (distinct from their first token: nothing cached)."""
    body = few_shot_prefix() * 3
    return [f"Document {i}: read the notes below and summarise them.\n{body}\nSummary:" for i in range(n)]


async def pd_mix(base_url: str, long_every_s: float = 1.0) -> dict:
    """8 short streamed chats (64 tokens each) while 4 long prompts arrive one per ``long_every_s``."""
    chats, longs = Recorder(), Recorder()
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", timeout=1800, max_retries=0) as client:

        async def chat(i: int) -> None:
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": chat_questions(8)[i]}]
            await chats.chat(client, {"ignore_eos": True}, messages=messages, max_tokens=64)

        async def long(i: int) -> None:
            await asyncio.sleep(0.5 + i * long_every_s)
            await longs.completion(client, {}, prompt=long_prompts(4)[i], max_tokens=8)

        start = time.perf_counter()
        await asyncio.gather(*(chat(i) for i in range(8)), *(long(i) for i in range(4)))
        wall = time.perf_counter() - start
    gaps = sorted(chats.gaps)
    return {
        "itl_p50_ms": 1e3 * statistics.median(gaps),
        "itl_p90_ms": 1e3 * statistics.quantiles(gaps, n=10)[-1],
        "itl_max_ms": 1e3 * gaps[-1],
        "long_ttft_p50": statistics.median(longs.ttfts),
        "chat_tok_s": chats.tokens / wall,
        "wall": wall,
    }


def transfer_stats(url: str) -> dict:
    """The KV-transfer counters a PD worker reports in /get_server_info."""
    stats = httpx.get(url + "/get_server_info", timeout=60).json()["stats"]
    return {k: v for k, v in stats.items() if k.startswith("pd_")}


def disaggregation(rounds: int) -> dict[str, list[dict]]:
    """Part B: the mix on a colocated engine and on a PD pair behind the router."""
    results: dict[str, list[dict]] = {"colocated (1 engine, 2 threads)": [], "PD pair (1 + 1 threads)": []}
    for r in range(rounds):
        order = list(results) if r % 2 == 0 else list(results)[::-1]
        for system in order:
            if system.startswith("colocated"):
                eng = spawn_radixlm("colocated", "serve", "--served-model-name", MODEL, threads=2)
                try:
                    results[system].append(asyncio.run(pd_mix(eng.base_url)))
                finally:
                    servers.stop(eng)
                continue
            boot = f"127.0.0.1:{servers.free_port()}"
            prefill = spawn_radixlm("prefill", "serve", "--served-model-name", MODEL, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap", boot, threads=1)
            decode = spawn_radixlm("decode", "serve", "--served-model-name", MODEL, "--disaggregation-mode", "decode", "--disaggregation-bootstrap", boot, threads=1)
            router = spawn_radixlm("router-pd", "router", "--pd-disaggregation", "--prefill", prefill.base_url, "--decode", decode.base_url)
            try:
                res = asyncio.run(pd_mix(router.base_url))
                res.update(transfer_stats(decode.base_url))
                results[system].append(res)
            finally:
                for s in (router, decode, prefill):
                    servers.stop(s)
            print(f"round {r} {system}: {results[system][-1]}", flush=True)
    return results


def report(a: dict, b: dict, args: argparse.Namespace) -> str:
    """The markdown results file."""
    lines = [
        "# Scale-out: replicas behind the router, and prefill/decode disaggregation",
        "",
        f"Command: `{' '.join(sys.argv)}`  ",
        f"Date: {datetime.date.today()}; {os.cpu_count()} cores, CPU capability `{torch.backends.cpu.get_cpu_capability()}`; "
        f"SmolLM2-135M-Instruct (fp32), temperature 0; {args.rounds} round(s), best round by tok/s shown; every process on this machine.",
        "",
        "## A. Two replicas behind the router (1 thread each) vs one engine (2 threads)",
        "",
        "| workload | system | cache hit rate | output tok/s | TTFT p50 (s) | TTFT p90 (s) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for w, systems in a.items():
        for system, runs in systems.items():
            best = max(runs, key=lambda x: x["tok_s"])
            lines.append(f"| {w} | {system} | {metric_cells(best)} |")
    for w, systems in a.items():
        ca = max(systems["2 replicas, cache_aware"], key=lambda x: x["tok_s"])
        rr = max(systems["2 replicas, round_robin"], key=lambda x: x["tok_s"])
        one = max(systems["single engine (2 threads)"], key=lambda x: x["tok_s"])
        lines.append(
            f"\n{w}: cache_aware / round_robin throughput **{ca['tok_s'] / rr['tok_s']:.2f}x**; hit rate cache_aware "
            f"{ca['hit_rate']:.3f} vs single engine {one['hit_rate']:.3f} ({100 * (one['hit_rate'] - ca['hit_rate']):+.1f} points below) vs round_robin {rr['hit_rate']:.3f}."
        )
    lines += [
        "",
        "## B. Short chats while long prompts arrive: colocated vs prefill/decode pair",
        "",
        "8 streamed chats (64 tokens each) start together; 4 distinct ~1,500-token prompts (8 tokens out) arrive 0.5 s, 1.5 s, 2.5 s, 3.5 s later.",
        "",
        "| system | chat ITL p50 (ms) | chat ITL p90 (ms) | chat ITL max (ms) | long-prompt TTFT p50 (s) | chat tok/s | KV transfer |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for system, runs in b.items():
        best = min(runs, key=lambda x: x["itl_p90_ms"])
        kv = ", ".join(f"{k[3:]} {v:.4g}" if isinstance(v, float) else f"{k[3:]} {v}" for k, v in best.items() if k.startswith("pd_")) or "n/a"
        lines.append(f"| {system} | {best['itl_p50_ms']:.1f} | {best['itl_p90_ms']:.1f} | {best['itl_max_ms']:.1f} | {best['long_ttft_p50']:.2f} | {best['chat_tok_s']:.1f} | {kv} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--parts", default="AB", help="A (replicas), B (PD) or AB (default).")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "scale_out.md"))
    args = ap.parse_args()
    a = replicas(args.rounds) if "A" in args.parts else {}
    b = disaggregation(args.rounds) if "B" in args.parts else {}
    write(report(a, b, args), args.out)


if __name__ == "__main__":
    main()
