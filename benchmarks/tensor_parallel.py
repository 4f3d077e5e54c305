"""Tensor parallelism on this CPU: decode speed of tp=1 and tp=2, and the time spent in all-reduce.

Configurations, side by side in one run on the embedded SmolLM2 (fp32):

- tp=1, 1 thread; tp=1, 2 threads; tp=2, 1 thread per rank (gloo over loopback).

Each decodes ``--new-tokens`` tokens for batch 1 and batch 32 (every request its own short
prompt, EOS ignored). Decode tokens/s counts output tokens over the wall time of the batch after
its first token; the all-reduce figure is rank 0's time inside gloo (the two all-reduces per layer
plus the embedding's, and the logits gather) per decode step. Rounds alternate the configurations
(``--rounds``) and the best round is kept.

    .venv/bin/python benchmarks/tensor_parallel.py [--new-tokens 64] [--rounds 2]
        [--out benchmarks/results/tensor_parallel.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from report import write  # noqa: E402

import radixlm  # noqa: E402
from radixlm.runtime.distributed.group import TPGroup, join_store, open_store  # noqa: E402

LATENCY_CALLS = 1000

GPU_PLAN = """
## What the all-reduce figure means

It is rank 0's wall time inside gloo calls (the all-reduces and the logits gather): the
transfer plus any wait for the other rank to reach the same collective (skew between two
processes on two shared cores shows up here). The per-call figure divides it by the
all-reduces only. The plan broadcast (header and payload) is timed apart.

## The GPU plan (not yet run on a GPU)

- **NCCL.** `TPGroup` builds a `ProcessGroupNCCL` instead of gloo when the device is CUDA; rank
  `r` runs on `cuda:r`. What changes: the batch plan should travel over a second, gloo (CPU)
  group, as the header's `.tolist()` on a CUDA tensor would sync the worker's stream every step;
  the logits gather stays on device. Small-batch decode all-reduces (`[batch, hidden]` bf16, two
  per layer) are latency-bound: a one-shot all-reduce over NVLink/P2P (torch symmetric memory)
  is the step after plain NCCL.
- **CUDA-graph capture of the decode step** needs from the TP path: fixed batch buckets with
  the plan's tensors (ids, positions, slots, slot-table rows) copied into static buffers before
  replay; no host sync inside the step (the plan's sizes are read before replay, not in it); the
  NCCL group created and warmed up before capture, with the collectives on the capture stream;
  the attention kernels' launch parameters (the Triton decode split count) fixed per bucket; and
  every rank capturing the same buckets, so that replaying one graph per rank in lockstep is a
  step. The plan then only names the bucket and fills the buffers.
- **Failures.** A dead peer closes gloo's sockets at once; NCCL notices later: keep
  `TORCH_NCCL_ASYNC_ERROR_HANDLING` on and `--tp-timeout` short, and the driver's watcher (which
  fails the engine when a worker process exits) covers the rest.
"""

CONFIGS = [("tp=1, 1 thread", 1, 1), ("tp=1, 2 threads", 1, 2), ("tp=2, 1 thread per rank", 2, 1)]
BATCHES = (1, 32)


def _group_counters(engine: radixlm.Engine) -> tuple[float, int, float]:
    """Rank 0's seconds in all-reduce and gather, all-reduce calls, seconds broadcasting plans."""
    group = engine.runner.group
    return (0.0, 0, 0.0) if group is None else (group.reduce_seconds, group.reduce_calls, group.broadcast_seconds)


def measure(engine: radixlm.Engine, batch: int, new_tokens: int) -> tuple[float, float, float, float]:
    """Decode tokens/s after the first token, rank 0's all-reduce ms per decode step,
    all-reduces per step, and the plan broadcast's µs per step."""
    prompts = [f"Request {i}: write a short story about the number {i}." for i in range(batch)]
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    if batch == 1:
        first = None
        before = _group_counters(engine)
        for _ in engine.generate(prompts[0], params, stream=True):
            first = first or time.perf_counter()
        steps = new_tokens - 1
    else:
        engine.generate(prompts, {**params, "max_new_tokens": 1})  # prefill now: the prompts are cached below
        before = _group_counters(engine)
        first = time.perf_counter()
        engine.generate(prompts, params)  # one uncached token per row, then decode steps
        steps = new_tokens
    window = time.perf_counter() - first
    reduce_s, calls, broadcast_s = (b - a for a, b in zip(before, _group_counters(engine)))
    return steps * batch / window, reduce_s * 1000 / steps, calls / steps, broadcast_s * 1e6 / steps


def _latency_peer(port: int, secret: bytes, numel: int) -> None:
    torch.set_num_threads(1)
    group = TPGroup(join_store(port, 2, 60, secret), 1, 2, torch.device("cpu"), 60)
    x = torch.ones(numel)
    for _ in range(LATENCY_CALLS + 100):
        group.all_reduce(x)


def gloo_latency(numel: int) -> float:
    """µs per gloo all-reduce of ``numel`` fp32 values between two processes, outside the model."""
    import torch.multiprocessing as mp

    store = open_store(2, 60)
    peer = mp.get_context("spawn").Process(target=_latency_peer, args=(store.port, store.secret, numel))
    peer.start()
    group = TPGroup(store, 0, 2, torch.device("cpu"), 60)
    x = torch.ones(numel)
    for _ in range(100):
        group.all_reduce(x)
    t0 = time.perf_counter()
    for _ in range(LATENCY_CALLS):
        group.all_reduce(x)
    elapsed = time.perf_counter() - t0
    peer.join()
    group.close()
    return elapsed / LATENCY_CALLS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    ns = parser.parse_args()
    best: dict[tuple[str, int], tuple[float, float, float]] = {}
    for _ in range(ns.rounds):
        for name, tp, threads in CONFIGS:
            with radixlm.Engine(tp_size=tp, num_threads=threads, max_total_tokens=8192) as engine:
                engine.generate("warm up", {"max_new_tokens": 4})
                for batch in BATCHES:
                    result = measure(engine, batch, ns.new_tokens)
                    if result[0] > best.get((name, batch), (0.0,))[0]:
                        best[(name, batch)] = result
    hidden = 576  # SmolLM2's hidden size: one decode row's all-reduce
    latency = {rows: gloo_latency(rows * hidden) for rows in BATCHES}
    cpu = torch.backends.cpu.get_cpu_capability()
    lines = [
        "# Tensor parallelism on CPU (gloo)",
        "",
        f"{datetime.date.today()}, `python benchmarks/tensor_parallel.py --new-tokens {ns.new_tokens} --rounds {ns.rounds}`; "
        f"SmolLM2-135M-Instruct fp32, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}, torch CPU capability "
        f"`{cpu}`), torch {torch.__version__}. Best of {ns.rounds} alternating rounds.",
        "",
        "| configuration | batch | decode tokens/s | all-reduce + gather ms / step | all-reduces / step | µs / all-reduce | plan broadcast µs / step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, _, _ in CONFIGS:
        for batch in BATCHES:
            tps, reduce_ms, calls, plan_us = best[(name, batch)]
            per_call = f"{reduce_ms * 1000 / calls:.0f}" if calls else "-"
            lines.append(f"| {name} | {batch} | {tps:.1f} | {reduce_ms:.2f} | {calls:.0f} | {per_call} | {plan_us:.0f} |")
    lines += ["", "gloo all-reduce alone (two processes, 1 thread each, no model running), µs per call:", ""]
    lines += [f"- `[{rows}, {hidden}]` fp32: {latency[rows]:.0f} µs" for rows in BATCHES]
    write("\n".join(lines) + "\n" + GPU_PLAN, ns.out)


if __name__ == "__main__":
    main()
