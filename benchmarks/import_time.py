"""How long ``import radixlm`` takes, and a program that only talks to a server, side by side with an older revision.

    .venv/bin/python benchmarks/import_time.py --compare-rev 5f5fdd8 --out benchmarks/results/import_time.md

Each round runs, in fresh interpreters and alternating between the two trees: ``python -X
importtime -c "import radixlm"`` (the total it reports) and the wall time of a whole program that
imports radixlm and opens a ``RuntimeEndpoint`` (no server needed: the endpoint connects lazily).
The older revision is checked out into a temporary git worktree and imported from there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from report import write

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = "import radixlm; radixlm.RuntimeEndpoint('http://127.0.0.1:9')"


def _env(package_parent: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if package_parent is not None:
        env["PYTHONPATH"] = str(package_parent)  # beats the editable install's finder
    return env


def _import_seconds(env: dict[str, str]) -> float:
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", "import radixlm"], env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, check=True).stderr
    return int(err.strip().splitlines()[-1].split("|")[1]) / 1e6


def _program_seconds(env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", PROGRAM], env=env, cwd=tempfile.gettempdir(), check=True, capture_output=True)
    return time.perf_counter() - start


def _loads(env: dict[str, str], module: str) -> bool:
    code = f"import sys, radixlm; print({module!r} in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, check=True).stdout.strip() == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare-rev", default=None, help="a git revision to measure side by side")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    trees: dict[str, dict[str, str]] = {"this tree": _env(None)}
    scratch = tempfile.TemporaryDirectory(prefix="radixlm-import-")
    if args.compare_rev:
        old = Path(scratch.name) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.compare_rev], check=True, capture_output=True)
        (Path(scratch.name) / "pkg").mkdir()
        (Path(scratch.name) / "pkg" / "radixlm").symlink_to(old)
        trees = {args.compare_rev: _env(Path(scratch.name) / "pkg"), **trees}
    try:
        samples = {name: {"import": [], "program": []} for name in trees}
        for _ in range(args.rounds):
            for name, env in trees.items():
                samples[name]["import"].append(_import_seconds(env))
                samples[name]["program"].append(_program_seconds(env))
        rows = []
        for name, env in trees.items():
            s = samples[name]
            loaded = ", ".join(m for m in ("torch", "transformers", "pydantic") if _loads(env, m)) or "none of them"
            rows.append(f"| {name} | {statistics.median(s['import']):.2f} ({min(s['import']):.2f}–{max(s['import']):.2f}) | {statistics.median(s['program']):.2f} ({min(s['program']):.2f}–{max(s['program']):.2f}) | {loaded} |")
    finally:
        if args.compare_rev:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(scratch.name) / "tree")], check=False, capture_output=True)
        scratch.cleanup()
    text = "\n".join([
        "# `import radixlm`",
        "",
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}; "
        f"{args.rounds} rounds, the trees alternating; median (min–max) seconds.",
        "",
        "| tree | `-X importtime` total | program: import + `RuntimeEndpoint` (wall) | loads torch / transformers / pydantic |",
        "|---|---:|---:|---|",
        *rows,
    ])
    write(text + "\n", args.out)


if __name__ == "__main__":
    main()
