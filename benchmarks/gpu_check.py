"""One script for a CUDA machine (under 10 minutes): checks and times the GPU path, writes one report.

1. The device: name, capability, memory, torch / CUDA / Triton versions, copy bandwidth.
2. The suite's GPU-relevant tests on that device (parity with transformers, constrained decoding,
   sampling, speculative decoding; the engine picks CUDA by itself when one is present).
3. The Triton kernels at real sizes against the PyTorch reference (max error), and their time
   against the device's copy bandwidth: decode attention reads each row's KV once, so bytes read
   over time says how close it runs to the memory bound.
4. The few-shot workload end to end (SmolLM2, 64 prompts sharing a prefix, greedy), in tok/s.

    python benchmarks/gpu_check.py [--out benchmarks/results/gpu_check.md]

``--device cpu`` runs the same steps at tiny sizes on the CPU (PyTorch attention only), to check
the script itself where no GPU is lent.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from workloads import few_shot_prompts  # noqa: E402

TESTS = ["tests/test_parity.py", "tests/test_constrained_engine.py", "tests/test_lazy_mask.py", "tests/test_sampler.py", "tests/test_speculative_engine.py"]


def timed(fn, device: torch.device, repeats: int = 20) -> float:
    """Median seconds of ``fn()`` (synchronized on CUDA)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t)
    samples.sort()
    return samples[len(samples) // 2]


def device_section(device: torch.device, quick: bool) -> tuple[list[str], float]:
    """The device's description and its copy bandwidth (bytes/s, read + write)."""
    lines = [f"- torch {torch.__version__}, device {device}"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        import triton

        lines += [f"- {props.name}, compute capability {props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs", f"- CUDA {torch.version.cuda}, Triton {triton.__version__}"]
    else:
        lines.append(f"- CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    n = (1 << 22) if quick else (1 << 28)  # 16 MiB or 1 GiB of fp32
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, 5 if quick else 20)
    bandwidth = 2 * src.numel() * 4 / seconds
    lines.append(f"- copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s")
    return lines, bandwidth


def tests_section(device: torch.device, quick: bool) -> list[str]:
    """Run the suite's GPU-relevant tests; one line per file with its summary."""
    if quick:
        return ["(skipped with --device cpu: the CPU suite runs them)"]
    out = []
    for path in TESTS:
        proc = subprocess.run([str(Path(sys.executable).parent / "pytest"), "-q", "-x", "-p", "no:cacheprovider", path], cwd=ROOT, capture_output=True, text=True, timeout=900)
        tail = [line for line in proc.stdout.splitlines() if " passed" in line or " failed" in line or " error" in line]
        out.append(f"- `{path}`: {tail[-1] if tail else 'no summary (exit ' + str(proc.returncode) + ')'}")
    return out


def kernel_section(device: torch.device, bandwidth: float, quick: bool) -> list[str]:
    """Triton decode attention vs the PyTorch reference at real sizes: error and bandwidth used."""
    from radixlm.kernels.attention import reference_attention

    rows = ["| heads (q/kv) x dim | batch | context | splits | max abs error | µs | KV GB/s | of copy bandwidth |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    if device.type != "cuda":
        return ["(Triton kernels run on CUDA only; `tests/test_triton_attention.py` checks them in the interpreter)"]
    from radixlm.kernels.triton_decode import decode_attention, num_kv_splits

    gen = torch.Generator(device=device).manual_seed(0)
    shapes = [(9, 3, 64), (32, 8, 128)]
    for heads, kv, dim in shapes:
        for batch, context in ((1, 4096), (8, 4096), (32, 2048), (64, 1024)):
            slots = batch * context
            k = torch.randn(slots, kv, dim, device=device, dtype=torch.bfloat16, generator=gen)
            v = torch.randn(slots, kv, dim, device=device, dtype=torch.bfloat16, generator=gen)
            table = torch.randperm(slots, device=device, generator=gen).view(batch, context).to(torch.int32)
            rows_idx = torch.arange(batch, device=device, dtype=torch.int32)
            lens = torch.full((batch,), context, device=device, dtype=torch.int32)
            q = torch.randn(batch, heads, dim, device=device, dtype=torch.bfloat16, generator=gen)
            out = torch.empty_like(q)
            splits = num_kv_splits(batch, kv, context)
            seconds = timed(functools.partial(decode_attention, q, k, v, table, rows_idx, lens, out, splits), device)
            kf, vf = k.float(), v.float()
            want = torch.cat([reference_attention(q[b : b + 1].float(), kf, vf, table[b].long(), context - 1) for b in range(min(batch, 4))])
            error = (out[: want.shape[0]].float().cpu() - want).abs().max().item()
            del kf, vf
            kv_bytes = 2 * slots * kv * dim * 2
            rows.append(f"| {heads}/{kv} x {dim} | {batch} | {context} | {splits} | {error:.2e} | {seconds * 1e6:.0f} | {kv_bytes / seconds / 1e9:.0f} | {kv_bytes / seconds / (bandwidth / 2):.0%} |")
    return rows


def end_to_end_section(device: torch.device, quick: bool) -> list[str]:
    """The few-shot workload through an engine on ``device``: output tok/s, cache hit rate."""
    import radixlm

    prompts = few_shot_prompts(8 if quick else 64)
    params = {"max_new_tokens": 8 if quick else 32, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(device=str(device)) as engine:
        engine.generate(prompts[:1], {**params, "max_new_tokens": 2})
        t = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds = time.perf_counter() - t
        stats = engine.get_stats()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return [f"- {len(prompts)} few-shot prompts, {params['max_new_tokens']} tokens each, greedy: {tokens / seconds:.1f} output tok/s ({seconds:.2f} s), cache hit rate {stats['cache_hit_rate']:.3f}, attention backend {engine.runner.attn_backend.__class__.__name__}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "gpu_check.md"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here; use --device cpu to check the script", file=sys.stderr)
        return 2
    quick = device.type != "cuda"
    started = time.perf_counter()
    lines = [f"# GPU check ({datetime.date.today()})", "", f"Command: `benchmarks/gpu_check.py --device {args.device}`", "", "## Device", ""]
    described, bandwidth = device_section(device, quick)
    lines += described
    for title, section in (("Tests on the device", lambda: tests_section(device, quick)), ("Triton decode attention", lambda: kernel_section(device, bandwidth, quick)), ("Few-shot workload", lambda: end_to_end_section(device, quick))):
        lines += ["", f"## {title}", ""]
        try:
            lines += section()
        except Exception as exc:  # one failing section still leaves the others' figures
            lines.append(f"FAILED: {type(exc).__name__}: {exc}")
        print("\n".join(lines), file=sys.stderr)
    lines += ["", f"Took {time.perf_counter() - started:.0f} s."]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if not any(line.startswith("FAILED") for line in lines) else 1


if __name__ == "__main__":
    raise SystemExit(main())
