"""Where the slow grammar masks are: each mask of a maskbench walk with how many tokens it allows
and the text before it, the slowest listed, the slow ones (over 100 µs) counted by how much of
the vocabulary they allow.

    .venv/bin/python benchmarks/mask_tail.py [--glob 'Github_easy---*'] [--files 200] [--warm]

``--warm`` walks each instance once untimed on the same compiled grammar first, as a server
whose grammar cache already holds the schema would see it: what is left of the tail then is
not the first visit of a grammar state.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import maskbench  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "shared" / "jsonschemabench"


def walk_masks(checker: maskbench.Checker, files: list[Path], warm: bool = False) -> list[tuple[float, int, str, str]]:
    """(µs, tokens allowed, file, text before) of every mask on the files' instance walks
    (``warm``: each walked once untimed first)."""
    out = []
    for path in files:
        doc = json.loads(path.read_text())
        try:
            compiled = checker.backend.compile("json_schema", json.dumps(doc["schema"]))
        except Exception:
            continue
        for test in doc.get("tests", []):
            tokens = checker.tok.encode(maskbench.serialize(test["data"]), add_special_tokens=False)
            if warm:
                checker.walk(compiled, maskbench.serialize(test["data"]), [])
            m = compiled.matcher()
            for i, t in enumerate(tokens):
                times: list[float] = []
                checker.fill(m, times)
                allowed = int(np.unpackbits(checker.bits.view(np.uint8)).sum())
                out.append((times[0], allowed, path.name, checker.tok.decode(tokens[max(0, i - 6) : i])))
                if not checker.allowed(t) or not m.accept(t):
                    break
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--glob", default="Github_easy---*")
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--warm", action="store_true", help="walk each instance once untimed first")
    args = ap.parse_args(argv)
    checker = maskbench.Checker("llguidance")
    vocab = checker.bitmask.shape[1] * 32
    masks = walk_masks(checker, sorted(BENCH.glob(args.glob))[: args.files], args.warm)
    times = np.array([m[0] for m in masks])
    print(f"{len(masks):,} masks: p50 {np.percentile(times, 50):.1f} µs, p99 {np.percentile(times, 99):.1f} µs, over 100 µs {np.mean(times > 100) * 100:.1f}%")
    slow = [m for m in masks if m[0] > 100]
    for lo, hi in ((0.0, 0.01), (0.01, 0.5), (0.5, 0.9), (0.9, 1.01)):
        n = sum(1 for m in slow if lo <= m[1] / vocab < hi)
        print(f"slow masks allowing {lo:.0%}-{min(hi, 1):.0%} of the vocabulary: {n} ({n / max(len(slow), 1):.0%})")
    for us, allowed, name, before in sorted(slow, reverse=True)[:12]:
        print(f"{us:8.0f} µs  {allowed:6d} allowed  {name[:34]:34}  after {before!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
