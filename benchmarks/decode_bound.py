"""Batch-1 decode speed against the memory-bandwidth bound, per weight format.

The bound: a decode step must read every weight the token passes through (all linear layers,
norms and the output head; one row of the embedding), so it cannot take less than
``bytes read per token / read bandwidth``. The read bandwidth is measured here as the throughput
of a large fp32 matrix-vector product (the access pattern of a decode matmul), best of several.
The decode speed is measured on one request (short prompt, ``--new-tokens`` greedy tokens).

    .venv/bin/python benchmarks/decode_bound.py [--formats fp32 int8 int4 int4_torch] [--threads 2]
        [--decode-stack on off] [--out FILE]

``--decode-stack on off`` runs each format with the C++ decoder stack and then through the
Python layers (``--disable-decode-stack``), side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from report import emit, machine  # noqa: E402
from weight_forms import weights_as  # noqa: E402

from radixlm.runtime.engine import build_parts
from radixlm.runtime.layers.quantized_linear import Int4Linear, Int8Linear
from radixlm.runtime.request import Req
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.server_args import ServerArgs

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def read_bandwidth(repeats: int = 10) -> float:
    """Bytes per second of a 512 MB fp32 matrix-vector product (best of ``repeats``)."""
    w = torch.randn(16384, 8192)
    x = torch.randn(1, 8192)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t)
    return w.nbytes / best


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights one token's decode step reads (what batch 1 executes, not what is stored)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Int8Linear):
            total += module.qweight.nbytes + module.scales.nbytes
        elif isinstance(module, Int4Linear):  # batch 1 takes the packed path, never the bf16 copy
            total += module.weight_bytes()
        elif isinstance(module, nn.Linear):
            total += module.weight.nbytes
        elif isinstance(module, nn.Embedding):
            total += module.weight[0].nbytes  # one row looked up
        else:
            continue
        bias = getattr(module, "bias", None)
        total += bias.nbytes if isinstance(bias, torch.Tensor) else 0
    for name, param in model.named_parameters():
        if "norm" in name:
            total += param.nbytes
    if getattr(model, "head_fp32", None) is not None:
        total += model.head_fp32.nbytes
    elif getattr(model, "lm_head", None) is None:  # tied, unquantized: the head is the embedding
        total += model.embed_tokens.weight.nbytes
    return total


def decode_ms_per_token(rt, new_tokens: int) -> float:
    """Median wall time of one decode step of a single request."""
    ids = rt.tokenizer(PROMPT).input_ids
    rt.scheduler.add(Req(rid="0", input_ids=ids, params=SamplingParams(max_new_tokens=new_tokens + 8, temperature=0, ignore_eos=True), sink=lambda out: None))
    while rt.scheduler.waiting or any(not r.generating for r in rt.scheduler.running):
        rt.scheduler.step()
    for _ in range(4):  # warm-up
        rt.scheduler.step()
    times = []
    for _ in range(new_tokens):
        t = time.perf_counter()
        rt.scheduler.step()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=["fp32", "int8", "int4"], choices=["fp32", "bf16", "int8", "int4", "int4_torch"], help="int4_torch: int4 on PyTorch's kernel instead of ours")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--decode-stack", nargs="+", default=["on"], choices=["on", "off"], help="with the C++ decoder stack, through the Python layers, or both in turn")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for fmt in args.formats:
        dtype = "bfloat16" if fmt == "bf16" else "float32"
        for stack in args.decode_stack:
            with weights_as(fmt) as quant:
                rt = build_parts(ServerArgs(num_threads=args.threads, quantization=quant, dtype=dtype, max_total_tokens=4096, disable_decode_stack=stack == "off"))
            nbytes = weight_bytes_per_token(rt.runner.model)
            ms = decode_ms_per_token(rt, args.new_tokens)
            bw = read_bandwidth()  # measured next to each run, under the same conditions
            bound = 1e3 * nbytes / bw
            label = fmt if len(args.decode_stack) == 1 else f"{fmt}, stack {stack}"
            rows.append((label, nbytes, bw, bound, ms))
            del rt
    lines = [
        f"Batch-1 decode against the memory-bandwidth bound ({torch.get_num_threads()} threads; {machine()}).",
        "",
        "| weights | MB read per token | read bandwidth (GB/s) | bound (ms/token) | measured (ms/token) | tok/s | % of bound |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for fmt, nbytes, bw, bound, ms in rows:
        lines.append(f"| {fmt} | {nbytes / 1e6:.1f} | {bw / 1e9:.1f} | {bound:.2f} | {ms:.2f} | {1e3 / ms:.1f} | {100 * bound / ms:.0f}% |")
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
