"""Where a decode step's time goes: matmuls, attention, sampling, scheduling, detokenization.

Runs the few-shot workload (shared ~420-token prefix) until every request decodes, then times
``--steps`` decode steps at the given batch sizes, splitting each step into: the model's linear
layers (matmuls, incl. the output head), attention (KV writes, gathers, softmax), the rest of the
forward (norms, RoPE, embeddings), token picking (sampling, masks, stop checks), detokenization,
and scheduling plus Python overhead (the remainder). A step the C++ decoder stack runs (a batch
of rows with no shared prefix, e.g. batch 1) has its layers in one call, timed as "decoder
stack" (matmuls and attention then count the output head and the attention metadata only);
``--no-decode-stack`` splits them as before.

    .venv/bin/python benchmarks/decode_profile.py [--batch 1 8 32] [--quantization int4]
        [--no-cascade] [--no-cpp-kernel] [--no-decode-stack] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from report import emit, machine  # noqa: E402
from workloads import few_shot_prompts  # noqa: E402

import radixlm.kernels.torch_decode as torch_decode  # noqa: E402
import radixlm.runtime.layers.activation as activation  # noqa: E402
import radixlm.runtime.layers.decode_stack as decode_stack  # noqa: E402
import radixlm.runtime.layers.norm as norm  # noqa: E402
import radixlm.runtime.layers.rope as rope  # noqa: E402
from radixlm.runtime.engine import build_parts  # noqa: E402
from radixlm.runtime.layers.quantized_linear import Int4Linear, Int8Linear  # noqa: E402
from radixlm.runtime.request import Req  # noqa: E402
from radixlm.runtime.sampling_params import SamplingParams  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402


class Clock:
    """Accumulates wall time of wrapped callables by category."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def wrap(self, category: str, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[category] = self.totals.get(category, 0.0) + time.perf_counter() - t

        return timed


def instrument(rt, clock: Clock) -> None:
    """Wrap the model's linear layers, the attention backend, the decoder and the detokenizer."""
    model = rt.runner.model
    for module in model.modules():
        if isinstance(module, (nn.Linear, Int8Linear, Int4Linear)) and module is not model.lm_head:
            module.forward = clock.wrap("matmul", module.forward)
    model.compute_logits = clock.wrap("matmul", model.compute_logits)  # the output head
    stacks = model.decode_stacks
    run_stack = stacks.run

    def stacked(*args):  # only the calls the stack takes count as its time
        t = time.perf_counter()
        out = run_stack(*args)
        if out is not None:
            clock.totals["stack"] = clock.totals.get("stack", 0.0) + time.perf_counter() - t
        return out

    stacks.run = stacked
    backend = rt.runner.attn_backend
    backend.forward = clock.wrap("attention", backend.forward)
    backend.init_forward_metadata = clock.wrap("attention", backend.init_forward_metadata)
    rt.runner.forward = clock.wrap("forward", rt.runner.forward)
    dec = rt.scheduler.decoder
    dec.process = clock.wrap("pick", dec.process)
    dec.outputs.update_text = clock.wrap("detokenize", dec.outputs.update_text)


def profile(batch: int, steps: int, args: argparse.Namespace) -> dict[str, float]:
    rt = build_parts(ServerArgs(max_total_tokens=60000, num_threads=args.threads, quantization=args.quantization, dtype=args.dtype, disable_decode_stack=args.no_decode_stack))
    tok = rt.tokenizer
    for i, p in enumerate(few_shot_prompts(batch)):
        rt.scheduler.add(Req(rid=str(i), input_ids=tok(p).input_ids, params=SamplingParams(max_new_tokens=steps + 64, temperature=0, ignore_eos=True), sink=lambda out: None))
    while rt.scheduler.waiting or any(not r.generating for r in rt.scheduler.running):
        rt.scheduler.step()
    for _ in range(3):
        rt.scheduler.step()
    clock = Clock()
    instrument(rt, clock)
    t = time.perf_counter()
    for _ in range(steps):
        rt.scheduler.step()
    total = (time.perf_counter() - t) / steps
    per = {k: v / steps for k, v in clock.totals.items()}
    matmul, attention, forward = per.get("matmul", 0), per.get("attention", 0), per.get("forward", 0)
    pick, detok, stack = per.get("pick", 0), per.get("detokenize", 0), per.get("stack", 0)
    return {
        "step": total,
        "decoder stack": stack,
        "matmuls": matmul,
        "attention": attention,
        "other forward": forward - matmul - attention - stack,
        "sampling & stop checks": pick - detok,
        "detokenize": detok,
        "scheduling & Python": total - forward - pick,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-cascade", action="store_true", help="Disable the shared-prefix decode attention (the 'before' path).")
    ap.add_argument("--no-cpp-kernel", action="store_true", help="Use the PyTorch code instead of the C++ CPU kernels (attention, norms, SiLU, RoPE).")
    ap.add_argument("--no-decode-stack", action="store_true", help="Run decode steps through the Python layers (--disable-decode-stack).")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.no_cascade:
        torch_decode.MIN_SHARED_PREFIX = 1 << 30
    if args.no_cpp_kernel:
        for module in (torch_decode, norm, activation, rope, decode_stack):
            module.cpu_kernels = lambda: None
    rows = {b: profile(b, args.steps, args) for b in args.batch}
    keys = ["decoder stack", "matmuls", "attention", "other forward", "sampling & stop checks", "detokenize", "scheduling & Python"]
    label = f"dtype {args.dtype}, weights {args.quantization or 'unquantized'}, cascade {'off' if args.no_cascade else 'on'}, C++ kernels {'off' if args.no_cpp_kernel else 'on'}, decoder stack {'off' if args.no_decode_stack else 'on'}, {torch.get_num_threads()} threads, {machine()}"
    lines = [f"Decode step breakdown ({label}); ms per step (share of the step).", "", "| batch | step (ms) | output tok/s | " + " | ".join(keys) + " |", "|---:|---:|---:|" + "---:|" * len(keys)]
    for b, r in rows.items():
        cells = [f"{1e3 * r[k]:.1f} ({100 * r[k] / r['step']:.0f}%)" for k in keys]
        lines.append(f"| {b} | {1e3 * r['step']:.1f} | {b / r['step']:.1f} | " + " | ".join(cells) + " |")
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
