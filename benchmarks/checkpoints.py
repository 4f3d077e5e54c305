"""Pre-quantized checkpoints served as stored, against llama.cpp on the same GGUF files.

Two models:

- ``smollm2``: the embedded SmolLM2-135M-Instruct Q4_1 file, and the same weights re-quantized by
  llama.cpp's ``llama-quantize --allow-requantize`` to Q4_K_M, Q8_0 and Q4_0. No fp32 original
  ships with it, so each file's reference is the file itself dequantized to fp32 (radixlm's
  ``--quantization none``).
- ``llama``: a Llama-3.2-1B-shaped model (all 16 layers, vocab 128256, tied embeddings) with
  random weights, built by transformers' own classes (``families.py``'s ``llama`` entry) and saved
  as fp32 safetensors; llama.cpp's converter writes it as an f16 GGUF, ``llama-quantize`` makes
  Q4_K_M, Q8_0 and Q4_0 from that, and ``AWQ`` is the same weights as an AutoAWQ GEMM folder
  (round-to-nearest int4, group 128, zero points; llama.cpp does not read it). The reference is
  the fp32 folder.

For each file, in a fresh process: load time, resident memory added by loading, the bytes the
served weights take (``weight_bytes``), batch-1 decode tok/s (128 tokens, counted as llama-server's
``predicted_per_second`` counts them: the 127 decode steps after the first token, over the time
from the first token to the last) and batch-32 decode tok/s (32 requests of 64 tokens at once,
wall clock around all of them, for both). llama.cpp's ``llama-server`` runs the same file with the
same threads: resident memory after load, batch-1 and batch-32 (``--parallel 32``) decode tok/s.
Both decode speeds are timed in pairs: the same fresh process starts llama-server on the file and
alternates one decode of each (``PAIRS`` at batch 1, ``PAIRS_32`` at batch 32), so that both see
the same moments of a shared, noisy machine; the table gives each side's median and the median of
the pairs' ratios.
Then teacher-forced top-1 agreement with the reference: the reference's greedy continuations of
12 prompts (48 tokens each) are scored by every system, and each position after the first counts
when the system's top next token is the reference's (llama.cpp: one greedy 1-token request per prefix,
``return_tokens``).

    make bench-peers   # builds llama.cpp's llama-server and llama-quantize once
    cd /tmp && /work/main/.venv/bin/python /work/main/benchmarks/checkpoints.py \
        [--models smollm2,llama] [--threads 2] [--out /work/main/benchmarks/results/checkpoints.md]

Run it from outside the repository (as above) when the ``llama`` model is built: from the root,
``./kernels`` shadows the package of that name transformers probes for.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent / "tests"))  # the test-side AWQ packer
from families import child, convert  # noqa: E402
from peers.servers import LLAMA_SERVER, PEERS_DIR, llama_server_on  # noqa: E402
from report import machine, write  # noqa: E402

QUANTIZE = LLAMA_SERVER.parent / "llama-quantize"
WORK = PEERS_DIR / "checkpoints"
GGUF_TYPES = {"smollm2": ["Q4_1", "Q4_K_M", "Q8_0", "Q4_0"], "llama": ["Q4_K_M", "Q8_0", "Q4_0", "AWQ"]}
LABELS = {"smollm2": "SmolLM2-135M", "llama": "Llama-3.2-1B-shaped (random)"}
PROMPT = [1, 304, 312, 298, 301, 307]  # a few in-vocabulary tokens of both tokenizers: decode dominates
AGREEMENT_TOKENS = 48
PAIRS = 7  # alternated batch-1 decodes of radixlm and llama.cpp per file
PAIRS_32 = 3  # alternated batch-32 decodes
SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors:",
    "Once upon a time",
    "The best way to learn a new language is",
    "import numpy as np\n\ndef mean(values):",
    "Q: What is the boiling point of water?\nA:",
    "Write a haiku about the sea.",
    "SELECT name, age FROM",
    "The three laws of motion are",
    "Dear hiring manager,",
    '{"name": "Alice", "age":',
]


@dataclass
class Subject:
    """One file served: the model it is a form of, its type, where it is, and what it is scored against."""

    model: str
    qtype: str
    path: Path
    reference: Path  # fp32 reference: an HF folder, or a GGUF file run with quantization none
    gguf: bool = True


# ---------------------------------------------------------------- the files


def quantize(source: Path, out: Path, qtype: str) -> Path:
    """``source`` (GGUF) as ``qtype`` by llama-quantize, made once."""
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(QUANTIZE), "--allow-requantize", str(source), str(out), qtype], check=True, capture_output=True)
    return out


def smollm2_subjects(types: list[str]) -> list[Subject]:
    """The embedded Q4_1 file and its re-quantizations; each file is its own reference."""
    from radixlm.runtime.loader import default_model_path

    source = Path(default_model_path())
    subjects = []
    for qtype in types:
        path = source if qtype == "Q4_1" else quantize(source, WORK / f"SmolLM2-135M-Instruct.{qtype}.gguf", qtype)
        subjects.append(Subject("smollm2", qtype, path, path))
    return subjects


def write_awq(folder: Path, out: Path) -> None:
    """The fp32 folder's attention and MLP weights as AutoAWQ GEMM int4 (RTN, group 128, zero points)."""
    from quantized_checkpoints import awq_tensors, int4_groups, write_quantized

    def awq(name: str, w):
        q = int4_groups(w, 128, sym=False)
        return awq_tensors(name.removesuffix(".weight"), q), q.codes[:0]  # the dense copy is not needed

    scratch = out.parent / (out.name + ".dense-unused")
    qconfig = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    write_quantized(str(folder), out, scratch, awq, qconfig)
    shutil.rmtree(scratch, ignore_errors=True)


def llama_subjects(types: list[str], threads: int) -> list[Subject]:
    """The Llama-3.2-1B-shaped random model's files (built once under WORK); the fp32 folder is the reference."""
    folder, f16 = WORK / "llama-1b-fp32", WORK / "llama-1b.f16.gguf"
    if not (folder / "config.json").is_file():
        child("build", 3600, family="llama", quick=False, folder=str(folder), threads=threads)
    if not f16.is_file():
        convert(folder, f16, "f16")
    subjects = []
    for qtype in types:
        if qtype == "AWQ":
            awq = WORK / "llama-1b-awq"
            if not (awq / "config.json").is_file():
                write_awq(folder, awq)
            subjects.append(Subject("llama", qtype, awq, folder, gguf=False))
        else:
            subjects.append(Subject("llama", qtype, quantize(f16, WORK / f"llama-1b.{qtype}.gguf", qtype), folder))
    return subjects


def size_of(path: Path) -> int:
    """Bytes of a file, or of a folder's safetensors."""
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*.safetensors"))


# ---------------------------------------------------------------- radixlm


def rss() -> int:
    """This process's resident bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_one(path: str, threads: int, peer: bool) -> dict:
    """Load time, memory and decode speeds of radixlm on ``path`` (run in a fresh process); with
    ``peer``, each decode speed alternated with llama-server's on the same file."""
    import radixlm
    from radixlm.kernels.cpu_ext import cpu_kernels

    cpu_kernels()  # built before the clock and the memory baseline
    before, start = rss(), time.perf_counter()
    engine = radixlm.Engine(model_path=path, num_threads=threads, max_total_tokens=8192, disable_radix_cache=True)
    loaded, load_s = rss() - before, time.perf_counter() - start
    params = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=PROMPT, sampling_params={**params, "max_new_tokens": 8})  # warm-up

    def ours() -> float:
        # As llama-server's predicted_per_second: the decode steps after the first token (which
        # the prompt's pass gives), over the time from the first token to the last.
        meta = engine.generate(input_ids=PROMPT, sampling_params=params)["meta_info"]
        return 127 / (meta["e2e_latency"] - meta["ttft"])

    prompts = [PROMPT + [300 + i] for i in range(32)]

    def ours32() -> float:
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 64})
        return 32 * 64 / (time.perf_counter() - start)

    result = {"load_s": load_s, "rss_added": loaded, "weight_bytes": engine.runner.weight_bytes, "pool_bytes": engine.runner.kv_pool.nbytes()}
    engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 4})  # warm-up
    if peer:
        import httpx

        with llama_server_on(Path(path), threads, warmup=False) as server, httpx.Client(timeout=600) as client, concurrent.futures.ThreadPoolExecutor(32) as pool:
            body = {"prompt": PROMPT, "n_predict": 128, "temperature": 0, "ignore_eos": True, "cache_prompt": False}

            def one(i: int, n: int) -> None:
                client.post(server.base_url + "/completion", json={**body, "prompt": PROMPT + [300 + i], "n_predict": n})

            def theirs32() -> float:
                start = time.perf_counter()
                list(pool.map(one, range(32), [64] * 32))
                return 32 * 64 / (time.perf_counter() - start)

            client.post(server.base_url + "/completion", json={**body, "n_predict": 8})  # warm-ups
            list(pool.map(one, range(32), [4] * 32))
            pairs = [(ours(), client.post(server.base_url + "/completion", json=body).json()["timings"]["predicted_per_second"]) for _ in range(PAIRS)]
            pairs32 = [(ours32(), theirs32()) for _ in range(PAIRS_32)]
        for name, runs in (("batch1", pairs), ("batch32", pairs32)):
            result[name] = statistics.median(a for a, _ in runs)
            result[f"peer_{name}"] = statistics.median(b for _, b in runs)
            result[f"{name}_ratio"] = statistics.median(a / b for a, b in runs)
    else:
        result["batch1"] = statistics.median(ours() for _ in range(3))
        result["batch32"] = ours32()
    engine.shutdown()
    return result


def agreement_prompts(model: str, tokenizer) -> list[list[int]]:
    """The prompts scored: SmolLM2's texts, or as many 8-token prompts inside the random model's tokenizer."""
    if model == "smollm2":
        return [tokenizer(text).input_ids for text in SMOLLM2_PROMPTS]
    rng = random.Random(0)
    return [[1] + [rng.randrange(3, 400) for _ in range(7)] for _ in SMOLLM2_PROMPTS]


def tops(engine, seq: list[int]) -> list[int]:
    """The engine's top next token after every prefix ``seq[:j]``, j >= 1 (one teacher-forced pass)."""
    from quant_quality import scored

    return [top for _, top in scored(engine, seq)]


def reference(subject: Subject, threads: int) -> tuple[list[list[int]], list[list[int]]]:
    """The reference's greedy continuations of the prompts, and its top tokens along them."""
    import radixlm

    with radixlm.Engine(model_path=str(subject.reference), num_threads=threads, disable_radix_cache=True, quantization="none" if subject.reference.is_file() else None) as ref:
        seqs = []
        for prompt in agreement_prompts(subject.model, ref.tokenizer):
            out = ref.generate(input_ids=prompt, sampling_params={"max_new_tokens": AGREEMENT_TOKENS, "temperature": 0, "ignore_eos": True})
            seqs.append(prompt + out["output_ids"])
        return seqs, [tops(ref, s) for s in seqs]


def radixlm_tops(subject: Subject, seqs: list[list[int]], threads: int) -> list[list[int]]:
    """radixlm's top tokens along ``seqs`` with the file as stored."""
    import radixlm

    with radixlm.Engine(model_path=str(subject.path), num_threads=threads, disable_radix_cache=True) as eng:
        return [tops(eng, s) for s in seqs]


def agreement(ours: list[list[int]], ref: list[list[int]]) -> float:
    """The share of positions where the two top tokens are the same."""
    pairs = [(a, b) for x, y in zip(ours, ref) for a, b in zip(x, y)]
    return sum(a == b for a, b in pairs) / len(pairs)


def discordant(ours: list[list[int]], theirs: list[list[int]], ref: list[list[int]]) -> tuple[int, int]:
    """Positions only ``ours`` misses the reference's top token at, and positions only ``theirs`` does
    (McNemar's counts: the two agreements differ beyond chance only when these differ a lot)."""
    triples = [(a, b, r) for x, y, z in zip(ours, theirs, ref) for a, b, r in zip(x, y, z)]
    return sum(a != r and b == r for a, b, r in triples), sum(a == r and b != r for a, b, r in triples)


# ---------------------------------------------------------------- llama.cpp


def llama_cpp(path: Path, threads: int, seqs: list[list[int]]) -> dict:
    """llama-server on ``path``: resident memory after load and its top tokens along ``seqs``."""
    import httpx

    with llama_server_on(path, threads, warmup=False) as server, httpx.Client(timeout=600) as client:
        resident = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines() if line.startswith("VmRSS"))
        greedy = {"n_predict": 1, "temperature": 0, "cache_prompt": True, "return_tokens": True}
        top = [[client.post(server.base_url + "/completion", json={**greedy, "prompt": s[:j]}).json()["tokens"][0] for j in range(1, len(s))] for s in seqs]
    return {"rss": resident, "tops": top}


# ---------------------------------------------------------------- the run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="smollm2,llama")
    ap.add_argument("--types", default=None, help="comma-separated: only these types of each model")
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: measure one file, print JSON
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)  # the child: batch-1 paired with llama-server
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one, args.threads, args.peer)))
        return
    mib, start = 2**20, time.perf_counter()
    rows = [
        "| model | file | size MiB | radixlm load s | radixlm weights MiB | radixlm KV pool MiB | radixlm RSS added MiB (/ size + pool) | llama.cpp RSS MiB | batch-1 tok/s radixlm / llama.cpp (paired ratio) | batch-32 tok/s radixlm / llama.cpp (paired ratio) | top-1 agreement with fp32 radixlm / llama.cpp (positions only one misses) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model in args.models.split(","):
        types = [t for t in GGUF_TYPES[model] if not args.types or t in args.types.split(",")]
        subjects = smollm2_subjects(types) if model == "smollm2" else llama_subjects(types, args.threads)
        refs: dict[Path, tuple] = {}
        for s in subjects:
            if s.reference not in refs:
                refs[s.reference] = reference(s, args.threads)
            seqs, ref_tops = refs[s.reference]
            with_peer = s.gguf and LLAMA_SERVER.is_file()
            cmd = [sys.executable, __file__, "--one", str(s.path), "--threads", str(args.threads)] + (["--peer"] if with_peer else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=PEERS_DIR)
            if proc.returncode != 0:
                raise RuntimeError(f"radixlm on {s.path.name}: {proc.stderr[-2000:]}")
            ours = json.loads(proc.stdout.strip().splitlines()[-1])
            peer = llama_cpp(s.path, args.threads, seqs) if with_peer else None
            our_tops = radixlm_tops(s, seqs, args.threads)
            agree = agreement(our_tops, ref_tops)
            if peer:
                speeds = [f"{ours[n]:.1f} / {ours['peer_' + n]:.1f} ({ours[n + '_ratio']:.2f})" for n in ("batch1", "batch32")]
                only = discordant(our_tops, peer["tops"], ref_tops)
                cols = [f"{peer['rss'] / mib:.0f}", *speeds, f"{agree:.3f} / {agreement(peer['tops'], ref_tops):.3f} ({only[0]} / {only[1]})"]
            else:
                cols = ["n/a", f"{ours['batch1']:.1f} / n/a", f"{ours['batch32']:.1f} / n/a", f"{agree:.3f} / n/a"]
            rows.append(f"| {LABELS[model]} | {s.qtype} | {size_of(s.path) / mib:.0f} | {ours['load_s']:.1f} | {ours['weight_bytes'] / mib:.0f} | {ours['pool_bytes'] / mib:.0f} | {ours['rss_added'] / mib:.0f} ({ours['rss_added'] / (size_of(s.path) + ours['pool_bytes']):.2f}) | " + " | ".join(cols) + " |")
            print(rows[-1], flush=True)
    text = "\n".join([
        "# Pre-quantized checkpoints as stored, against llama.cpp",
        "",
        f"Machine: {machine()}; {args.threads} threads for both; run side by side in one session ({(time.perf_counter() - start) / 60:.0f} min).",
        f"Command: `{' '.join(sys.argv)}`",
        "",
        *rows,
        "",
        "RSS added: resident memory a fresh process gained while the engine loaded (weights, KV pool of 8192 tokens, allocator),",
        "and in brackets its ratio to the file's size plus the pool (the aim: at most 1.10);",
        "llama.cpp RSS: llama-server's whole resident memory after load (its weights are mmapped from the file).",
        f"Batch-1 and batch-32: medians of {PAIRS} and {PAIRS_32} decodes (128 tokens; 32 requests of 64), radixlm's and llama.cpp's alternated in one process;",
        "in brackets the median of the pairs' ratios (radixlm / llama.cpp).",
        "Agreement: teacher-forced top-1, over 12 prompts and the reference's 48-token greedy continuations (all positions after the first);",
        "in brackets the positions where only radixlm misses the reference's top token / where only llama.cpp does (McNemar's discordant",
        "pairs: with n of them in all, a split further from n/2 than about sqrt(n) is unlikely to be chance).",
        "SmolLM2's reference is each file dequantized to fp32 (radixlm's `--quantization none`: no fp32 original ships with it);",
        "the Llama-shaped model's is its fp32 folder, and its files are llama-quantize's from the f16 conversion of that folder.",
        "AWQ: the same fp32 weights as AutoAWQ GEMM int4 (round to nearest, group 128, zero points); llama.cpp does not read AWQ.",
        "",
    ])
    write(text, args.out)


if __name__ == "__main__":
    main()
