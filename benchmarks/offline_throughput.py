"""Offline throughput on a shared-prefix batch: radixlm vs transformers, side by side in one run.

Workload: 64 requests sharing a ~420-token few-shot prefix, each with its own ~20-token
question, 32 greedy new tokens each, on the embedded SmolLM2-135M-Instruct (fp32). Compared:
radixlm's Engine (all requests at once), transformers ``generate`` one request at a time, and
transformers ``generate`` on one left-padded batch. Also batch-1 decode ms/token for both.

    .venv/bin/python benchmarks/offline_throughput.py [--num-requests 64] [--out FILE]
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
from workloads import few_shot_prompts, optimal_cached_tokens  # noqa: E402

import radixlm  # noqa: E402
from radixlm.runtime.loader import default_model_path  # noqa: E402


def run_radixlm(engine: radixlm.Engine, prompts: list[str], new_tokens: int) -> dict:
    """Time all prompts submitted at once; cache hit rate from the requests' meta_info."""
    engine.flush_cache()
    sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    t = time.perf_counter()
    outs = engine.generate(prompts, sp)
    dt = time.perf_counter() - t
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    ids = [engine.tokenize(p) for p in prompts]
    return {
        "seconds": dt,
        "output_tokens": sum(len(o["output_ids"]) for o in outs),
        "hit_rate": cached / prompt_tokens,
        "optimal_hit_rate": optimal_cached_tokens(ids, engine.args.page_size) / prompt_tokens,
        "outputs": [o["output_ids"] for o in outs],
    }


def radixlm_decode_ms(engine: radixlm.Engine, n: int = 128) -> float:
    """Batch-1 decode time per token (excluding the prefill)."""
    out = engine.generate("Tell me a long story about a dragon.", {"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
    meta = out["meta_info"]
    return (meta["e2e_latency"] - meta["ttft"]) / (n - 1) * 1e3


def load_hf(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model.generation_config.eos_token_id = None
    return model, tok


def hf_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


def run_hf_one_by_one(model, tok, prompts: list[str], new_tokens: int) -> dict:
    outs = []
    t = time.perf_counter()
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        out = hf_generate(model, ids, torch.ones_like(ids), new_tokens)
        outs.append(out[0, ids.shape[1] :].tolist())
    dt = time.perf_counter() - t
    return {"seconds": dt, "output_tokens": sum(len(o) for o in outs), "outputs": outs}


def run_hf_padded(model, tok, prompts: list[str], new_tokens: int, batch_size: int) -> dict:
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    total = 0
    t = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        enc = tok(prompts[i : i + batch_size], return_tensors="pt", padding=True)
        out = hf_generate(model, enc.input_ids, enc.attention_mask, new_tokens)
        total += (out.shape[1] - enc.input_ids.shape[1]) * out.shape[0]
    return {"seconds": time.perf_counter() - t, "output_tokens": total}


def hf_decode_ms(model, tok, n: int = 128) -> float:
    ids = tok("Tell me a long story about a dragon.", return_tensors="pt").input_ids
    mask = torch.ones_like(ids)
    hf_generate(model, ids, mask, 2)
    t = time.perf_counter()
    hf_generate(model, ids, mask, 1)
    one = time.perf_counter() - t
    t = time.perf_counter()
    hf_generate(model, ids, mask, n)
    return (time.perf_counter() - t - one) / (n - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--hf-batch-size", type=int, default=64, help="Batch size of the padded transformers run.")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "offline_throughput.md"))
    args = ap.parse_args()

    prompts = few_shot_prompts(args.num_requests)
    path = default_model_path()
    engine = radixlm.Engine()
    threads = torch.get_num_threads()
    engine.generate(prompts[0], {"max_new_tokens": 4})  # warm-up
    rl = run_radixlm(engine, prompts, args.new_tokens)
    rl_ms = radixlm_decode_ms(engine)
    engine.shutdown()

    model, tok = load_hf(path)
    hf_decode_ms(model, tok, 4)  # warm-up
    one = run_hf_one_by_one(model, tok, prompts, args.new_tokens)
    padded = run_hf_padded(model, tok, prompts, args.new_tokens, args.hf_batch_size)
    hf_ms = hf_decode_ms(model, tok)

    same = sum(a == b for a, b in zip(rl["outputs"], one["outputs"]))
    tps = {name: r["output_tokens"] / r["seconds"] for name, r in (("radixlm", rl), ("one", one), ("padded", padded))}
    lines = [
        "# Offline throughput: shared-prefix batch",
        "",
        f"Command: `.venv/bin/python benchmarks/offline_throughput.py --num-requests {args.num_requests} --new-tokens {args.new_tokens} --hf-batch-size {args.hf_batch_size}`  ",
        f"Date: {datetime.date.today()}; machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {threads} intra-op threads; model: SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to fp32) for both.",
        "",
        f"Workload: {args.num_requests} requests sharing a ~420-token few-shot prefix, a distinct ~20-token question each, {args.new_tokens} greedy new tokens (EOS ignored).",
        "",
        "| system | wall time (s) | output tokens | output tok/s | radixlm speed-up |",
        "|---|---:|---:|---:|---:|",
        f"| radixlm Engine (all at once) | {rl['seconds']:.1f} | {rl['output_tokens']} | {tps['radixlm']:.1f} | 1.00× |",
        f"| transformers, one by one | {one['seconds']:.1f} | {one['output_tokens']} | {tps['one']:.1f} | {tps['radixlm'] / tps['one']:.2f}× |",
        f"| transformers, padded batch of {args.hf_batch_size} | {padded['seconds']:.1f} | {padded['output_tokens']} | {tps['padded']:.1f} | {tps['radixlm'] / tps['padded']:.2f}× |",
        "",
        f"radixlm cache hit rate (cached / prompt tokens): {rl['hit_rate']:.4f}; optimal for this workload: {rl['optimal_hit_rate']:.4f} (gap {100 * (rl['optimal_hit_rate'] - rl['hit_rate']):.2f} points).",
        "",
        f"Batch-1 decode: radixlm {rl_ms:.1f} ms/token, transformers {hf_ms:.1f} ms/token.",
        "",
        f"Greedy outputs identical to transformers one-by-one: {same}/{len(prompts)}.",
    ]
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
