"""A hybrid linear-attention model at its published shape: speed, and prefix reuse through state snapshots.

Two parts, both on random weights at Qwen3.5-0.8B's published text config (24 layers, three Gated
DeltaNet layers to one gated full-attention layer), built by transformers' own class:

1. **Speed** (``--speed``): ``benchmarks/families.py --families qwen3_5``: prefill, batch-1 and
   batch-32 decode tok/s of radixlm against transformers and llama.cpp's ``llama-server`` on the
   same GGUF file (llama.cpp's converter), in one run; written to ``results/hybrid_speed.md``.
2. **Shared-prefix chat** (always): ``--conversations`` conversations that share one system prompt,
   each ``--turns`` turns long (the user's message, then a greedy reply; the next turn's prompt is
   the whole conversation so far). All conversations' turn ``t`` are sent together. Measured:
   the **cached share** (prompt tokens served from the radix cache over all prompt tokens) and the
   mean time to first token, for the hybrid model with its state snapshots, the same model with
   the radix cache off (what it gets without snapshots: nothing is reusable), and a pure-attention
   model of similar size (Qwen3-0.6B's shape) on the same token ids. The aim (issue 40): the
   hybrid's cached share within 10 points of the pure-attention model's.

    cd /tmp && /work/main/.venv/bin/python /work/main/benchmarks/hybrid.py [--speed] [--quick] \\
        [--conversations 8] [--turns 4] [--threads N] [--out /work/main/benchmarks/results/hybrid.md]

Run it from outside the repository (``./kernels`` shadows a package transformers probes for).
Model folders go under ``~/.cache/radixlm/peers/hybrid`` and are kept between runs.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import families  # noqa: E402
from report import machine  # noqa: E402

WORK = families.PEERS_DIR / "hybrid"
DEFAULT_OUT = Path(__file__).parent / "results" / "hybrid.md"
MODES = {
    # name: (model family, engine options)
    "hybrid, snapshots": ("qwen3_5", {}),
    "hybrid, no prefix cache": ("qwen3_5", {"disable_radix_cache": True}),
    "pure attention (Qwen3-0.6B shape)": ("qwen3", {}),
}


def chat(path: str, options: dict, conversations: int, turns: int, system_len: int, user_len: int, reply_len: int, threads: int) -> dict:
    """The shared-prefix chat workload on one engine: cached share, TTFT, wall time (a child process)."""
    import radixlm

    rng = random.Random(0)
    vocab = families.TOKENIZER_VOCAB

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system = ids(system_len)
    history = [list(system) for _ in range(conversations)]
    engine = radixlm.Engine(model_path=path, num_threads=threads, max_total_tokens=1 << 16, **options)
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": reply_len}
    prompt_tokens = cached = 0
    ttfts: list[float] = []
    per_turn: list[float] = []
    start = time.perf_counter()
    try:
        for _ in range(turns):
            prompts = [h + ids(user_len) for h in history]
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            turn_tokens = sum(len(p) for p in prompts)
            turn_cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
            prompt_tokens += turn_tokens
            cached += turn_cached
            per_turn.append(turn_cached / turn_tokens)
            ttfts.extend(o["meta_info"]["ttft"] for o in outs)
            history = [p + o["output_ids"] for p, o in zip(prompts, outs)]
        wall = time.perf_counter() - start
    finally:
        engine.shutdown()
    return {
        "cached_share": cached / prompt_tokens,
        "per_turn": per_turn,
        "ttft_mean": sum(ttfts) / len(ttfts),
        "ttft_max": max(ttfts),
        "wall": wall,
        "prompt_tokens": prompt_tokens,
    }


CHILDREN = {"chat": chat}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speed", action="store_true", help="also run families.py's speed comparison for qwen3_5 (long: builds GGUF, runs llama.cpp)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: checks the script end to end")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=256, help="shared system prompt tokens")
    ap.add_argument("--user", type=int, default=24, help="tokens of each user message")
    ap.add_argument("--reply", type=int, default=24, help="tokens of each reply")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-args", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        families.run_child(CHILDREN, args.child, args.child_args)
        return
    if args.speed:
        speed_out = Path(args.out).with_name("hybrid_speed.md")
        cmd = [sys.executable, str(Path(families.__file__).resolve()), "--families", "qwen3_5", "--threads", str(args.threads), "--out", str(speed_out)]
        subprocess.run(cmd + (["--quick"] if args.quick else []), cwd=families.PEERS_DIR, check=False)
    WORK.mkdir(parents=True, exist_ok=True)
    folders: dict[str, str] = {}
    shapes: list[str] = []
    for family in sorted({f for f, _ in MODES.values()}):
        folder = WORK / ("quick" if args.quick else "full") / family
        if not (folder / "config.json").is_file():
            built = families.child("build", 3600, family=family, quick=args.quick, folder=str(folder), threads=args.threads)
            shapes.append(f"| {family} | {families.FAMILIES[family].model} | {built['layers']} | {families._count(built['params'])} |")
        else:
            shapes.append(f"| {family} | {families.FAMILIES[family].model} | (built earlier) | - |")
        folders[family] = str(folder)
    work = dict(conversations=args.conversations, turns=args.turns, system_len=args.system, user_len=args.user, reply_len=args.reply, threads=args.threads)
    rows, results = [], {}
    for name, (family, options) in MODES.items():
        try:
            r = families.child("chat", 7200, script=__file__, path=folders[family], options=options, **work)
        except Exception as e:  # noqa: BLE001 - a failure is a result: written into its row
            rows.append(f"| {name} | failed: {e} | - | - | - | - |")
            continue
        results[name] = r
        turns = " / ".join(f"{100 * x:.0f}" for x in r["per_turn"])
        rows.append(f"| {name} | {100 * r['cached_share']:.1f}% | {turns} | {1000 * r['ttft_mean']:.0f} | {1000 * r['ttft_max']:.0f} | {r['wall']:.1f} |")
        print(rows[-1], flush=True)
    hybrid, pure = results.get("hybrid, snapshots"), results.get("pure attention (Qwen3-0.6B shape)")
    aim = "-"
    if hybrid and pure:
        gap = 100 * (pure["cached_share"] - hybrid["cached_share"])
        aim = f"{gap:.1f} points below the pure-attention model: aim (within 10) {'met' if gap <= 10 else 'not met'}"
    text = [
        "# Hybrid linear attention: prefix reuse through state snapshots",
        "",
        *(["**Quick check only (`--quick`): tiny shapes; the figures say nothing about the real model.**", ""] if args.quick else []),
        f"Machine: {machine()}; {args.threads} threads. Command: `{' '.join(sys.argv)}`",
        "",
        f"Workload: {args.conversations} conversations sharing one {args.system}-token system prompt, {args.turns} turns each "
        f"({args.user}-token user message, {args.reply}-token greedy reply; each turn's prompt is the whole conversation so far); "
        "every conversation's turn t is sent at once. Token ids drawn at random, the same for every row.",
        "",
        "| model | built from | layers | parameters |",
        "|---|---|---:|---:|",
        *shapes,
        "",
        "| engine | cached share of prompt tokens | per turn (%) | mean TTFT ms | max TTFT ms | wall s |",
        "|---|---:|---|---:|---:|---:|",
        *rows,
        "",
        f"Hybrid with snapshots: {aim}.",
        "",
        "Where the hybrid model's snapshots come from (docs/architecture.md, \"Hybrid models: state snapshots in the tree\"):",
        "turn 1's first request snapshots its own prompt; the next finds the system prompt's KV but no snapshot at the",
        "branch point, recomputes it and leaves one there during its prompt pass (so turn 1 shares less than with pure",
        "attention); every later turn resumes from the snapshot taken when the previous turn's request finished.",
        "Both models run from their HF folders in radixlm's default dtype.",
        "",
    ]
    if args.speed:
        text += [f"Speed against transformers and llama.cpp: `{Path(args.out).with_name('hybrid_speed.md').name}`.", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(text))


if __name__ == "__main__":
    main()
