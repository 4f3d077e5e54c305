"""Lazy grammar masking on JSON-schema requests: masks computed and the time a step spends on
them, eager vs lazy, side by side in one run with the same requests and seeds.

Requests: jsonschemabench Github_easy schemas (the first that compile), 8 at a time, each asked
for "a JSON object for this schema"; greedy and temperature 0.8. Per step, the mask time is the
sum over the step's constrained rows (they are computed one after another before sampling).

    .venv/bin/python benchmarks/lazy_mask.py [--schemas 16] [--out benchmarks/results/lazy_mask.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from report import write  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "shared" / "jsonschemabench"


def pick_schemas(n: int) -> list[dict]:
    """The first ``n`` Github_easy schemas llguidance compiles (small ones, to keep prompts short)."""
    from radixlm.runtime.constrained.base import GrammarError
    from radixlm.runtime.constrained.llguidance_backend import LLGuidanceBackend
    from radixlm.runtime.loader import default_model_path, load_model_config
    from radixlm.runtime.tokenizer import end_token_ids, load_tokenizer

    path = default_model_path()
    tok, cfg = load_tokenizer(path), load_model_config(path)
    backend = LLGuidanceBackend(tok, cfg.vocab_size, end_token_ids(tok, cfg.eos_token_ids))
    out = []
    for f in sorted(BENCH.glob("Github_easy---*.json")):
        schema = json.loads(f.read_text())["schema"]
        text = json.dumps(schema)
        if len(text) > 1200:
            continue
        try:
            backend.compile("json_schema", text)
        except GrammarError:
            continue
        out.append(schema)
        if len(out) == n:
            break
    return out


def instrument(engine) -> dict:
    """Time every grammar mask the engine's decoder computes, summed per step."""
    decoder = engine.scheduler.decoder
    record = {"steps": [], "current": 0.0}
    mask, process = decoder._grammar_row_mask, decoder.process

    def timed_mask(req):
        t = time.perf_counter()
        try:
            return mask(req)
        finally:
            record["current"] += time.perf_counter() - t

    def timed_process(logits, spans):
        record["current"] = 0.0
        try:
            return process(logits, spans)
        finally:
            if any(row.req.grammar is not None for row, _, _ in spans.picks):
                record["steps"].append(record["current"])

    decoder._grammar_row_mask, decoder.process = timed_mask, timed_process
    return record


def run(mode: str, schemas: list[dict], temperature: float, max_tokens: int) -> dict:
    """One engine with ``--grammar-mask mode``: outputs, mask counts, per-step mask times, wall."""
    import radixlm

    engine = radixlm.Engine(grammar_mask=mode, num_threads=2)
    try:
        record = instrument(engine)
        tok = engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write a JSON object for this schema: {json.dumps(s)}"}], tokenize=False, add_generation_prompt=True) for s in schemas]
        params = [{"json_schema": s, "max_new_tokens": max_tokens, "temperature": temperature, "seed": 100 + i} for i, s in enumerate(schemas)]
        engine.generate(prompts[:1], params[:1])  # warm the model and kernels (not counted)
        record["steps"].clear()
        before = engine.get_stats()
        t0 = time.perf_counter()
        outs = []
        for i in range(0, len(prompts), 8):
            outs += engine.generate(prompts[i : i + 8], params[i : i + 8])
        wall = time.perf_counter() - t0
        after = engine.get_stats()
    finally:
        engine.shutdown()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    steps = np.array(record["steps"]) * 1e6
    return {
        "texts": [o["text"] for o in outs],
        "tokens": tokens,
        "masks": after["grammar_masks"] - before["grammar_masks"],
        "lazy_picks": after["grammar_lazy_picks"] - before["grammar_lazy_picks"],
        "steps": len(steps),
        "step_us_p50": float(np.percentile(steps, 50)),
        "step_us_p99": float(np.percentile(steps, 99)),
        "step_us_mean": float(steps.mean()),
        "wall": wall,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemas", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default="benchmarks/results/lazy_mask.md")
    args = ap.parse_args(argv)
    schemas = pick_schemas(args.schemas)
    rows, same = [], []
    for temperature in (0.0, 0.8):
        got = {mode: run(mode, schemas, temperature, args.max_tokens) for mode in ("eager", "lazy")}
        same.append((temperature, sum(a == b for a, b in zip(got["eager"]["texts"], got["lazy"]["texts"])), len(schemas)))
        for mode, r in got.items():
            rows.append(
                f"| {temperature} | {mode} | {r['tokens']:,} | {r['masks']:,} | {r['masks'] / max(r['tokens'], 1):.2f} | {r['lazy_picks']:,} | {r['steps']:,} | "
                f"{r['step_us_p50']:.0f} | {r['step_us_p99']:.0f} | {r['step_us_mean']:.0f} | {r['tokens'] / r['wall']:.1f} |"
            )
            print(rows[-1], file=sys.stderr)
    lines = [
        "# Lazy grammar masking",
        "",
        f"Command: `benchmarks/lazy_mask.py --schemas {args.schemas} --max-tokens {args.max_tokens}`; date {datetime.date.today()}; "
        f"SmolLM2-135M-Instruct, fp32, 2 threads, CPU capability {torch.backends.cpu.get_cpu_capability()}; llguidance backend.",
        "",
        f"Workload: {len(schemas)} jsonschemabench Github_easy schemas (the first that compile, under 1,200 characters), one request each, "
        "8 at a time; the same seeds in both modes. Mask time per step: the sum over the step's constrained rows.",
        "",
        "| temperature | mask | output tokens | masks | masks per token | picks taken without a mask | steps | mask µs per step p50 | p99 | mean | tok/s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        *[f"Identical outputs at temperature {t}: {n}/{total}." for t, n, total in same],
    ]
    write("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
