"""Batched multi-LoRA: decode tokens/s of a batch of 32 over 1, 4 and 16 adapters against the base.

One engine serves 16 random rank-``--rank`` adapters of the model (every projection targeted:
q/k/v/o/gate/up/down, written as PEFT folders); a batch of 32 short prompts decodes with its
requests spread round-robin over 1, 4 or 16 of them, or on the base model alone, all in one run.
Decode tokens/s is the slope between two runs of the same batch that differ only in
``max_new_tokens`` (so prefill and admission cancel out). The base is measured twice: through
the same engine (on CPUs its decode steps take the C++ decode stack) and with the Python layers
(``--disable-decode-stack``), which is the path a step with adapter rows takes.

    .venv/bin/python benchmarks/lora.py [--model PATH] [--rank 16] [--quick] [--out benchmarks/results/lora.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from report import machine, write  # noqa: E402

import radixlm  # noqa: E402
from radixlm.runtime.loader import load_model_config, resolve_model_path  # noqa: E402
from radixlm.runtime.lora.adapter import module_sizes  # noqa: E402

BATCH = 32
PROJECTIONS = {"q_proj": ("self_attn", 0), "k_proj": ("self_attn", 1), "v_proj": ("self_attn", 2), "o_proj": ("self_attn", None),
               "gate_proj": ("mlp", 0), "up_proj": ("mlp", 1), "down_proj": ("mlp", None)}  # fmt: skip


def write_adapter(folder: Path, cfg, rank: int, seed: int, targets: list[str]) -> str:
    """A random PEFT adapter folder of rank ``rank`` on the ``targets`` projections of ``cfg``'s layers."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    sizes = module_sizes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj, (block, part) in PROJECTIONS.items():
            if proj not in targets:
                continue
            fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}.get(proj, proj)
            width, parts = sizes[f"{block}.{fused}"]
            out = sum(parts) if part is None else parts[part]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, width, generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.02
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    conf = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(conf))
    return str(folder)


def decode_rate(engine, prompts: list[list[int]], loras: list[str | None], short: int, long: int, repeats: int = 3) -> float:
    """Decode tokens/s of the batch: the slope between ``short`` and ``long`` new tokens (the best time of ``repeats`` each)."""

    def run(n: int) -> float:
        params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()

        async def main():
            await asyncio.gather(*(engine.async_generate(input_ids=p, sampling_params=params, lora=lora) for p, lora in zip(prompts, loras)))

        asyncio.run(main())
        return time.perf_counter() - t0

    run(short)  # warm-up
    shorts, longs = [], []
    for _ in range(repeats):
        shorts.append(run(short))
        longs.append(run(long))
    return len(prompts) * (long - short) / max(min(longs) - min(shorts), 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: the embedded SmolLM2-135M)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=",".join(PROJECTIONS), help="comma-separated projections the adapters target (PEFT's default for Llama: q_proj,v_proj)")
    parser.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    path = resolve_model_path(args.model)
    cfg = load_model_config(path)
    short, long = (4, 24) if args.quick else (8, 72)
    prompts = [[1 + (17 * i + j) % 500 for j in range(16)] for i in range(BATCH)]  # distinct: no shared prefix
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(16)]
        targets = args.targets.split(",")
        paths = [f"{n}={write_adapter(Path(tmp) / n, cfg, args.rank, i, targets)}" for i, n in enumerate(names)]
        with radixlm.Engine(model_path=path, lora_paths=paths, max_loras_per_batch=16, max_running_requests=BATCH, max_total_tokens=BATCH * 128) as eng:
            base = decode_rate(eng, prompts, [None] * BATCH, short, long)
            adapter_mib = eng.runner.lora.pool.get(names[0]).nbytes() / 2**20 if names[0] in eng.runner.lora.pool.loaded else float("nan")
            weight_mib = eng.runner.weight_bytes / 2**20
            rows.append(("base (same engine)", base))
            for k in (1, 4, 16):
                rows.append((f"{k} adapter{'s' if k > 1 else ''}", decode_rate(eng, prompts, [names[i % k] for i in range(BATCH)], short, long)))
        with radixlm.Engine(model_path=path, max_running_requests=BATCH, max_total_tokens=BATCH * 128, disable_decode_stack=True) as eng:
            python_base = decode_rate(eng, prompts, [None] * BATCH, short, long)
    lines = [
        "# Batched multi-LoRA decode",
        "",
        f"`benchmarks/lora.py{' --quick' if args.quick else ''} --rank {args.rank} --targets {args.targets}`: {Path(path).name} "
        f"({weight_mib:.0f} MiB of weights), batch {BATCH}, rank {args.rank} on {args.targets} ({adapter_mib:.1f} MiB an adapter, as served), "
        f"decode tokens/s from the slope between {short} and {long} new tokens (the best of 3 runs each); {machine()}, {torch.get_num_threads()} threads.",
        "",
        "| batch of 32 on | decode tok/s | time a token vs the base (same engine) | vs the base on the Python layers |",
        "|---|---:|---:|---:|",
        f"| base, Python layers (`--disable-decode-stack`) | {python_base:.1f} | {base / python_base - 1:+.0%} | +0% |",
    ]
    for label, rate in rows:
        lines.append(f"| {label} | {rate:.1f} | {base / rate - 1:+.0%} | {python_base / rate - 1:+.0%} |")
    write("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
