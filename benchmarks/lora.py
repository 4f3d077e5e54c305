"""Batched multi-LoRA: decode tokens/s of a batch of 32 over 1, 4 and 16 adapters against the base.

One engine serves 16 random rank-``--rank`` adapters of the model (every projection targeted:
q/k/v/o/gate/up/down, written as PEFT folders); a batch of 32 short prompts decodes with its
requests spread round-robin over 1, 4 or 16 of them, or on the base model alone, all in one run.
Decode tokens/s is the slope between two runs of the same batch that differ only in
``max_new_tokens`` (so prefill and admission cancel out). The base is measured twice: through
the same engine (on CPUs its decode steps take the C++ decode stack) and with the Python layers
(``--disable-decode-stack``), which is the path a step with adapter rows takes.

    .venv/bin/python benchmarks/lora.py [--model PATH] [--rank 16] [--targets ...] [--quick] [--out benchmarks/results/lora.md]
    cd /tmp && /work/main/.venv/bin/python /work/main/benchmarks/lora.py --shape llama-3.2-1b --dtype bfloat16

``--shape llama-3.2-1b`` builds a model of Llama-3.2-1B's published shape with random weights
(transformers' own class, bf16, a small SentencePiece tokenizer) in a temporary folder; run it
from outside the repository, where ``./kernels`` cannot shadow the package transformers probes for.
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


LLAMA_3_2_1B = dict(  # meta-llama/Llama-3.2-1B's config.json
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"},
)  # fmt: skip


def random_llama_1b(folder: Path) -> str:
    """A Llama-3.2-1B-shaped model with random weights (bf16 safetensors) saved into ``folder``."""
    import transformers
    from families import make_tokenizer

    cfg = transformers.LlamaConfig(**LLAMA_3_2_1B, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(folder))
    make_tokenizer(folder)  # a small SentencePiece one (ids 0-399); the prompts are token ids
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
    parser.add_argument("--shape", choices=["llama-3.2-1b"], default=None, help="instead of --model, a model of this published shape with random weights")
    parser.add_argument("--dtype", default="auto", help="the engine's --dtype (auto: fp32 on CPUs)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=",".join(PROJECTIONS), help="comma-separated projections the adapters target (PEFT's default for Llama: q_proj,v_proj)")
    parser.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    short, long = (4, 24) if args.quick else (8, 72)
    prompts = [[1 + (17 * i + j) % 500 for j in range(16)] for i in range(BATCH)]  # distinct: no shared prefix
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = random_llama_1b(Path(tmp) / "model") if args.shape else resolve_model_path(args.model)
        cfg = load_model_config(path)
        names = [f"a{i}" for i in range(16)]
        targets = args.targets.split(",")
        paths = [f"{n}={write_adapter(Path(tmp) / n, cfg, args.rank, i, targets)}" for i, n in enumerate(names)]
        with radixlm.Engine(model_path=path, lora_paths=paths, max_loras_per_batch=16, max_running_requests=BATCH, max_total_tokens=BATCH * 128, dtype=args.dtype) as eng:
            base = decode_rate(eng, prompts, [None] * BATCH, short, long)
            adapter_mib = eng.runner.lora.pool.get(names[0]).nbytes() / 2**20 if names[0] in eng.runner.lora.pool.loaded else float("nan")
            weight_mib = eng.runner.weight_bytes / 2**20
            served_dtype = str(eng.runner.dtype).removeprefix("torch.")
            kernel = "the C++ grouped kernel" if eng.runner.lora.kernels is not None else "the PyTorch path"
            rows.append(("base (same engine)", base))
            for k in (1, 4, 16):
                rows.append((f"{k} adapter{'s' if k > 1 else ''}", decode_rate(eng, prompts, [names[i % k] for i in range(BATCH)], short, long)))
        if served_dtype == "float32":  # the adapters stored in bf16: half the bytes a step reads
            with radixlm.Engine(model_path=path, lora_paths=paths, max_loras_per_batch=16, max_running_requests=BATCH, max_total_tokens=BATCH * 128, dtype=args.dtype, lora_dtype="bfloat16") as eng:
                rows.append(("16 adapters stored in bf16 (`--lora-dtype bfloat16`)", decode_rate(eng, prompts, [names[i % 16] for i in range(BATCH)], short, long)))
        with radixlm.Engine(model_path=path, max_running_requests=BATCH, max_total_tokens=BATCH * 128, disable_decode_stack=True, dtype=args.dtype) as eng:
            python_base = decode_rate(eng, prompts, [None] * BATCH, short, long)
    model = "Llama-3.2-1B's shape, random weights" if args.shape else Path(path).name
    command = " ".join(["benchmarks/lora.py", *(["--quick"] if args.quick else []), *([f"--shape {args.shape}"] if args.shape else []), f"--dtype {args.dtype}", f"--rank {args.rank}", f"--targets {args.targets}"])
    lines = [
        "# Batched multi-LoRA decode",
        "",
        f"`{command}`: {model} ({weight_mib:.0f} MiB of weights, served in {served_dtype}), batch {BATCH}, rank {args.rank} on {args.targets} "
        f"({adapter_mib:.1f} MiB an adapter, as served; deltas by {kernel}), decode tokens/s from the slope between {short} and {long} new tokens "
        f"(the best of 3 runs each); {machine()}, {torch.get_num_threads()} threads.",
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
