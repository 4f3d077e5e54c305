"""Per-split table of maskbench.py outputs, side by side (e.g. before and after a change).

    .venv/bin/python benchmarks/maskbench_splits.py LABEL=RUN.jsonl [LABEL=RUN.jsonl ...]

Splits are the file-name prefixes of jsonschemabench (``Github_easy---...``, ``BFCL_...``).
Prints one Markdown table: per split and per run, files, compiled, passing, invalid instances
accepted, and invalid-only-by-an-ignored-format instances accepted (older runs lack that field).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def split_of(path: str) -> str:
    """The jsonschemabench split a file belongs to (its name's prefix)."""
    name = Path(path).name
    if "---" in name:
        return name.split("---")[0]
    return "BFCL" if name.startswith("BFCL") else name


def tally(path: Path) -> dict[str, dict[str, int]]:
    """Counts per split of one maskbench.py output."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "file" not in row:
            continue
        for split in (split_of(row["file"]), "Total"):
            t = out[split]
            t["files"] += 1
            t["compiled"] += bool(row["compiled"])
            right = row["valid_ok"] == row["valid_total"] and row["invalid_rejected"] + row.get("format_only_accepted", 0) == row["invalid_total"]
            t["passing"] += bool(row["compiled"] and row["error"] is None and right)
            if row["compiled"]:
                t["invalid_accepted"] += row["invalid_total"] - row["invalid_rejected"] - row.get("format_only_accepted", 0)
                t["format_only"] += row.get("format_only_accepted", 0)
    return out


def main(argv: list[str]) -> int:
    """Print the table for the runs named on the command line."""
    runs = [(a.split("=", 1)[0], tally(Path(a.split("=", 1)[1]))) for a in argv]
    if not runs:
        print(__doc__, file=sys.stderr)
        return 2
    splits = sorted({s for _, t in runs for s in t if s != "Total"}) + ["Total"]
    print("| split | run | files | compiled | passing | invalid accepted | invalid only by an ignored format, accepted |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for split in splits:
        for label, t in runs:
            c = t[split]
            n = c["files"] or 1
            print(f"| {split} | {label} | {c['files']:,} | {c['compiled']:,} ({100 * c['compiled'] / n:.1f}%) | {c['passing']:,} ({100 * c['passing'] / n:.1f}%) | {c['invalid_accepted']} | {c['format_only']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
