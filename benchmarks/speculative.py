"""Speculative decoding on SmolLM2: output tokens/s with speculation off, ngram and draft, side by side.

Workloads (greedy, chat prompts): (a) JSON extraction that copies a record from a long list,
(b) summarisation of a passage, (c) open chat. Each runs at batch 1 (requests one after the
other) and batch 8 (eight at once), once per algorithm, all in one run on one machine. The
outputs of every algorithm are compared with speculation off (greedy: they must be identical).

    .venv/bin/python benchmarks/speculative.py [--quick] [--algorithms off,ngram,draft]
        [--batch-sizes 1,8] [--out benchmarks/results/speculative.md]

``--quick`` runs one round of short outputs (a smoke test, not a measurement). ``draft`` is the
self-draft (the model's own weights in int4) behind the gate; ``draft-always`` the same with the
gate forced open (every row drafts K tokens every step).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

import radixlm

RECORDS = [
    ("Ada Lovelace", "10 December 1815", "London", "mathematician", "Analytical Engine notes"),
    ("Alan Turing", "23 June 1912", "Maida Vale", "computer scientist", "Turing machine"),
    ("Grace Hopper", "9 December 1906", "New York City", "computer scientist", "COBOL"),
    ("Edsger Dijkstra", "11 May 1930", "Rotterdam", "computer scientist", "shortest path algorithm"),
    ("Katherine Johnson", "26 August 1918", "White Sulphur Springs", "mathematician", "orbital mechanics"),
    ("Claude Shannon", "30 April 1916", "Petoskey", "engineer", "information theory"),
    ("Barbara Liskov", "7 November 1939", "Los Angeles", "computer scientist", "substitution principle"),
    ("John von Neumann", "28 December 1903", "Budapest", "mathematician", "stored-program architecture"),
]

PASSAGE = (
    "The radix tree keeps the key-value cache of every prompt that a server has seen, keyed by its "
    "tokens. When a new request shares a prefix with an earlier one, the shared part is not "
    "computed again: the scheduler finds the longest cached prefix, locks it, and computes only "
    "the rest. Under memory pressure the least recently used leaves are evicted first. Programs "
    "that fork a conversation into several branches, or agents that send the same system prompt "
    "and tool descriptions on every call, therefore pay for their long shared prefix only once."
)

CHAT = ["Give me three tips for learning to play the guitar.", "What should I pack for a weekend hike?", "Explain why the sky is blue to a child.", "Suggest a name for a small bakery and say why.", "How do I make a good cup of tea?", "What are the benefits of reading every day?", "Describe a quiet morning in a small town.", "Why do cats like boxes?"]


def chat(text: str) -> str:
    """A SmolLM2 chat prompt."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def workloads(n: int) -> dict[str, list[str]]:
    """``n`` prompts per workload."""
    extraction = []
    keys = ("name", "born", "place", "profession", "known_for")
    rows = "\n".join(json.dumps(dict(zip(keys, r))) for r in RECORDS)
    for i in range(n):
        name = RECORDS[i % len(RECORDS)][0]
        extraction.append(chat(f"Here are some people, one JSON object per line:\n{rows}\n\nReturn the JSON object of {name}, copying it exactly from the list."))
    summary = [chat(f"Summarise this passage in two sentences, reusing its words:\n\n{PASSAGE}\n\n(version {i})") for i in range(n)]
    return {"(a) JSON extraction": extraction, "(b) summarisation": summary, "(c) open chat": [chat(CHAT[i % len(CHAT)]) for i in range(n)]}


def engine_for(algorithm: str, model: str | None):
    """An engine with the algorithm's speculation (``draft-always``: the self-draft with the gate
    bypassed, every row drafting K tokens every step, to show what ungated drafting costs)."""
    if algorithm == "off":
        return radixlm.Engine(model, max_total_tokens=16384)
    engine = radixlm.Engine(model, max_total_tokens=16384, speculative_algorithm=algorithm.removesuffix("-always"))
    if algorithm.endswith("-always"):
        engine.scheduler.speculator.gate.plan = lambda key, max_tokens, *args, **kwargs: max_tokens
    return engine


def run(engine, prompts: list[str], batch: int, max_new: int) -> dict:
    """Output tokens/s of ``prompts`` in groups of ``batch``; the outputs and speculation counters."""
    params = {"max_new_tokens": max_new, "temperature": 0}
    engine.generate(prompts[0], sampling_params={"max_new_tokens": 4, "temperature": 0})  # warm
    engine.flush_cache()
    outs, start, decode_s = [], time.perf_counter(), 0.0
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        res = engine.generate(group, sampling_params=params)
        res = res if isinstance(res, list) else [res]
        outs += res
        # decode time of the group: from its last first token to its last finished request
        decode_s += max(o["meta_info"]["e2e_latency"] for o in res) - max(o["meta_info"]["ttft"] for o in res)
    seconds = time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    decode_tokens = sum(o["meta_info"]["completion_tokens"] - 1 for o in outs)
    passes = sum(o["meta_info"].get("spec_verify_passes", 0) for o in outs)
    accepted = sum(o["meta_info"].get("spec_accepted_tokens", 0) for o in outs)
    return {"tps": tokens / seconds, "decode_tps": decode_tokens / decode_s if decode_s > 0 else float("nan"), "accept": accepted / passes if passes else None, "ids": [o["output_ids"] for o in outs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    ap.add_argument("--algorithms", default="off,ngram,draft,draft-always")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 prompts, 24 tokens")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "speculative.md"))
    a = ap.parse_args()
    algorithms = [x for x in a.algorithms.split(",") if x]
    if "off" not in algorithms:
        algorithms.insert(0, "off")
    batches = [int(b) for b in a.batch_sizes.split(",")]
    n, max_new = (2, 24) if a.quick else (a.prompts, a.max_new_tokens)
    loads = workloads(max(n, max(batches)) if not a.quick else n)
    results: dict[tuple, dict] = {}
    engines = {algorithm: engine_for(algorithm, a.model) for algorithm in algorithms}
    try:  # interleaved (workload, batch, algorithm) so that drift on a shared machine hits all alike
        for name, prompts in loads.items():
            for batch in batches:
                for algorithm, engine in engines.items():
                    results[(algorithm, name, batch)] = r = run(engine, prompts, batch, max_new)
                    print(f"{algorithm:12s} {name:22s} batch {batch}: {r['tps']:.1f} tok/s ({r['decode_tps']:.1f} decoding), accept {r['accept']}", file=sys.stderr)
        for algorithm, engine in engines.items():
            print(f"{algorithm}: {engine.get_stats().get('spec_accept_rate')} accept rate", file=sys.stderr)
    finally:
        for engine in engines.values():
            engine.shutdown()
    lines = [
        "# Speculative decoding: output tokens/s, off vs ngram vs draft",
        "",
        f"Date: {datetime.date.today()}; machine: {platform.machine()}, {os.cpu_count()} CPUs, CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; model: {a.model or 'SmolLM2-135M-Instruct'}; greedy, {max_new} new tokens, {n} prompts per workload{' (--quick: a smoke run, not a measurement)' if a.quick else ''}.",
        "",
        "Each cell: output tokens/s end to end (prompt included) and, after the slash, while decoding "
        "(from the group's last first token to its end); the ratio of the decoding figure to speculation "
        "off; mean accepted draft tokens per verify pass. \"same\" says whether every output matched "
        "speculation off token for token.",
        "",
        "| workload | batch | " + " | ".join(algorithms) + " |",
        "|---|---|" + "---|" * len(algorithms),
    ]
    for name in loads:
        for batch in batches:
            base = results[("off", name, batch)]
            cells = []
            for algorithm in algorithms:
                r = results[(algorithm, name, batch)]
                if algorithm == "off":
                    cells.append(f"{r['tps']:.1f} / {r['decode_tps']:.1f}")
                    continue
                same = "same" if r["ids"] == base["ids"] else "DIFFERENT"
                accept = f"{r['accept']:.2f}" if r["accept"] is not None else "-"
                cells.append(f"{r['tps']:.1f} / {r['decode_tps']:.1f} ({r['decode_tps'] / base['decode_tps']:.2f}x, accept {accept}, {same})")
            lines.append(f"| {name} | {batch} | " + " | ".join(cells) + " |")
    lines += ["", "The gate speculates for a request only while its measured acceptance pays for the extra verified positions (their cost measured from the pass times at the current batch size) and, for the draft model, for the draft passes; never above 8 decoding requests (GateConfig.max_batch)."]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
