"""Pre-quantized checkpoints served as stored, against llama.cpp on the same GGUF files.

For each GGUF file (the embedded SmolLM2 Q4_1, and the same weights re-quantized by llama.cpp's
``llama-quantize`` to Q4_K_M, Q8_0 and Q4_0), in a fresh process each: load time, resident
memory added by loading, the bytes the served weights take (``weight_bytes``), batch-1 decode
tok/s (128 tokens) and batch-32 decode tok/s (32 requests of 64 tokens at once); then teacher-
forced agreement with the same file dequantized to fp32 (``--quantization none``): how often the
top next token is fp32's. llama.cpp's ``llama-server`` runs the same file with the same threads:
resident memory after load, batch-1 and batch-32 decode tok/s (``--parallel 32``).

    make bench-peers   # builds llama.cpp's llama-server and llama-quantize once
    .venv/bin/python benchmarks/checkpoints.py [--threads 2] [--out benchmarks/results/checkpoints.md]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from peers.servers import LLAMA_SERVER, PEERS_DIR, free_port  # noqa: E402
from report import machine, write  # noqa: E402

QUANTIZE = LLAMA_SERVER.parent / "llama-quantize"
TYPES = ["Q4_1", "Q4_K_M", "Q8_0", "Q4_0"]
PROMPT = [1, 504, 3458, 282, 4649, 314]  # a few tokens: decode dominates
AGREEMENT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:", "Once upon a time"]


def checkpoint(qtype: str) -> Path:
    """The SmolLM2 GGUF file of ``qtype`` (the embedded Q4_1, or made from it by llama-quantize)."""
    from radixlm.runtime.loader import default_model_path

    source = Path(default_model_path())
    if qtype == "Q4_1":
        return source
    out = PEERS_DIR / "checkpoints" / f"SmolLM2-135M-Instruct.{qtype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(QUANTIZE), "--allow-requantize", str(source), str(out), qtype], check=True, capture_output=True)
    return out


def rss() -> int:
    """This process's resident bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_one(path: str, threads: int) -> dict:
    """Load time, memory and decode speeds of radixlm on ``path`` (run in a fresh process)."""
    import radixlm
    from radixlm.kernels.cpu_ext import cpu_kernels

    cpu_kernels()  # built before the clock and the memory baseline
    before, start = rss(), time.perf_counter()
    engine = radixlm.Engine(model_path=path, num_threads=threads, max_total_tokens=8192, disable_radix_cache=True)
    loaded, load_s = rss() - before, time.perf_counter() - start
    params = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=PROMPT, sampling_params={**params, "max_new_tokens": 8})  # warm-up
    start = time.perf_counter()
    engine.generate(input_ids=PROMPT, sampling_params=params)
    batch1 = 128 / (time.perf_counter() - start)
    prompts = [PROMPT + [100 + i] for i in range(32)]
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 64})
    batch32 = 32 * 64 / (time.perf_counter() - start)
    result = {"load_s": load_s, "rss_added": loaded, "weight_bytes": engine.runner.weight_bytes, "batch1": batch1, "batch32": batch32}
    engine.shutdown()
    return result


def agreement(path: str, threads: int) -> float:
    """Teacher-forced top-1 agreement of the file as stored with the file dequantized to fp32."""
    from quant_quality import scored

    import radixlm

    seqs = []
    with radixlm.Engine(model_path=path, num_threads=threads, disable_radix_cache=True) as native:
        for text in AGREEMENT_PROMPTS:
            out = native.generate(text, {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True})
            seqs.append(native.tokenizer(text).input_ids + out["output_ids"])
        tops_native = [[top for _, top in scored(native, s)] for s in seqs]
    with radixlm.Engine(model_path=path, num_threads=threads, disable_radix_cache=True, quantization="none") as dense:
        tops_dense = [[top for _, top in scored(dense, s)] for s in seqs]
    pairs = [(a, b) for x, y in zip(tops_native, tops_dense) for a, b in zip(x, y)]
    return sum(a == b for a, b in pairs) / len(pairs)


def llama_cpp(path: Path, threads: int) -> dict:
    """llama-server on ``path``: resident memory after load, batch-1 and batch-32 decode tok/s."""
    import httpx

    port = free_port()
    cmd = [str(LLAMA_SERVER), "-m", str(path), "-t", str(threads), "-tb", str(threads), "--parallel", "32", "-c", "16384", "--port", str(port), "--host", "127.0.0.1", "--no-warmup"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=PEERS_DIR)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        resident = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines() if line.startswith("VmRSS"))
        body = {"prompt": PROMPT, "n_predict": 128, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
        with httpx.Client(timeout=600) as client:
            client.post(base + "/completion", json={**body, "n_predict": 8})
            batch1 = client.post(base + "/completion", json=body).json()["timings"]["predicted_per_second"]

            def one(i: int) -> None:
                client.post(base + "/completion", json={**body, "prompt": PROMPT + [100 + i], "n_predict": 64})

            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(32) as pool:
                list(pool.map(one, range(32)))
            batch32 = 32 * 64 / (time.perf_counter() - start)
        return {"rss": resident, "batch1": batch1, "batch32": batch32}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: measure one file, print JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one, args.threads)))
        return
    mib = 2**20
    rows = [
        "| file | size MiB | radixlm load s | radixlm weights MiB | radixlm RSS added MiB | llama.cpp RSS MiB | batch-1 tok/s radixlm / llama.cpp | batch-32 tok/s radixlm / llama.cpp | top-1 agreement with fp32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for qtype in args.types:
        path = checkpoint(qtype)
        child = subprocess.run([sys.executable, __file__, "--one", str(path), "--threads", str(args.threads)], capture_output=True, text=True, check=True)
        ours = json.loads(child.stdout.strip().splitlines()[-1])
        peer = llama_cpp(path, args.threads) if LLAMA_SERVER.is_file() else None
        agree = agreement(str(path), args.threads)
        peer_cols = [f"{peer['rss'] / mib:.0f}", f"{ours['batch1']:.1f} / {peer['batch1']:.1f}", f"{ours['batch32']:.1f} / {peer['batch32']:.1f}"] if peer else ["n/a", f"{ours['batch1']:.1f} / n/a", f"{ours['batch32']:.1f} / n/a"]
        rows.append(f"| SmolLM2-135M {qtype} | {path.stat().st_size / mib:.0f} | {ours['load_s']:.1f} | {ours['weight_bytes'] / mib:.0f} | {ours['rss_added'] / mib:.0f} | {peer_cols[0]} | {peer_cols[1]} | {peer_cols[2]} | {agree:.3f} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        "# Pre-quantized checkpoints as stored, against llama.cpp",
        "",
        f"Machine: {machine()}; {args.threads} threads for both; run side by side in one session.",
        f"Command: `{' '.join(sys.argv)}`",
        "",
        *rows,
        "",
        "RSS added: resident memory a fresh process gained while the engine loaded (weights, KV pool of 8192 tokens, allocator);",
        "llama.cpp RSS: llama-server's whole resident memory after load (its weights are mmapped from the file).",
        "Agreement: teacher-forced, over 4 prompts and their 48-token greedy continuations, the file as stored vs the file dequantized to fp32 (radixlm's `--quantization none`).",
        "",
    ])
    write(text, args.out)


if __name__ == "__main__":
    main()
