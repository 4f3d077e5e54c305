"""KV-cache dtypes side by side on SmolLM2: bytes, capacity, decode speed and quality.

For each ``--kv-cache-dtype`` (auto = the model's fp32 on CPU, bfloat16, int8, fp8_e4m3, ...),
all in one run on one machine:

- bytes per token (scales included) and how many tokens fit in a fixed memory budget;
- decode tokens/s at batch 1, 32 and 64, every request with its own ~1,000-token context
  (no shared prefix), measured from the batch's last first token to its end;
- quality against the unquantized pool: mean KL divergence of the next-token distributions over
  real text (the project's README), read both through the prefill path (positions of one
  prompt) and the decode path (one token at a time); the greedy-match rate of 32 chat prompts x
  64 tokens; and the few-shot workload's answers (64 capital-city questions, scored against the
  true capitals and compared with the unquantized answers);
- for fp8, the round-trip error of real keys and values with one scale per (token, head) (what
  the pool does) against one scale per tensor, which would save 2 bytes per head.

    .venv/bin/python benchmarks/kv_quant.py [--dtypes auto,bfloat16,int8,fp8_e4m3] [--quick]
        [--out benchmarks/results/kv_quant.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import unicodedata
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from report import write  # noqa: E402
from workloads import QUESTION_COUNTRIES, chat_questions, few_shot_prompts  # noqa: E402

import radixlm  # noqa: E402
from radixlm.kernels.kv_quant import dequantize, quantize, resolve_kv_format  # noqa: E402
from radixlm.radix_cache.pool import KVPool  # noqa: E402
from radixlm.runtime.executor.model_runner import ModelRunner  # noqa: E402
from radixlm.runtime.layers.forward_batch import ForwardBatch  # noqa: E402
from radixlm.runtime.loader import resolve_model_path  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402
from radixlm.runtime.tokenizer import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 1 << 30  # the fixed memory budget the capacity row fills

CAPITALS = {
    "Germany": ["Berlin"], "Brazil": ["Brasilia"], "Argentina": ["Buenos Aires"], "Mexico": ["Mexico City"],
    "Australia": ["Canberra"], "China": ["Beijing"], "Russia": ["Moscow"], "Thailand": ["Bangkok"],
    "Nigeria": ["Abuja"], "Morocco": ["Rabat"], "Finland": ["Helsinki"], "Denmark": ["Copenhagen"],
    "Belgium": ["Brussels"], "Hungary": ["Budapest"], "Romania": ["Bucharest"], "Bulgaria": ["Sofia"],
    "Colombia": ["Bogota"], "Venezuela": ["Caracas"], "Ecuador": ["Quito"], "Bolivia": ["Sucre", "La Paz"],
    "Uruguay": ["Montevideo"], "Paraguay": ["Asuncion"], "Iceland": ["Reykjavik"], "Estonia": ["Tallinn"],
    "Latvia": ["Riga"], "Lithuania": ["Vilnius"], "Ukraine": ["Kyiv", "Kiev"], "Croatia": ["Zagreb"],
    "Serbia": ["Belgrade"], "Slovakia": ["Bratislava"], "Slovenia": ["Ljubljana"], "Albania": ["Tirana"],
    "Ethiopia": ["Addis Ababa"], "Ghana": ["Accra"], "Senegal": ["Dakar"], "Tanzania": ["Dodoma"],
    "Uganda": ["Kampala"], "Zambia": ["Lusaka"], "Angola": ["Luanda"], "Algeria": ["Algiers"],
    "Tunisia": ["Tunis"], "Libya": ["Tripoli"], "Sudan": ["Khartoum"], "Iran": ["Tehran"],
    "Iraq": ["Baghdad"], "Syria": ["Damascus"], "Jordan": ["Amman"], "Lebanon": ["Beirut"],
    "Israel": ["Jerusalem"], "Pakistan": ["Islamabad"], "Nepal": ["Kathmandu"], "Bangladesh": ["Dhaka"],
    "Mongolia": ["Ulaanbaatar", "Ulan Bator"], "Indonesia": ["Jakarta"], "Malaysia": ["Kuala Lumpur"], "Philippines": ["Manila"],
    "Cambodia": ["Phnom Penh"], "Laos": ["Vientiane"], "Myanmar": ["Naypyidaw", "Nay Pyi Taw"], "Singapore": ["Singapore"],
    "New Zealand": ["Wellington"], "Fiji": ["Suva"], "Jamaica": ["Kingston"], "Panama": ["Panama City"],
}


def _plain(text: str) -> str:
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()


def text_tokens(tokenizer) -> list[int]:
    """The README's tokens: real English and code, the same on every machine."""
    return tokenizer((ROOT / "README.md").read_text()).input_ids


def contexts(tokens: list[int], n: int, length: int) -> list[list[int]]:
    """``n`` distinct ``length``-token windows of the text (different starts: no shared prefix)."""
    stride = max(1, (len(tokens) - length) // max(n, 1))
    return [tokens[(i * stride) % (len(tokens) - length) :][:length] for i in range(n)]


def decode_speed(engine, prompts: list[list[int]], batch: int, new_tokens: int) -> float:
    """Decode tokens/s of ``batch`` requests at once, from the batch's last first token to its end."""
    engine.flush_cache()
    res = engine.generate(input_ids=prompts[:batch], sampling_params={"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True})
    res = res if isinstance(res, list) else [res]
    seconds = max(o["meta_info"]["e2e_latency"] for o in res) - max(o["meta_info"]["ttft"] for o in res)
    return sum(o["meta_info"]["completion_tokens"] - 1 for o in res) / seconds


def next_token_logprobs(runner: ModelRunner, ids: list[int], prefill: int) -> torch.Tensor:
    """Log-probs ``[len(ids), V]`` of each next token: the first ``prefill`` positions from one
    prefill pass, the rest one decode step at a time (each reading the pool as stored)."""
    n = len(ids)
    table = torch.zeros(1, n + 1, dtype=torch.int64)
    table[0, :n] = torch.arange(1, n + 1)
    out = []
    steps = [(0, prefill)] + [(i, 1) for i in range(prefill, n)]
    for start, length in steps:
        batch = ForwardBatch(
            input_ids=torch.tensor(ids[start : start + length]), positions=torch.arange(start, start + length),
            out_slots=table[0, start : start + length], req_rows=torch.tensor([0]), prefix_lens=[start], extend_lens=[length],
            num_decode=int(start > 0), logits_indices=torch.arange(length), req_to_token=table,
            kv_pool=runner.kv_pool, attn_backend=runner.attn_backend,
        )
        out.append(torch.log_softmax(runner.forward(batch).float(), dim=-1))
    return torch.cat(out)


def fp8_scale_choice(runner: ModelRunner, num_tokens: int) -> dict[str, float]:
    """Relative RMS round-trip error of the real keys and values in an fp32 pool, as fp8_e4m3
    with a scale per (token, head) and with one scale per tensor (its largest magnitude)."""
    fmt = resolve_kv_format("fp8_e4m3", torch.float32)
    errs = {"per (token, head)": [], "per tensor": []}
    pool = runner.kv_pool
    for layer in range(pool.num_layers):
        for t in (pool.k[layer][1 : num_tokens + 1], pool.v[layer][1 : num_tokens + 1]):
            norm = t.norm()
            values, scales = quantize(t, fmt)
            errs["per (token, head)"].append(float((dequantize(values, scales, torch.float32) - t).norm() / norm))
            scale = t.abs().max() / fmt.qmax
            back = (t / scale).clamp(-fmt.qmax, fmt.qmax).to(fmt.dtype).float() * scale
            errs["per tensor"].append(float((back - t).norm() / norm))
    return {k: sum(v) / len(v) for k, v in errs.items()}


def answers_right(texts: list[str]) -> int:
    """How many few-shot answers name the true capital of their question's country."""
    right = 0
    for i, text in enumerate(texts):
        country = QUESTION_COUNTRIES[i % len(QUESTION_COUNTRIES)]
        first_line = _plain(text.strip().split("\n")[0])
        right += any(_plain(c) in first_line for c in CAPITALS[country])
    return right


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    ap.add_argument("--dtypes", default="auto,bfloat16,int8,fp8_e4m3")
    ap.add_argument("--batch-sizes", default="1,32,64")
    ap.add_argument("--context", type=int, default=1000, help="tokens of context per request in the speed rows")
    ap.add_argument("--new-tokens", type=int, default=32, help="decoded tokens per request in the speed rows")
    ap.add_argument("--quick", action="store_true", help="a smoke run: small batches, short contexts")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kv_quant.md"))
    a = ap.parse_args()
    names = [x for x in a.dtypes.split(",") if x]
    if names[0] != "auto":
        names = ["auto"] + [n for n in names if n != "auto"]
    batches = [int(b) for b in a.batch_sizes.split(",")]
    context, new_tokens = (a.context, a.new_tokens) if not a.quick else (200, 8)
    if a.quick:
        batches = [1, 4]
    model_path = resolve_model_path(a.model)
    tokenizer = load_tokenizer(model_path)
    tokens = text_tokens(tokenizer)
    prompts = contexts(tokens, max(batches), context)

    # ---- quality: KL over the README, one runner per dtype (its own pool)
    kl_text = tokens[:512] if not a.quick else tokens[:96]
    prefill = len(kl_text) // 2
    ref_lp, kl, fp8_errors, cfg = None, {}, None, None
    for name in names:
        runner = ModelRunner(ServerArgs(model_path=a.model, max_total_tokens=len(kl_text) + 8, kv_cache_dtype=name), model_path)
        lp = next_token_logprobs(runner, kl_text, prefill)
        if ref_lp is None:
            ref_lp, cfg = lp, runner.config
            fp8_errors = fp8_scale_choice(runner, len(kl_text))
        per_pos = torch.sum(ref_lp.exp() * (ref_lp - lp), dim=-1)
        kl[name] = (float(per_pos[:prefill].mean()), float(per_pos[prefill:].mean()), float(per_pos.max()))
        print(f"{name:10s} KL prefill {kl[name][0]:.2e} decode {kl[name][1]:.2e}", file=sys.stderr)
        del runner

    # ---- speed, greedy match and few-shot answers: one engine per dtype, interleaved per row
    pool_tokens = max(batches) * (context + new_tokens + 8) + 4096
    engines = {name: radixlm.Engine(a.model, max_total_tokens=pool_tokens, kv_cache_dtype=name) for name in names}
    speed: dict[tuple[str, int], float] = {}
    outputs: dict[str, dict[str, list]] = {name: {} for name in names}
    chats = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in chat_questions(32 if not a.quick else 4)]
    shots = few_shot_prompts(64 if not a.quick else 4)
    try:
        for engine in engines.values():  # warm: kernels built, first-call costs paid
            engine.generate("Hello", sampling_params={"max_new_tokens": 2})
        for batch in batches:
            for name, engine in engines.items():
                speed[(name, batch)] = decode_speed(engine, prompts, batch, new_tokens)
                print(f"{name:10s} batch {batch:3d}: {speed[(name, batch)]:.1f} decode tok/s", file=sys.stderr)
        for name, engine in engines.items():
            engine.flush_cache()
            outputs[name]["chat"] = [o["output_ids"] for o in engine.generate(chats, sampling_params={"max_new_tokens": 64, "temperature": 0, "ignore_eos": True})]
            outputs[name]["shots"] = [o["text"] for o in engine.generate(shots, sampling_params={"max_new_tokens": 16, "temperature": 0, "stop": "\n"})]
        stats = {name: engine.get_stats() for name, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.shutdown()

    ref = outputs["auto"]
    lines = [
        "# KV-cache dtypes: capacity, decode speed and quality",
        "",
        f"Date: {datetime.date.today()}; machine: {platform.machine()}, {os.cpu_count()} CPUs, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; "
        f"model: {a.model or 'SmolLM2-135M-Instruct'} (fp32 weights, {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x "
        f"{cfg.head_dim}); all dtypes in one run{' (--quick: a smoke run, not a measurement)' if a.quick else ''}.",
        "",
        f"Speed: decode tokens/s with every request holding its own {context}-token window of the README (no shared "
        f"prefix), {new_tokens} greedy tokens each, from the batch's last first token to its end. Quality against the "
        f"unquantized (auto) pool: mean KL(auto || dtype) of the next-token distributions over {len(kl_text)} README "
        f"positions ({prefill} read through one prefill, {len(kl_text) - prefill} one decode step at a time); greedy "
        f"match over {len(chats)} chat prompts x 64 tokens (outputs identical to auto, and the share of tokens before "
        f"the first difference); the few-shot workload's {len(shots)} answers (true capital named; same text as auto).",
        "",
        f"| KV dtype | bytes/token | tokens in {BUDGET >> 30} GiB | vs auto | vs bf16 | "
        + " | ".join(f"decode tok/s b={b}" for b in batches)
        + " | KL prefill | KL decode | greedy identical | tokens before 1st diff | few-shot right | few-shot same as auto |",
        "|---|---|---|---|---|" + "---|" * len(batches) + "---|---|---|---|---|---|",
    ]
    bf16_bytes = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, "bfloat16")
    for name in names:
        per_token = stats[name]["kv_bytes_per_token"]
        fits = BUDGET // per_token
        same = sum(x == y for x, y in zip(outputs[name]["chat"], ref["chat"]))
        prefix = [next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) / len(x) for x, y in zip(outputs[name]["chat"], ref["chat"])]
        shots_same = sum(x == y for x, y in zip(outputs[name]["shots"], ref["shots"]))
        cells = " | ".join(f"{speed[(name, b)]:.1f} ({speed[(name, b)] / speed[('auto', b)]:.2f}x)" for b in batches)
        lines.append(
            f"| {name} ({stats[name]['kv_cache_dtype']}) | {per_token} | {fits:,} | {fits / (BUDGET // stats['auto']['kv_bytes_per_token']):.2f}x "
            f"| {fits / (BUDGET // bf16_bytes):.2f}x | {cells} | {kl[name][0]:.2e} | {kl[name][1]:.2e} | {same}/{len(ref['chat'])} "
            f"| {sum(prefix) / len(prefix):.1%} | {answers_right(outputs[name]['shots'])}/{len(shots)} | {shots_same}/{len(shots)} |"
        )
    lines += [
        "",
        f"fp8_e4m3 scale granularity, relative RMS round-trip error of the real K and V of the {len(kl_text)} README tokens "
        "(mean over layers): " + ", ".join(f"{k}: {v:.4f}" for k, v in fp8_errors.items()) + ".",
        "",
    ]
    write("\n".join(lines), a.out if not a.quick else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
