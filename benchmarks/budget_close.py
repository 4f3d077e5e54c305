"""JSON outputs at a token budget, with the budget closer (the default) and without: how many are
valid, how they end, and what the closer costs per output token, side by side in one engine.

Requests: a pydantic ``City`` (the issue's example: name, country, population >= 0) and ``Notes``
(a title, a list of tags, a list of pages of {n, text}), and the first jsonschemabench
Github_easy schemas that compile, each asked for "a JSON object for this schema" through the
embedded SmolLM2's chat template; ``max_new_tokens`` 48, 80 and 256, greedy and temperature 1
(one seed per request), 8 requests at a time. The two modes alternate per (budget, temperature),
on one engine, so both see the same moments of a shared machine. Valid: the text parses and
validates against its schema (``jsonschema``).

    .venv/bin/python benchmarks/budget_close.py [--schemas 14] [--out benchmarks/results/budget_close.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import jsonschema
import torch
from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).parent))
from lazy_mask import pick_schemas  # noqa: E402
from report import write  # noqa: E402


class City(BaseModel):
    name: str
    country: str
    population: int = Field(ge=0)


class Page(BaseModel):
    n: int
    text: str


class Notes(BaseModel):
    title: str
    tags: list[str]
    pages: list[Page]


def valid(text: str, schema: dict) -> bool:
    """Whether ``text`` is JSON that ``schema`` accepts."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError, jsonschema.SchemaError):
        return False
    return True


def run(engine, prompts: list[str], schemas: list[dict], budget: int, temperature: float, close: bool) -> dict:
    """The requests at one budget, temperature and mode: valid count, finish reasons, tokens, wall."""
    params = [{"json_schema": s, "max_new_tokens": budget, "temperature": temperature, "seed": 100 + i, "close_json_within_budget": close} for i, s in enumerate(schemas)]
    start, outs = time.perf_counter(), []
    for i in range(0, len(prompts), 8):
        outs += engine.generate(prompts[i : i + 8], params[i : i + 8])
    wall = time.perf_counter() - start
    reasons = [o["meta_info"]["finish_reason"] for o in outs]
    return {
        "valid": sum(valid(o["text"], s) for o, s in zip(outs, schemas)),
        "stop": sum(r["type"] == "stop" for r in reasons),
        "shortened": sum(bool(r.get("closed_within_budget")) for r in reasons),
        "length": sum(r["type"] == "length" and not r.get("closed_within_budget") for r in reasons),
        "tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
        "wall": wall,
    }


def main(argv: list[str] | None = None) -> int:
    import radixlm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemas", type=int, default=14, help="jsonschemabench schemas beside City and Notes")
    ap.add_argument("--out", default="benchmarks/results/budget_close.md")
    args = ap.parse_args(argv)
    schemas = [City.model_json_schema(), Notes.model_json_schema(), *pick_schemas(args.schemas)]
    engine = radixlm.Engine(num_threads=2)
    rows = []
    try:
        tok = engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write a JSON object for this schema: {json.dumps(s)}"}], tokenize=False, add_generation_prompt=True) for s in schemas]
        engine.generate(prompts, [{"json_schema": s, "max_new_tokens": 2} for s in schemas])  # warm-up (grammars compiled, closer's tables built), not counted
        for budget in (48, 80, 256):
            for temperature in (0.0, 1.0):
                got = {}
                for close in (True, False) if (budget + int(temperature)) % 2 == 0 else (False, True):
                    got[close] = run(engine, prompts, schemas, budget, temperature, close)
                for close in (True, False):
                    r = got[close]
                    rows.append(
                        f"| {budget} | {temperature:g} | {'on' if close else 'off'} | {r['valid']} / {len(schemas)} | {r['stop']} | {r['shortened']} | {r['length']} | "
                        f"{r['tokens']:,} | {r['wall'] / max(r['tokens'], 1) * 1e3:.2f} |"
                    )
                    print(rows[-1], file=sys.stderr, flush=True)
    finally:
        engine.shutdown()
    lines = [
        "# JSON at a token budget: the budget closer on and off",
        "",
        f"Command: `benchmarks/budget_close.py --schemas {args.schemas}`; date {datetime.date.today()}; SmolLM2-135M-Instruct (the embedded Q4_1 file), "
        f"2 threads, CPU capability {torch.backends.cpu.get_cpu_capability()}; llguidance backend.",
        "",
        f"{len(schemas)} schemas: City, Notes and {len(schemas) - 2} jsonschemabench Github_easy ones; one request each, 8 at a time, seeds 100+.",
        "Finish: stop (the JSON ended by itself), shortened (the closer narrowed a mask: `length` with `closed_within_budget`), cut (`length`, the JSON unfinished).",
        "ms / token: wall time over output tokens, both modes alternated on one engine (the closer's cost is the difference).",
        "",
        "| max_tokens | temperature | closer | valid | stop | shortened | cut | output tokens | ms / token |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]
    write("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
