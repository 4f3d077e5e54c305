"""What weight quantization costs in quality, teacher-forced against fp32 on the same tokens.

Greedy runs part at the first near-tie and say little after it; here every form scores the same
token sequences (the workloads' prompts followed by fp32's own greedy continuation), and each
position compares the form's next-token prediction with fp32's: how often its top token is
fp32's, how far the log-probability of the actual next token moves, and the perplexity of the
continuations under each form.

    .venv/bin/python benchmarks/quant_quality.py [--forms int8 int4 int4_torch] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from report import emit  # noqa: E402
from weight_forms import weights_as  # noqa: E402
from workloads import chat_questions, extraction_prompts  # noqa: E402

import radixlm  # noqa: E402


def engine(form: str, threads: int) -> radixlm.Engine:
    """An engine with ``form`` weights (``int4_torch``: int4 on PyTorch's kernel, not ours)."""
    with weights_as(form) as quant:
        return radixlm.Engine(quantization=quant, num_threads=threads, disable_radix_cache=True)


def scored(eng: radixlm.Engine, seq: list[int]) -> list[tuple[float, int]]:
    """Per position after the first: (log-probability of the actual token, the top token)."""
    out = eng.generate(input_ids=seq, sampling_params={"max_new_tokens": 1, "temperature": 0}, return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
    meta = out["meta_info"]
    return [(lp[0], tops[0][1]) for lp, tops in zip(meta["input_token_logprobs"][1:], meta["input_top_logprobs"][1:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--forms", nargs="+", default=["int8", "int4", "int4_torch"], choices=["int8", "int4", "int4_torch", "int4_bf16", "auto"])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=64, help="fp32's greedy continuation scored after each prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    prompts = chat_questions(args.prompts // 2) + extraction_prompts(args.prompts - args.prompts // 2)
    with engine("fp32", args.threads) as eng:
        seqs = []
        for p in prompts:
            ids = eng.tokenizer(p).input_ids
            out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": args.tokens, "temperature": 0})
            seqs.append((len(ids), ids + out["output_ids"]))
        ref = [scored(eng, seq) for _, seq in seqs]
    rows = []
    for form in ["fp32", *args.forms]:
        if form == "fp32":
            got = ref
        else:
            with engine(form, args.threads) as eng:
                got = [scored(eng, seq) for _, seq in seqs]
        agree, shift, nll = [], [], []
        for (n_prompt, _), r, g in zip(seqs, ref, got):
            for i, ((lp_r, top_r), (lp_g, top_g)) in enumerate(zip(r, g)):
                agree.append(top_r == top_g)
                shift.append(abs(lp_g - lp_r))
                if i + 1 >= n_prompt:  # the continuation's tokens
                    nll.append(-lp_g)
        rows.append((form, 100 * statistics.mean(agree), statistics.mean(shift), math.exp(statistics.mean(nll)), len(agree)))
    lines = [
        f"Teacher-forced quality against fp32 ({len(seqs)} sequences: a workload prompt + fp32's {args.tokens} greedy tokens; "
        f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} threads).",
        "",
        "| weights | top-1 = fp32's | mean abs. change of the next token's log-prob | perplexity of the continuations | positions |",
        "|---|---:|---:|---:|---:|",
    ]
    for form, agree, shift, ppl, n in rows:
        lines.append(f"| {form} | {agree:.1f}% | {shift:.4f} | {ppl:.3f} | {n} |")
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
