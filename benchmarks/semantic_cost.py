"""What the semantic checks (runtime/constrained/semantic.py) cost per token.

For every jsonschemabench file whose compiled grammar carries semantic checks, each valid
instance is walked twice on fresh matchers of the same compiled grammar (the first walk warms
the grammar's lexer states, so the two sides see the same warm grammar): once through the
checked matcher, once through the relaxed grammar's own matcher beneath it. Both the mask and
``accept`` are timed per token; the table gives their percentiles side by side, and the extra
time per token.

    cd /tmp && /work/main/.venv/bin/python /work/main/benchmarks/semantic_cost.py /work/shared/jsonschemabench
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from maskbench import make_backend, serialize  # noqa: E402


def walk(matcher, tokens: list[int], bitmask: torch.Tensor, masks: list[float], accepts: list[float]) -> bool:
    """Mask and accept each token in turn, timing both; True when every token went through."""
    for t in tokens:
        t0 = time.perf_counter_ns()
        matcher.fill_bitmask(bitmask, 0)
        t1 = time.perf_counter_ns()
        ok = matcher.accept(t)
        t2 = time.perf_counter_ns()
        masks.append((t1 - t0) / 1000.0)
        accepts.append((t2 - t1) / 1000.0)
        if not ok:
            return False
    return True


def main() -> None:
    """Run the walks and print a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="jsonschemabench files or directories")
    args = ap.parse_args()
    torch.set_num_threads(1)
    backend, tok, _, vocab = make_backend("llguidance")
    from radixlm.runtime.constrained.base import GrammarError, bitmask_width

    files = []
    for p in map(Path, args.paths):
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    bitmask = torch.zeros((1, bitmask_width(vocab)), dtype=torch.int32)
    times = {"checked mask": [], "checked accept": [], "grammar mask": [], "grammar accept": []}
    checked_files = walked = 0
    validations = 0
    for path in files:
        doc = json.loads(path.read_text())
        try:
            grammar = backend.compile("json_schema", json.dumps(doc["schema"]))
        except GrammarError:
            continue
        if getattr(grammar, "checks", None) is None:
            continue
        checked_files += 1
        for test in doc.get("tests", []):
            if not test.get("valid"):
                continue
            tokens = tok.encode(serialize(test["data"]), add_special_tokens=False)
            before = grammar.checks[0].validations
            walk(grammar.matcher(), tokens, bitmask, [], [])  # warm the grammar's states
            got: dict[str, list[float]] = {k: [] for k in times}
            if walk(grammar.matcher(), tokens, bitmask, got["checked mask"], got["checked accept"]) and walk(grammar.matcher().inner, tokens, bitmask, got["grammar mask"], got["grammar accept"]):
                for k in times:
                    times[k] += got[k]
                walked += 1
            validations += grammar.checks[0].validations - before
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"{checked_files} files carry semantic checks; {walked} valid instances walked; {len(times['checked mask'])} tokens; CPU capability {cpu}; {validations} jsonschema validations run (the rest answered from the cache)\n")
    print("| per token | p50 µs | p90 µs | p99 µs | mean µs |")
    print("|---|---:|---:|---:|---:|")
    for name, values in times.items():
        v = np.asarray(values)
        if len(v):
            print(f"| {name} | {np.percentile(v, 50):.1f} | {np.percentile(v, 90):.1f} | {np.percentile(v, 99):.1f} | {v.mean():.1f} |")
    n = min(len(times["checked mask"]), len(times["grammar mask"]))
    if n:
        extra = np.asarray(times["checked mask"][:n]) + np.asarray(times["checked accept"][:n]) - np.asarray(times["grammar mask"][:n]) - np.asarray(times["grammar accept"][:n])
        print(f"| extra (mask + accept) | {np.percentile(extra, 50):.1f} | {np.percentile(extra, 90):.1f} | {np.percentile(extra, 99):.1f} | {extra.mean():.1f} |")


if __name__ == "__main__":
    main()
