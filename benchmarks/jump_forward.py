"""Jump-forward on a JSON workload: forward passes per output token and wall time, on vs off.

Each request (a JSON schema with many fixed keys, greedy) runs alone, so the engine's forward
pass counter measures that request exactly. Outputs with and without jump-forward are compared.

    .venv/bin/python benchmarks/jump_forward.py [--out benchmarks/results/jump_forward.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import radixlm

SUBJECTS = ["a teacher in Lisbon", "a shop in Oslo", "a festival in Kyoto", "a bakery in Lyon", "a runner from Nairobi", "a library in Quebec"]


def prompt(variant: int) -> str:
    """A chat prompt asking for a record about one subject."""
    return f"<|im_start|>user\nFill in this record about {SUBJECTS[variant % len(SUBJECTS)]} with plausible values, as JSON.<|im_end|>\n<|im_start|>assistant\n"


def schemas() -> list[dict]:
    """Record-like schemas: many forced keys and punctuation between short free values."""
    people = {
        "type": "object",
        "properties": {
            "first_name": {"type": "string", "maxLength": 12},
            "last_name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "is_employed": {"type": "boolean"},
            "favourite_language": {"enum": ["python", "rust", "go", "javascript"]},
            "address": {
                "type": "object",
                "properties": {"street_name": {"type": "string", "maxLength": 20}, "house_number": {"type": "integer", "minimum": 1, "maximum": 999}, "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street_name", "house_number", "postal_code"],
                "additionalProperties": False,
            },
        },
        "required": ["first_name", "last_name", "age", "is_employed", "favourite_language", "address"],
        "additionalProperties": False,
    }
    product = {
        "type": "object",
        "properties": {
            "product_identifier": {"type": "string", "pattern": "^SKU-[0-9]{6}$"},
            "display_name": {"type": "string", "maxLength": 24},
            "unit_price_in_euros": {"type": "number", "minimum": 0, "maximum": 1000},
            "available_in_stock": {"type": "boolean"},
            "product_category": {"enum": ["books", "electronics", "garden", "kitchen"]},
            "customer_rating_out_of_five": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["product_identifier", "display_name", "unit_price_in_euros", "available_in_stock", "product_category", "customer_rating_out_of_five"],
        "additionalProperties": False,
    }
    event = {
        "type": "object",
        "properties": {
            "event_title": {"type": "string", "maxLength": 24},
            "event_date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
            "number_of_attendees": {"type": "integer", "minimum": 1, "maximum": 500},
            "is_outdoor_event": {"type": "boolean"},
            "organiser_contact": {"type": "object", "properties": {"contact_name": {"type": "string", "maxLength": 16}, "contact_phone_number": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}}, "required": ["contact_name", "contact_phone_number"], "additionalProperties": False},
        },
        "required": ["event_title", "event_date", "number_of_attendees", "is_outdoor_event", "organiser_contact"],
        "additionalProperties": False,
    }
    return [people, product, event]


def run(disable: bool, specs: list[dict], variants: int) -> dict:
    """Each (schema, prompt variant) alone: outputs, forward passes, tokens and wall time."""
    with radixlm.Engine(disable_jump_forward=disable, max_total_tokens=16384) as engine:
        engine.generate(prompt(0), {"max_new_tokens": 2})  # warm-up
        outputs, passes, tokens = [], 0, 0
        start = time.perf_counter()
        for spec in specs:
            for variant in range(variants):
                before = engine.get_stats()["forward_passes"]
                out = engine.generate(prompt(variant), {"json_schema": spec, "temperature": 0, "max_new_tokens": 256})
                passes += engine.get_stats()["forward_passes"] - before
                tokens += len(out["output_ids"])
                outputs.append(out["text"])
        return {"outputs": outputs, "passes": passes, "tokens": tokens, "seconds": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", type=int, default=4, help="Prompts (subjects) per schema.")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "jump_forward.md"))
    args = ap.parse_args()
    specs = schemas()
    off = run(True, specs, args.variants)
    on = run(False, specs, args.variants)
    same = sum(a == b for a, b in zip(on["outputs"], off["outputs"]))
    valid = sum(1 for t in on["outputs"] if _is_json(t))
    lines = [
        "# Jump-forward on a JSON workload",
        "",
        f"Command: `{' '.join(sys.argv)}`; date {datetime.date.today()}; SmolLM2-135M-Instruct, fp32, greedy, one request at a time.",
        "",
        f"Workload: {len(specs)} record schemas x {args.variants} prompt variants = {len(on['outputs'])} requests.",
        "",
        "| jump-forward | output tokens | forward passes | passes per output token | wall time (s) |",
        "|---|---:|---:|---:|---:|",
        f"| off | {off['tokens']} | {off['passes']} | {off['passes'] / off['tokens']:.3f} | {off['seconds']:.1f} |",
        f"| on | {on['tokens']} | {on['passes']} | {on['passes'] / on['tokens']:.3f} | {on['seconds']:.1f} |",
        "",
        f"Identical greedy output: {same}/{len(on['outputs'])}; outputs that parse as JSON: {valid}/{len(on['outputs'])}.",
        f"Wall-time ratio off/on: {off['seconds'] / on['seconds']:.2f}x; forward passes off/on: {off['passes'] / on['passes']:.2f}x.",
    ]
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


if __name__ == "__main__":
    main()
