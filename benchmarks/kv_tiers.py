"""KV tiers under the radix cache: multi-turn sessions whose history is several times the KV pool.

32 sessions x 8 turns, taken round-robin (turn t of every session, then turn t+1), one request at
a time. Each session opens with its own document (``--doc-words``, 300: an agent's instructions and
retrieved context); each turn sends the session's whole history plus a short user message
(``--turn-words``, 20) and generates 16 tokens greedily. The history of all sessions is 4-8x the
pool, so without a lower tier every turn recomputes its session's history. In one run, on the
embedded SmolLM2-135M:

- ``unbounded``: a pool large enough for everything (the hit rate the tiers aim at);
- ``off``: the small pool, no tiers;
- ``host``: the small pool over a host-memory tier;
- ``host+disk``: the small pool over a small host tier over a disk tier, and a restart after
  turn 4 (a new engine on the same folder, warmed up by one unrelated request): its turn 5 is
  an old session's first turn after the restart;
- with ``--llama-cpp``: llama.cpp's server on the same text, its context the same size as the
  pool, with ``--cache-ram 0`` and with its host-memory prompt cache (``--cache-ram``).

Reported per configuration: TTFT p50/p90 (server side: radixlm's meta_info ttft, llama.cpp's
``timings.prompt_ms``), output tokens/s over the run, hit rate (cached prompt tokens over prompt
tokens) and what each tier served, and bytes read per hit from each tier.

    .venv/bin/python benchmarks/kv_tiers.py [--sessions 32] [--turns 8] [--pool 4096]
        [--doc-words 300] [--turn-words 20] [--llama-cpp] [--out benchmarks/results/kv_tiers.md]
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from report import machine, write  # noqa: E402

import radixlm  # noqa: E402

WORDS = ("river stone market letter garden window engine harbor silver winter orchard lantern signal "
         "meadow copper thunder valley pocket ladder mirror compass feather canyon ribbon station "
         "violet anchor blanket cabin desert forest glacier island jungle kettle lemon marble needle "
         "ocean pepper quartz rocket saddle tunnel umbrella velvet wagon yellow zebra basket candle").split()
MAX_NEW = 16


def words(rng: random.Random, n: int) -> str:
    """``n`` random words."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def session_texts(sessions: int, turns: int, doc_words: int, turn_words: int, seed: int = 0) -> tuple[list[str], list[list[str]]]:
    """Each session's opening (its document) and its user messages."""
    rng = random.Random(seed)
    openings = [f"Session {i}. The document: {words(rng, doc_words)}\n" for i in range(sessions)]
    return openings, [[words(rng, turn_words) for _ in range(turns)] for _ in range(sessions)]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Run:
    """One configuration's per-turn records."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ttft: dict[int, list[float]] = {}
        self.prompt = self.cached = self.output = 0
        self.tiers = {"host": 0, "disk": 0}
        self.seconds = 0.0
        self.tier_stats: list[dict] = []
        self.last_prompt: dict[int, int] = {}  # session -> its latest prompt's tokens

    def record(self, turn: int, session: int, ttft: float, prompt: int, cached: int, output: int, details: dict | None) -> None:
        self.ttft.setdefault(turn, []).append(ttft)
        self.last_prompt[session] = prompt + output
        self.prompt += prompt
        self.cached += cached
        self.output += output
        for tier in ("host", "disk"):
            self.tiers[tier] += (details or {}).get(tier, 0)

    def all_ttft(self, turns: range | None = None) -> list[float]:
        return [t for turn, v in self.ttft.items() if turns is None or turn in turns for t in v]


def run_radixlm(name: str, openings: list[str], texts: list[list[str]], pool: int, threads: int, tiers: dict,
                restart_after: int | None = None) -> Run:
    """The workload through in-process engines (a new one after ``restart_after`` turns)."""
    run = Run(name)
    histories = list(openings)
    engine = radixlm.Engine(max_total_tokens=pool, num_threads=threads, **tiers)
    start = time.perf_counter()
    try:
        for turn in range(len(texts[0])):
            if restart_after is not None and turn == restart_after:
                run.tier_stats.append(engine.get_stats().get("kv_tiers", {}))
                paused = time.perf_counter()
                engine.shutdown()
                engine = radixlm.Engine(max_total_tokens=pool, num_threads=threads, **tiers)
                engine.generate("Warm-up: a prompt no session shares.", {"max_new_tokens": 2})  # one-time start-up costs out of the TTFTs
                start += time.perf_counter() - paused  # the restart itself is not serving time
            for i, session in enumerate(texts):
                histories[i] += f"User: {session[turn]}\nAssistant:"
                out = engine.generate(histories[i], {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True})
                meta = out["meta_info"]
                run.record(turn, i, meta["ttft"], meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"], meta.get("cached_tokens_details"))
                histories[i] += out["text"] + "\n"
        run.tier_stats.append(engine.get_stats().get("kv_tiers", {}))
    finally:
        engine.shutdown()
    run.seconds = time.perf_counter() - start
    return run


def run_llama_cpp(name: str, openings: list[str], texts: list[list[str]], pool: int, threads: int, cache_ram_mib: int) -> Run:
    """The workload through llama.cpp's server (one slot whose context is ``pool`` tokens)."""
    import httpx
    from peers.servers import LLAMA_SERVER, free_port

    from radixlm.runtime.loader import default_model_path

    port = free_port()
    cmd = [str(LLAMA_SERVER), "-m", default_model_path(), "-t", str(threads), "-tb", str(threads), "--parallel", "1",
           "-c", str(pool), "--cache-prompt", "--cache-ram", str(cache_ram_mib), "--port", str(port), "--host", "127.0.0.1"]
    import subprocess

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(f"/tmp/llama-kv-tiers-{port}.log", "w"))
    run = Run(name)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"llama-server did not start; see /tmp/llama-kv-tiers-{port}.log")
            time.sleep(0.5)
        histories = list(openings)
        start = time.perf_counter()
        with httpx.Client(timeout=600) as client:
            for turn in range(len(texts[0])):
                for i, session in enumerate(texts):
                    histories[i] += f"User: {session[turn]}\nAssistant:"
                    body = {"prompt": histories[i], "n_predict": MAX_NEW, "temperature": 0.0, "cache_prompt": True, "ignore_eos": True}
                    out = client.post(base + "/completion", json=body).json()
                    t = out["timings"]
                    prompt = out.get("tokens_evaluated", t["prompt_n"])
                    run.record(turn, i, t["prompt_ms"] / 1000, prompt, prompt - t["prompt_n"], t["predicted_n"], None)
                    histories[i] += out["content"] + "\n"
        run.seconds = time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return run


def row(run: Run, reference: Run | None) -> str:
    ttft = run.all_ttft()
    hit = run.cached / run.prompt if run.prompt else 0.0
    ref = f" ({hit / (reference.cached / reference.prompt):.0%} of unbounded)" if reference is not None and reference.cached else ""
    read = ""
    if any(run.tier_stats):
        parts = []
        for tier in ("host", "disk"):
            loads = sum(st.get("loads", {}).get(tier, 0) for st in run.tier_stats if st)
            nbytes = sum(st.get("bytes_read", {}).get(tier, 0) for st in run.tier_stats if st)
            if loads:
                parts.append(f"{tier} {nbytes / loads / 1024:.0f} KiB")
        read = ", ".join(parts)
    return (f"| {run.name} | {percentile(ttft, 0.5) * 1000:.0f} | {percentile(ttft, 0.9) * 1000:.0f} | {run.output / run.seconds:.1f} | "
            f"{hit:.1%}{ref} | {run.tiers['host']} | {run.tiers['disk']} | {read or '-'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--pool", type=int, default=4096, help="KV pool tokens of the small-pool configurations")
    ap.add_argument("--doc-words", type=int, default=300, help="words of each session's opening document")
    ap.add_argument("--turn-words", type=int, default=20, help="words of each user message")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--host-gb", type=float, default=2.0)
    ap.add_argument("--small-host-gb", type=float, default=0.03, help="the host tier over the disk tier")
    ap.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp's server with and without --cache-ram")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    openings, texts = session_texts(args.sessions, args.turns, args.doc_words, args.turn_words)
    restart = args.turns // 2
    runs = {}
    runs["unbounded"] = run_radixlm("radixlm, unbounded pool", openings, texts, 1 << 16, args.threads, {})
    runs["off"] = run_radixlm(f"radixlm, pool {args.pool}, no tiers", openings, texts, args.pool, args.threads, {})
    runs["host"] = run_radixlm(f"radixlm, pool {args.pool}, host {args.host_gb} GiB", openings, texts, args.pool, args.threads, {"kv_host_cache_gb": args.host_gb})
    with tempfile.TemporaryDirectory() as folder:
        disk = {"kv_host_cache_gb": args.small_host_gb, "kv_disk_cache_dir": folder}
        runs["disk"] = run_radixlm(f"radixlm, pool {args.pool}, host {args.small_host_gb} GiB + disk, restart after turn {restart}",
                                   openings, texts, args.pool, args.threads, disk, restart_after=restart)
    if args.llama_cpp:
        runs["llama_off"] = run_llama_cpp(f"llama.cpp, -c {args.pool}, --cache-ram 0", openings, texts, args.pool, args.threads, 0)
        runs["llama_ram"] = run_llama_cpp(f"llama.cpp, -c {args.pool}, --cache-ram {int(args.host_gb * 1024)}", openings, texts, args.pool, args.threads, int(args.host_gb * 1024))
    mean_prompt = runs["unbounded"].prompt / (args.sessions * args.turns)
    working_set = sum(runs["unbounded"].last_prompt.values())
    lines = [
        "# KV tiers: multi-turn sessions larger than the pool",
        "",
        f"{datetime.date.today()}, {machine()}, torch {__import__('torch').__version__}; every configuration in one run, one request at a time,",
        f"{args.threads} threads. {args.sessions} sessions x {args.turns} turns (round-robin), a {args.doc_words}-word document opening each session, {args.turn_words} words a user turn, {MAX_NEW} greedy tokens a reply;",
        f"mean prompt {mean_prompt:.0f} tokens; the sessions' final histories sum to {working_set} tokens, {working_set / args.pool:.1f}x the pool of {args.pool}.",
        "",
        "| configuration | TTFT p50 ms | TTFT p90 ms | output tok/s | hit rate | tokens from host | tokens from disk | bytes read per load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [row(run, runs["unbounded"] if key != "unbounded" else None) for key, run in runs.items()]
    off, host, disk = runs["off"], runs["host"], runs["disk"]
    after = range(restart, restart + 1)
    cold_p50 = percentile(off.all_ttft(after), 0.5)
    restart_p50 = percentile(disk.all_ttft(after), 0.5)
    ceiling_p50 = percentile(runs["unbounded"].all_ttft(after), 0.5)  # the same turn with nothing ever evicted
    lines += [
        "",
        f"- Hit rate, host tier over unbounded pool: {host.cached / host.prompt / (runs['unbounded'].cached / runs['unbounded'].prompt):.0%} (aim: at least 90%).",
        f"- TTFT p50, no tiers over host tier: {percentile(off.all_ttft(), 0.5) / percentile(host.all_ttft(), 0.5):.1f}x (aim: at least 3x).",
        f"- After the restart, turn {restart + 1} (each old session's first turn) TTFT p50: {restart_p50 * 1000:.0f} ms against {cold_p50 * 1000:.0f} ms "
        f"without tiers (the same turn, recomputed): {cold_p50 / restart_p50:.1f}x (aim: at least 5x). The same turn on the unbounded pool, "
        f"where nothing was ever evicted: {ceiling_p50 * 1000:.0f} ms ({cold_p50 / ceiling_p50:.1f}x, the most any tier can give).",
    ]
    if args.llama_cpp:
        lo, lr = runs["llama_off"], runs["llama_ram"]
        lines.append(f"- llama.cpp, TTFT p50 without over with --cache-ram: {percentile(lo.all_ttft(), 0.5) / percentile(lr.all_ttft(), 0.5):.1f}x.")
    write("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
