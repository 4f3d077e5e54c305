"""Reliability figures of a radixlm server: load with faults, memory over mixed requests, /health
latency under pressure, and SIGTERM under load.

    (a) 64 concurrent streams x 3 rounds, 25% of clients disconnecting at a random point, grammar
        and sampling faults injected (needs --debug-fault-injection): counts of each outcome, and
        what is left behind (requests, KV slots, admission slots).
    (b) server RSS over 300 mixed requests (plain, streamed, regex, json_schema, logprobs,
        disconnects): at start, after 100, 200, 300, and the slope.
    (c) /health latency p50/p99 at rest, while a 15 MiB body is posted, and while 64 streams run.
    (d) seconds from SIGTERM to exit with 16 streams running, the exit code, and what new
        requests got meanwhile (only when this script started the server).

    .venv/bin/python benchmarks/reliability.py --model tiny --out benchmarks/results/reliability.md
    .venv/bin/python benchmarks/reliability.py --base-url http://127.0.0.1:30000 --server-pid PID
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import torch

sys.path.insert(0, str(Path(__file__).parent))
from report import write  # noqa: E402

MiB = 1 << 20
REGEX = "[a-z ]{4,40}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}, "required": ["name", "age"]}


# ------------------------------------------------------------ the server
class Server:
    """A ``radixlm serve`` child process started by this script."""

    def __init__(self, model_path: str, extra: list[str]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        self.cmd = [str(Path(sys.executable).parent / "radixlm"), "serve", "--model-path", model_path, "--port", str(port), *extra]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="radixlm-reliability-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log: {self.log.name}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            raise RuntimeError(f"server did not become healthy; log: {self.log.name}")
        # The first forward pass may build the C++ kernels: do it before measuring anything.
        httpx.post(self.base_url + "/generate", json={"text": "warm up", "sampling_params": {"max_new_tokens": 2}}, timeout=600)

    def stop(self) -> int:
        """SIGTERM and wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def tiny_model() -> str:
    """A tiny random-weight Llama in a temporary folder (the test suite's own recipe)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from helpers import make_tiny_model

    return make_tiny_model("llama", Path(tempfile.mkdtemp(prefix="radixlm-tiny-")) / "llama")


async def stats(http: httpx.AsyncClient) -> dict:
    """The server's engine stats."""
    return (await http.get("/get_server_info")).json()["stats"]


async def wait_idle(http: httpx.AsyncClient, deadline_s: float = 120.0) -> tuple[dict, float]:
    """Poll until nothing runs or waits; the stats and the seconds it took."""
    start = time.monotonic()
    while True:
        s = await stats(http)
        if (s["num_running"] == 0 and s["num_waiting"] == 0) or time.monotonic() - start > deadline_s:
            return s, time.monotonic() - start
        await asyncio.sleep(0.1)


async def stream(http: httpx.AsyncClient, body: dict, cut_after: int | None = None) -> dict:
    """Stream one /generate; close the connection after ``cut_after`` events when given."""
    events: list[dict] = []
    done = False
    async with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "events": events, "done": False}
        if cut_after == 0:
            return {"status": 200, "events": events, "done": False}
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if cut_after is not None and len(events) >= cut_after:
                    break
    return {"status": 200, "events": events, "done": done}


def outcome(res: dict) -> str:
    """complete, failed-500, cut, http-<status> or incomplete."""
    if res["status"] != 200:
        return f"http-{res['status']}"
    if not res["done"] or not res["events"]:
        return "incomplete"
    last = res["events"][-1]
    if "error" in last:
        return f"failed-{last['error'].get('code')}"
    reason = last["meta_info"]["finish_reason"] or {}
    if reason.get("type") in ("length", "stop"):
        return "complete"
    return f"failed-{reason.get('status')}"


# ------------------------------------------------------------ (a) load with faults
async def load_with_faults(base: str, streams: int, rounds: int, seed: int) -> dict:
    """64 streams per round with disconnects and injected faults; counts and what is left behind."""
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    walls = []
    limits = httpx.Limits(max_connections=2 * streams, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
        passes0 = (await stats(http))["forward_passes"]
        for rnd in range(rounds):
            kinds = ["disconnect"] * (streams // 4) + ["fault-grammar"] * (streams // 16) + ["fault-sample"] * (streams // 16)
            kinds += ["plain"] * (streams - len(kinds))
            rng.shuffle(kinds)
            jobs = []
            for i, kind in enumerate(kinds):
                sp: dict = {"max_new_tokens": 16, "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(1000)}
                if kind == "disconnect":
                    sp.update(max_new_tokens=1000, ignore_eos=True)
                elif kind == "fault-grammar" or rng.random() < 0.25:
                    sp["regex"] = REGEX
                rid = f"{kind}-bench-{rnd}-{i}" if kind.startswith("fault-") else None
                body = {"text": f"Round {rnd} client {i}: once upon a time", "sampling_params": sp, **({"rid": rid} if rid else {})}
                jobs.append((kind, stream(http, body, rng.randrange(0, 16) if kind == "disconnect" else None)))
            t = time.perf_counter()
            results = await asyncio.gather(*(j for _, j in jobs))
            walls.append(time.perf_counter() - t)
            for (kind, _), res in zip(jobs, results):
                key = f"{kind} → {'cut' if kind == 'disconnect' and res['status'] == 200 else outcome(res)}"
                counts[key] = counts.get(key, 0) + 1
        final, idle_s = await wait_idle(http)
        probe = await http.post("/generate", json={"input_ids": [[5]], "sampling_params": {"max_new_tokens": 0}})
    return {"counts": counts, "round_walls": walls, "final": final, "idle_s": idle_s, "passes": final["forward_passes"] - passes0, "probe": probe.status_code}


# ------------------------------------------------------------ (b) memory over mixed requests
async def rss_over_mixed(base: str, pid: int, total: int, concurrency: int, seed: int) -> dict:
    """Server RSS (MiB) sampled every 10 requests over ``total`` mixed requests."""
    proc = psutil.Process(pid)
    rng = random.Random(seed)
    kinds = ["plain", "streamed", "regex", "json_schema", "logprobs", "disconnect"]
    samples: list[tuple[int, float]] = []
    tally: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            kind = kinds[i % len(kinds)]
            sp: dict = {"max_new_tokens": rng.choice([8, 16, 32]), "temperature": 0.7, "seed": abs(i)}
            body: dict = {"text": f"Request {i}: " + "the quick brown fox " * rng.randrange(1, 30), "sampling_params": sp}
            async with sem:
                if kind in ("plain", "regex", "json_schema", "logprobs"):
                    if kind == "regex":
                        sp["regex"] = REGEX
                    elif kind == "json_schema":
                        sp["json_schema"] = json.dumps(SCHEMA)
                    elif kind == "logprobs":
                        body.update(return_logprob=True, logprob_start_len=0, top_logprobs_num=5, return_text_in_logprobs=True)
                    status = (await http.post("/generate", json=body)).status_code
                else:
                    res = await stream(http, body, rng.randrange(1, 4) if kind == "disconnect" else None)
                    status = res["status"]
            tally[f"{kind} {status}"] = tally.get(f"{kind} {status}", 0) + 1

        await asyncio.gather(*(one(-1 - k) for k in range(len(kinds))))  # warm-up: one of each kind
        tally.clear()
        samples = [(0, proc.memory_info().rss / MiB)]
        for start in range(0, total, 10):
            await asyncio.gather(*(one(i) for i in range(start, min(start + 10, total))))
            samples.append((min(start + 10, total), proc.memory_info().rss / MiB))
        await wait_idle(http)
    xs, ys = [x for x, _ in samples], [y for _, y in samples]
    slope = statistics.linear_regression(xs, ys).slope * 100 if len(xs) > 1 else float("nan")
    at = {n: y for n, y in samples}
    return {"rss": {n: at[n] for n in (0, 100, 200, 300) if n in at}, "slope_per_100": slope, "tally": tally, "peak": max(ys)}


# ------------------------------------------------------------ (c) /health under pressure
class HealthProbe:
    """Polls /health from its own thread (so the client's own work never delays it); keeps latencies."""

    def __init__(self, base: str, pid: int | None = None, period: float = 0.05) -> None:
        self.base, self.period = base, period
        self.proc = psutil.Process(pid) if pid is not None else None
        self.peak_rss = 0.0
        self.latencies: list[float] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=120) as c:
            while not self._stop.is_set():
                t = time.perf_counter()
                try:
                    ok = c.get("/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.perf_counter() - t)
                self.errors += not ok
                if self.proc is not None:
                    self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss / MiB)
                self._stop.wait(self.period)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        """p50, p99 and max in milliseconds, count and non-200 answers."""
        lat = sorted(self.latencies) or [float("nan")]
        return {"n": len(self.latencies), "p50_ms": 1e3 * lat[len(lat) // 2], "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], "max_ms": 1e3 * lat[-1], "errors": self.errors}


async def health_latency(base: str, pid: int | None, body_mib: int, streams: int) -> dict:
    """/health latency at rest, during a big POST, and during many streams."""
    out: dict = {}
    with HealthProbe(base) as probe:
        await asyncio.sleep(2)
    out["at rest"] = probe.summary()
    big = json.dumps({"text": "hello world " * (body_mib * MiB // 12), "sampling_params": {"max_new_tokens": 1}}).encode()
    with HealthProbe(base, pid) as probe:
        t = time.perf_counter()
        r = await asyncio.to_thread(httpx.post, base + "/generate", content=big, headers={"Content-Type": "application/json"}, timeout=600)
        out["big_post"] = {"status": r.status_code, "seconds": time.perf_counter() - t, "bytes": len(big), "peak_rss": probe.peak_rss}
    if pid is not None:
        await asyncio.sleep(2)
        out["big_post"]["rss_after"] = psutil.Process(pid).memory_info().rss / MiB
    out[f"during a {len(big) / MiB:.0f} MiB POST"] = probe.summary()
    limits = httpx.Limits(max_connections=2 * streams, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
        with HealthProbe(base) as probe:
            body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
            await asyncio.gather(*(stream(http, body) for _ in range(streams)))
        out[f"during {streams} streams"] = probe.summary()
    return out


# ------------------------------------------------------------ (d) SIGTERM under load
async def sigterm_under_load(server: Server, streams: int) -> dict:
    """SIGTERM with ``streams`` streams running: seconds to exit, exit code, what everyone got."""
    limits = httpx.Limits(max_connections=2 * streams, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300, limits=limits) as http:
        body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        tasks = [asyncio.ensure_future(stream(http, body)) for _ in range(streams)]
        while (await stats(http))["num_running"] < streams:
            await asyncio.sleep(0.05)
        t = time.perf_counter()
        server.proc.send_signal(signal.SIGTERM)
        late: dict[str, int] = {}
        while server.proc.poll() is None:
            try:
                r = await http.post("/generate", json={"text": "late", "sampling_params": {"max_new_tokens": 1}}, timeout=5)
                key = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                key = type(exc).__name__ + (" (process alive)" if server.proc.poll() is None else "")
            late[key] = late.get(key, 0) + 1
            await asyncio.sleep(0.2)
        exit_s = time.perf_counter() - t
        results = await asyncio.gather(*tasks, return_exceptions=True)
    tally: dict[str, int] = {}
    for res in results:
        key = type(res).__name__ if isinstance(res, BaseException) else outcome(res)
        tally[key] = tally.get(key, 0) + 1
    return {"exit_s": exit_s, "exit_code": server.proc.returncode, "streams": tally, "late_requests": late}


# ------------------------------------------------------------ report
def fmt_counts(d: dict) -> str:
    """``a: 1, b: 2`` sorted by key."""
    return ", ".join(f"{k}: {v}" for k, v in sorted(d.items())) or "none"


def report(args: argparse.Namespace, model: str, server_cmd: str | None, res: dict) -> str:
    """The markdown result."""
    lines = [
        "# Reliability figures",
        "",
        f"Date {datetime.date.today()}; CPU capability `{torch.backends.cpu.get_cpu_capability()}`, {os.cpu_count()} cores (shared with other work); model `{model}`.",
        "",
        f"Command: `{' '.join(sys.argv)}`",
        "",
        f"Server command: `{server_cmd}`" if server_cmd else f"Server: {args.base_url} (started elsewhere)",
        "",
    ]
    if "load" in res:
        a = res["load"]
        lines += [
            f"## (a) Load with faults: {args.streams} streams × {args.rounds} rounds",
            "",
            "25% of clients disconnect after a random number of events (asking for 1000 tokens, so only the abort ends them early); "
            f"{args.streams // 16} grammar faults and {args.streams // 16} sampling faults per round; the rest plain or regex-constrained, 16 tokens.",
            "",
            "| outcome | count |",
            "|---|---:|",
            *[f"| {k} | {v} |" for k, v in sorted(a["counts"].items())],
            "",
            f"Round wall times (s): {', '.join(f'{w:.2f}' for w in a['round_walls'])}; forward passes for all rounds: {a['passes']}.",
            f"Afterwards (idle after {a['idle_s']:.2f} s): num_running {a['final']['num_running']}, num_waiting {a['final']['num_waiting']}, "
            f"running_slots {a['final']['running_slots']}, kv_invariant_holds {a['final'].get('kv_invariant_holds')}; a new request got HTTP {a['probe']}.",
            "",
        ]
    if "rss" in res:
        b = res["rss"]
        lines += [
            f"## (b) Server RSS over {args.rss_requests} mixed requests ({args.rss_concurrency} at a time)",
            "",
            "Kinds in turn: plain, streamed, regex, json_schema, logprobs (prompt and 5 top per token, with text), "
            "streams cut after 1-3 events; 8-32 new tokens. Measured after a warm-up of one request of each kind.",
            "",
            "| after requests | RSS (MiB) |",
            "|---:|---:|",
            *[f"| {n} | {v:.1f} |" for n, v in b["rss"].items()],
            "",
            f"Slope (least squares over samples every 10 requests): {b['slope_per_100']:+.2f} MiB per 100 requests; peak {b['peak']:.1f} MiB.",
            f"Requests by kind and status: {fmt_counts(b['tally'])}.",
            "",
        ]
    if "health" in res:
        c = res["health"]
        big = c.pop("big_post")
        lines += [
            "## (c) /health latency (polled every 50 ms from its own thread)",
            "",
            "| while | probes | p50 (ms) | p99 (ms) | max (ms) | non-200 |",
            "|---|---:|---:|---:|---:|---:|",
            *[f"| {k} | {v['n']} | {v['p50_ms']:.1f} | {v['p99_ms']:.1f} | {v['max_ms']:.1f} | {v['errors']} |" for k, v in c.items()],
            "",
            f"The {big['bytes'] / MiB:.1f} MiB POST /generate (one text that tokenizes past the context length) was answered HTTP {big['status']} "
            f"after {big['seconds']:.2f} s" + (f"; server RSS peaked at {big['peak_rss']:.0f} MiB meanwhile and was {big['rss_after']:.0f} MiB 2 s later." if big["peak_rss"] else "."),
            "",
        ]
    if "sigterm" in res:
        d = res["sigterm"]
        lines += [
            f"## (d) SIGTERM with {args.sigterm_streams} streams running (200 tokens each)",
            "",
            f"Exit after {d['exit_s']:.2f} s with code {d['exit_code']}. Streams: {fmt_counts(d['streams'])}. "
            f"Requests sent after the signal (every 0.2 s until exit): {fmt_counts(d['late_requests'])}.",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="A running server (start it with --debug-fault-injection for (a)); default: start one.")
    ap.add_argument("--server-pid", type=int, default=None, help="Its process id, for (b) RSS with --base-url.")
    ap.add_argument("--model", default="tiny", help="When starting a server: tiny (random-weight Llama), smollm2 (embedded), or a path.")
    ap.add_argument("--server-args", default="--max-total-tokens 32768 --max-running-requests 64", help="Extra options of the started server.")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rss-requests", type=int, default=300)
    ap.add_argument("--rss-concurrency", type=int, default=8)
    ap.add_argument("--body-mib", type=int, default=15)
    ap.add_argument("--sigterm-streams", type=int, default=16)
    ap.add_argument("--only", nargs="+", choices=["load", "rss", "health", "sigterm"], default=["load", "rss", "health", "sigterm"])
    ap.add_argument("--seed", type=int, default=10)
    ap.add_argument("--out", default=None, help="Write the markdown result here.")
    args = ap.parse_args()

    server = None
    if args.base_url:
        base, pid, model, cmd = args.base_url.rstrip("/"), args.server_pid, args.base_url, None
    else:
        from radixlm.runtime.loader import default_model_path

        model = {"tiny": None, "smollm2": default_model_path()}.get(args.model, args.model) or tiny_model()
        extra = [*args.server_args.split(), "--debug-fault-injection"]
        server = Server(model, extra)
        base, pid, cmd = server.base_url, server.proc.pid, " ".join(["radixlm", *server.cmd[1:]])
        model = args.model if args.model in ("tiny", "smollm2") else model
    res: dict = {}
    try:
        if "load" in args.only:
            res["load"] = asyncio.run(load_with_faults(base, args.streams, args.rounds, args.seed))
            print(res["load"], flush=True)
        if "rss" in args.only and pid is not None:
            res["rss"] = asyncio.run(rss_over_mixed(base, pid, args.rss_requests, args.rss_concurrency, args.seed))
            print(res["rss"], flush=True)
        if "health" in args.only:
            res["health"] = asyncio.run(health_latency(base, pid, args.body_mib, args.streams))
            print(res["health"], flush=True)
        if "sigterm" in args.only and server is not None:
            res["sigterm"] = asyncio.run(sigterm_under_load(server, args.sigterm_streams))
            print(res["sigterm"], flush=True)
    finally:
        if server is not None:
            server.stop()
    text = report(args, model, cmd, res)
    write(text, args.out)


if __name__ == "__main__":
    main()
