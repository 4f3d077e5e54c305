"""One script for a CUDA machine (under 10 minutes): checks and times the GPU path, writes one report.

1. The device: name, capability, memory, torch / CUDA / Triton versions, copy bandwidth.
2. The suite's GPU-relevant tests on that device (parity with transformers, constrained decoding,
   sampling, speculative decoding; the engine picks CUDA by itself when one is present).
3. The Triton kernels at real sizes against the PyTorch reference (max error), and their time
   against the device's copy bandwidth: decode attention reads each row's KV once, so bytes read
   over time says how close it runs to the memory bound.
4. The Triton weight-only matmuls (int8, int4) at model sizes against bf16: error, and weight
   bytes read per second against the copy bandwidth; then those of pre-quantized checkpoints
   (FP8 per-channel and 128x128 blocks, int4 with zero points) at [4096, 4096].
5. The fused-MoE Triton kernels (``fused_experts``) against the grouped PyTorch experts
   (``run_experts``) on the same weights at Qwen3-30B-A3B's expert shape (128 experts, top 8,
   hidden 2048, intermediate 768, bf16), 1 and 32 tokens: error, µs per call, weight bytes read
   per token and per second against the copy bandwidth.
6. Decode steps replayed from CUDA graphs against eager ones: the same greedy text, and tok/s at
   batch 1, 8 and 32.
7. The few-shot workload end to end (SmolLM2, 64 prompts sharing a prefix, greedy), in tok/s.

    python benchmarks/gpu_check.py [--out benchmarks/results/gpu_check.md] [--only pre-quantized]

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

TESTS = ["tests/test_parity.py", "tests/test_constrained_engine.py", "tests/test_lazy_mask.py", "tests/test_sampler.py", "tests/test_speculative_engine.py", "tests/test_decode_graphs.py"]


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


def linear_section(device: torch.device, bandwidth: float, quick: bool) -> list[str]:
    """The Triton weight-only matmuls (int8, int4) against bf16 F.linear: error and weight bytes read per second."""
    if device.type != "cuda":
        return ["(Triton matmuls run on CUDA only; `tests/test_triton_int8_linear.py` and `tests/test_triton_int4_linear.py` check them in the interpreter)"]
    from radixlm.kernels.triton_int4_linear import int4_linear, pack_halves
    from radixlm.kernels.triton_int8_linear import int8_linear
    from radixlm.runtime.layers.quantized_linear import q4_1_quantize

    rows = ["| weight [N, K] | rows | form | max abs error vs its dequantized weight | µs | weight GB/s | of copy bandwidth |", "|---|---:|---|---:|---:|---:|---:|"]
    gen = torch.Generator(device=device).manual_seed(0)
    for n, k in ((3072, 576), (576, 1536), (14336, 4096)):
        w = torch.randn(n, k, device=device, generator=gen) * 0.05
        wb = w.to(torch.bfloat16)
        w8_scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8).to(torch.bfloat16)
        w8 = torch.round(w / w8_scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        codes, scale, minimum = q4_1_quantize(w)
        halves = pack_halves(codes)
        deq4 = (codes.float() * scale.float()[..., None] + minimum.float()[..., None]).reshape(n, k)
        forms = {  # form: (call on x, the weight it multiplies, bytes of weight it reads)
            "bf16": (functools.partial(torch.nn.functional.linear, weight=wb), wb.float(), wb.nbytes),
            "int8": (functools.partial(int8_linear, qweight=w8, scales=w8_scale), w8.float() * w8_scale.float()[:, None], w8.nbytes + w8_scale.nbytes),
            "int4": (functools.partial(int4_linear, halves=halves, scale=scale, minimum=minimum), deq4, halves.nbytes + scale.nbytes + minimum.nbytes),
        }
        for m in (1, 32):
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            for name, (fn, dense, nbytes) in forms.items():
                error = (fn(x).float() - x.float() @ dense.T).abs().max().item()
                seconds = timed(functools.partial(fn, x), device)
                rows.append(f"| [{n}, {k}] | {m} | {name} | {error:.2e} | {seconds * 1e6:.1f} | {nbytes / seconds / 1e9:.0f} | {nbytes / seconds / (bandwidth / 2):.0%} |")
    return rows


def checkpoint_linear_section(device: torch.device, bandwidth: float, quick: bool) -> list[str]:
    """The Triton matmuls of pre-quantized checkpoints (FP8 per-channel and 128x128 blocks, AWQ/GPTQ
    int4 with zero points) against bf16 F.linear at [4096, 4096]: error, time, rows per second."""
    if device.type != "cuda":
        return ["(Triton matmuls run on CUDA only; `tests/test_triton_fp8_linear.py` and `tests/test_triton_int4_linear.py` check them in the interpreter)"]
    from triton.testing import do_bench

    from radixlm.kernels.triton_fp8_linear import fp8_linear
    from radixlm.kernels.triton_int4_linear import int4_zp_linear, pack_halves

    rows = [
        "Two times: µs per call as the host sees it (`timed`, launch included, as above), and µs on the GPU (`triton.testing.do_bench`: CUDA events, L2 flushed), from which rows/s, the speed against bf16 and the bandwidth are computed.",
        "",
        "| weight [N, K] | rows | form | max abs error vs its dequantized weight | µs per call | µs on the GPU | rows/s | vs bf16 | weight GB/s | of copy bandwidth |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    gen = torch.Generator(device=device).manual_seed(0)
    n = k = 4096
    w = torch.randn(n, k, device=device, generator=gen) * 0.05
    wb = w.to(torch.bfloat16)
    channel = (w.abs().amax(dim=1) / 448).clamp(min=1e-12)  # per output row, e4m3's largest value at the row's max
    fp8_channel = (w / channel[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    blocks = (w.reshape(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
    full = blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)
    fp8_block = (w / full).to(torch.float8_e4m3fn).view(torch.uint8)
    group = 128
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    zscale = ((hi - lo) / 15).clamp(min=1e-6).half()
    zero = torch.round(-lo / zscale.float()).clamp(0, 15).to(torch.uint8)
    codes = torch.round(g / zscale.float()[..., None] + zero.float()[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
    halves = pack_halves(codes)
    deq_zp = ((codes.float().reshape(n, -1, group) - zero.float()[..., None]) * zscale.float()[..., None]).reshape(n, k)
    forms = {  # form: (call on x, the weight it multiplies, bytes of weight it reads)
        "bf16": (functools.partial(torch.nn.functional.linear, weight=wb), wb.float(), wb.nbytes),
        "fp8 per-channel": (functools.partial(fp8_linear, weight=fp8_channel, scale=channel), fp8_channel.view(torch.float8_e4m3fn).float() * channel[:, None], fp8_channel.nbytes + channel.nbytes),
        "fp8 128x128 blocks": (functools.partial(fp8_linear, weight=fp8_block, scale=blocks, block=(128, 128)), fp8_block.view(torch.float8_e4m3fn).float() * full, fp8_block.nbytes + blocks.nbytes),
        "int4 zero points, group 128": (functools.partial(int4_zp_linear, halves=halves, scale=zscale, zero=zero, group=group), deq_zp, halves.nbytes + zscale.nbytes + zero.nbytes),
    }
    for m in (1, 32):
        x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
        base = None
        for name, (fn, dense, nbytes) in forms.items():
            error = (fn(x).float() - x.float() @ dense.T).abs().max().item()
            host = timed(functools.partial(fn, x), device)
            seconds = do_bench(functools.partial(fn, x)) / 1e3
            base = base or seconds
            rows.append(f"| [{n}, {k}] | {m} | {name} | {error:.2e} | {host * 1e6:.1f} | {seconds * 1e6:.1f} | {m / seconds:,.0f} | {base / seconds:.2f}x | {nbytes / seconds / 1e9:.0f} | {nbytes / seconds / (bandwidth / 2):.0%} |")
    return rows


def moe_section(device: torch.device, bandwidth: float, quick: bool) -> list[str]:
    """The fused-MoE Triton kernels against the grouped PyTorch experts on the same stacked bf16
    weights: error, time, and the bytes of the chosen experts' weights read per call."""
    if device.type != "cuda":
        return ["(Triton kernels run on CUDA only; `tests/test_triton_moe.py` checks the fused MoE in the interpreter)"]
    from triton.testing import do_bench

    from radixlm.kernels.triton_moe import fused_experts
    from radixlm.runtime.layers.activation import silu_and_mul
    from radixlm.runtime.layers.moe import ExpertMLP, run_experts

    experts, k, hidden, inter = (16, 2, 256, 128) if quick else (128, 8, 2048, 768)  # Qwen3-30B-A3B's experts
    gen = torch.Generator(device=device).manual_seed(0)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    w_down = (torch.randn(experts, hidden, inter, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    with torch.device("meta"):  # run_experts' modules, their weights views of the same stacks
        modules = torch.nn.ModuleList(ExpertMLP(hidden, inter, silu_and_mul) for _ in range(experts))
    for e, expert in enumerate(modules):
        expert.gate_up_proj.weight = torch.nn.Parameter(w_gate_up[e], requires_grad=False)
        expert.down_proj.weight = torch.nn.Parameter(w_down[e], requires_grad=False)
    per_expert = (w_gate_up[0].nbytes + w_down[0].nbytes)
    rows = [
        f"{experts} experts, top {k}, hidden {hidden}, intermediate {inter}, bf16: {per_expert / 1e6:.1f} MB of weights per expert. "
        "µs per call as the host sees it (`timed`) and on the GPU (`do_bench`); weight bytes are those of the distinct experts the tokens chose, read once per call.",
        "",
        "| tokens | experts chosen | path | max abs error vs grouped | µs per call | µs on the GPU | weight MB per token | weight GB/s | of copy bandwidth |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for tokens in (1, 4) if quick else (1, 32):
        x = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
        logits = torch.randn(tokens, experts, device=device, generator=gen)
        weights, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
        nbytes = ids.unique().numel() * per_expert
        paths = {
            "grouped PyTorch": functools.partial(run_experts, x, weights, ids, modules),
            "fused Triton": functools.partial(fused_experts, x, w_gate_up, w_down, weights, ids, silu_and_mul),
        }
        with torch.inference_mode():
            want = paths["grouped PyTorch"]().float()
            for name, fn in paths.items():
                error = (fn().float() - want).abs().max().item()
                host = timed(fn, device)
                seconds = do_bench(fn) / 1e3
                rows.append(f"| {tokens} | {ids.unique().numel()} | {name} | {error:.2e} | {host * 1e6:.1f} | {seconds * 1e6:.1f} | {nbytes / tokens / 1e6:.1f} | {nbytes / seconds / 1e9:.0f} | {nbytes / seconds / (bandwidth / 2):.0%} |")
    return rows


def graph_section(device: torch.device, quick: bool) -> list[str]:
    """Decode speed and greedy text with and without CUDA graphs of the decode step (SmolLM2, side by side)."""
    if device.type != "cuda":
        return ["(CUDA graphs are captured on CUDA only; `tests/test_decode_graphs.py` checks the runner with a recorded stand-in)"]
    import radixlm

    prompts = few_shot_prompts(32)
    params = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    rows = ["| decode step | batch | output tok/s | ms per step | same text as eager |", "|---|---:|---:|---:|---|"]
    texts: dict[int, list[str]] = {}
    for graphs in (False, True):
        with radixlm.Engine(device=str(device), disable_cuda_graph=not graphs) as engine:
            for batch in (1, 8, 32):
                engine.generate(prompts[:batch], {**params, "max_new_tokens": 4})  # warm: compiles, captures, caches the prompts
                t = time.perf_counter()
                outs = engine.generate(prompts[:batch], params)
                seconds = time.perf_counter() - t
                text = [o["text"] for o in outs]
                same = "-" if not graphs else ("yes" if text == texts[batch] else "NO")
                texts.setdefault(batch, text)
                tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
                rows.append(f"| {'CUDA graph' if graphs else 'eager'} | {batch} | {tokens / seconds:.1f} | {seconds / params['max_new_tokens'] * 1e3:.2f} | {same} |")
            if graphs:
                stats = engine.runner.decode_graphs
                rows.append(f"\nReplays {stats.replays}, buckets captured {stats.captured}, graphs {'on' if stats.enabled else 'OFF (a capture failed)'}.")
    if any("| NO |" in row for row in rows):
        rows.append("FAILED: the graphed decode steps gave other text than the eager ones")
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
    ap.add_argument("--only", default="", help="run only the sections whose title contains this text (case-insensitive; the device is always described), e.g. 'pre-quantized'")
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
    for title, section in (("Tests on the device", lambda: tests_section(device, quick)), ("Triton decode attention", lambda: kernel_section(device, bandwidth, quick)), ("Triton weight-only matmuls", lambda: linear_section(device, bandwidth, quick)), ("Triton matmuls of pre-quantized checkpoints", lambda: checkpoint_linear_section(device, bandwidth, quick)), ("Triton fused MoE", lambda: moe_section(device, bandwidth, quick)), ("CUDA graphs of the decode step", lambda: graph_section(device, quick)), ("Few-shot workload", lambda: end_to_end_section(device, quick))):
        if args.only.lower() not in title.lower():
            continue
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
