"""The cache_aware router's balance thresholds, side by side in one run, with round robin.

Two ``radixlm serve`` workers (1 thread each, SmolLM2) stay up for the whole run; for each
router setting a fresh router is started over them, the workers' caches are flushed, and the
multi-turn chat and few-shot workloads of benchmarks/compare.py run through it. This is the
measurement behind the router's default ``--balance-abs-threshold``.

    .venv/bin/python benchmarks/router_thresholds.py [--out benchmarks/results/router_thresholds.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from compare import MODEL  # noqa: E402
from peers import servers  # noqa: E402
from report import write  # noqa: E402
from scale_out import REPLICA_WORKLOADS, flush, measure, metric_cells, spawn_radixlm  # noqa: E402

SETTINGS = {
    "cache_aware, abs 32 / rel 1.5 (SGLang-sized)": ["--policy", "cache_aware", "--balance-abs-threshold", "32"],
    "cache_aware, abs 4 / rel 1.5 (default)": ["--policy", "cache_aware", "--balance-abs-threshold", "4"],
    "cache_aware, abs 2 / rel 1.2": ["--policy", "cache_aware", "--balance-abs-threshold", "2", "--balance-rel-threshold", "1.2"],
    "round_robin": ["--policy", "round_robin"],
}


def run() -> dict[str, dict[str, dict]]:
    """Every setting over the same two workers: {setting: {workload: figures}}."""
    workers = [spawn_radixlm(f"worker{i}", "serve", "--served-model-name", MODEL, threads=1) for i in range(2)]
    urls = [w.base_url for w in workers]
    results: dict[str, dict[str, dict]] = {}
    try:
        for name, args in SETTINGS.items():
            router = spawn_radixlm("router", "router", "--worker-urls", *urls, *args)
            try:
                for w, fn in REPLICA_WORKLOADS.items():
                    flush(urls)
                    results.setdefault(name, {})[w] = res = asyncio.run(measure(router.base_url, fn))
                    print(f"{name} | {w}: {res['tok_s']:.1f} tok/s, hit {res['hit_rate']:.3f}", flush=True)
            finally:
                servers.stop(router)
    finally:
        for w in workers:
            servers.stop(w)
    return results


def report(results: dict[str, dict[str, dict]]) -> str:
    """The markdown results file."""
    lines = [
        "# cache_aware balance thresholds vs round robin (2 replicas, 1 thread each)",
        "",
        f"Command: `{' '.join(sys.argv)}`  ",
        f"Date: {datetime.date.today()}; {os.cpu_count()} cores, CPU capability `{torch.backends.cpu.get_cpu_capability()}`; "
        "SmolLM2-135M-Instruct (fp32), temperature 0; the same two workers for every setting, caches flushed before each workload.",
        "",
        "| router setting | workload | cache hit rate | output tok/s | TTFT p50 (s) | TTFT p90 (s) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, per_workload in results.items():
        for w, r in per_workload.items():
            lines.append(f"| {name} | {w} | {metric_cells(r)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "router_thresholds.md"))
    args = ap.parse_args()
    write(report(run()), args.out)


if __name__ == "__main__":
    main()
