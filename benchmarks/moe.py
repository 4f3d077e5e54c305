"""A mixture-of-experts model at a published shape: batch-1 decode against llama.cpp and the bandwidth bound.

Random weights at Qwen3-30B-A3B's published config (128 experts, 8 chosen per token and layer,
expert width 768, hidden 2048, 32 query and 4 KV heads of 128), built by transformers' own class
with its 48 layers cut to ``--layers`` (default: ``families.py``'s 4, so the fp32 folder that
transformers reads stays ~12 GB), converted by llama.cpp's converter to f16 and quantized by
``llama-quantize`` to Q4_K_M: int4 experts (Q4_K, with Q6_K where llama.cpp's mix puts it). In one
run, one system after another:

- prefill, batch-1 and batch-``--batch`` decode tok/s of radixlm on the Q4_K_M file, llama-server
  on the same file, and transformers (fp32) on the HF folder (``families.py``'s measurements:
  batch 1 is 128 new tokens from an 8-token prompt, best of 3, greedy; for the aim, also 7 batch-1
  decodes alternated with llama-server's on the same file, as ``families.py`` pairs them);
- the **bytes of weights one token reads**, from the file's tensors: every tensor but the token
  embeddings (one row of it is read) and the routed experts, plus k / E of the routed experts'
  tensors; against the **dense model of the same total size**, which reads all of them;
- the machine's **read bandwidth** (``--threads`` threads summing a 2 GiB buffer, best of 5, in a
  fresh process) and the batch-1 speed it bounds: bandwidth / bytes per token.

The aims (issue 36): radixlm's batch-1 decode at least llama.cpp's, and at least 70% of the
bandwidth bound of the bytes an MoE token reads.

    cd /tmp && /work/main/.venv/bin/python /work/main/benchmarks/moe.py [--quick] [--layers 4] \\
        [--threads N] [--out /work/main/benchmarks/results/moe.md]

``--quick`` runs tiny shapes (8 experts, 2 chosen, Q8_0 from the converter) to check the script
end to end. Run it from outside the repository (``./kernels`` shadows a package transformers
probes for). The model folder and files go under ``~/.cache/radixlm/peers/moe`` and are kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import families  # noqa: E402
from checkpoints import quantize  # noqa: E402
from peers.servers import LLAMA_SERVER  # noqa: E402
from report import machine  # noqa: E402

WORK = families.PEERS_DIR / "moe"
DEFAULT_OUT = Path(__file__).parent / "results" / "moe.md"
FAMILY = "qwen3_moe"
ROUTED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # llama.cpp's merged routed-expert tensors


def bandwidth(threads: int) -> dict:
    """Bytes a second ``threads`` threads read summing a 2 GiB float32 buffer (best of 5; a child)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(2**29)  # 2 GiB, written once so its pages exist
    x.sum()
    return {"bytes_per_s": x.nbytes / families.best_of(5, x.sum)}



@dataclasses.dataclass(frozen=True)
class TokenBytes:
    """Bytes of weights a decode step reads per token, from a GGUF file's tensors."""

    moe: int  # what one token of the MoE reads: all but the embeddings and the unchosen experts
    dense: int  # what a dense model of the same total size reads: all but the embeddings
    routed: int  # the routed experts' tensors, all of them
    chosen: int  # experts chosen per token and layer (k)
    experts: int  # routed experts per layer (E)


def token_bytes(path: Path) -> TokenBytes:
    """The bytes per token of the file at ``path`` (llama.cpp's tensor names)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(suffix: str) -> int:
        key = next(k for k in reader.fields if k.endswith(suffix))
        f = reader.fields[key]
        return int(f.parts[f.data[0]][0])

    k, e = field(".expert_used_count"), field(".expert_count")
    routed = embed = total = 0
    for t in reader.tensors:
        total += int(t.n_bytes)
        if t.name == "token_embd.weight":
            embed += int(t.n_bytes)
        elif t.name.split(".")[-2] in ROUTED:
            routed += int(t.n_bytes)
    dense = total - embed
    return TokenBytes(moe=dense - routed + routed * k // e, dense=dense, routed=routed, chosen=k, experts=e)


def model_files(args: argparse.Namespace) -> tuple[Path, Path, dict]:
    """The HF folder and the GGUF file measured (built once, kept), and the build's figures."""
    folder = WORK / ("quick" if args.quick else f"layers{args.layers}")
    hf = folder / "hf"
    built = folder / "built.json"
    if not built.is_file():
        result = families.child("build", 7200, script=__file__, family=FAMILY, quick=args.quick, folder=str(hf), threads=args.threads, layers=args.layers)
        built.write_text(json.dumps(result))
    result = json.loads(built.read_text())
    if args.quick:
        gguf = folder / f"{FAMILY}.q8_0.gguf"
        if not gguf.is_file():
            families.convert(hf, gguf, "q8_0", FAMILY)
    else:
        gguf, f16 = folder / f"{FAMILY}.Q4_K_M.gguf", folder / f"{FAMILY}.f16.gguf"
        if not gguf.is_file():
            if not f16.is_file():
                families.convert(hf, f16, "f16", FAMILY)
            quantize(f16, gguf, "Q4_K_M")
            f16.unlink()  # 2 bytes a weight: not needed once quantized
    os.sync()
    return hf, gguf, result


def build(family: str, quick: bool, folder: str, threads: int, layers: int) -> dict:
    """``families.build`` with the layer count of this run (a child)."""
    fam = families.FAMILIES[family]
    families.FAMILIES[family] = dataclasses.replace(fam, layers=layers)
    return families.build(family, quick, folder, threads)


CHILDREN = {**families.CHILDREN, "bandwidth": bandwidth, "build": build}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes: checks the script end to end")
    ap.add_argument("--layers", type=int, default=families.FAMILIES[FAMILY].layers, help="layers kept of the published 48")
    ap.add_argument("--batch", type=int, default=8, help="the batched decode's concurrent requests")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-args", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        families.run_child(CHILDREN, args.child, args.child_args)
        return
    WORK.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    hf, gguf, built = model_files(args)
    work = families.Workload(prefill=64, new_tokens=16, batch=args.batch) if args.quick else families.Workload(prefill=256, batch=args.batch)
    wl = dataclasses.asdict(work)
    tb = token_bytes(gguf)
    bw = families.child("bandwidth", 600, script=__file__, threads=args.threads)["bytes_per_s"]
    results: dict[str, dict | str] = {}

    def attempt(name: str, fn, *a, **kw) -> None:
        try:
            results[name] = fn(*a, **kw)
        except Exception as e:  # noqa: BLE001 - a failure is a result: written into its row
            results[name] = str(e) or type(e).__name__
        print(name, results[name], flush=True)

    peer = LLAMA_SERVER.is_file()  # batch 1 also alternated with llama-server on the same file, for the aim
    attempt("radixlm", families.child, "radixlm", 3600, script=__file__, path=str(gguf), tokenizer=str(hf), threads=args.threads, work=wl, peer=peer)
    if LLAMA_SERVER.is_file():
        attempt("llama.cpp", families.measure_llama_cpp, gguf, args.threads, wl)
    attempt("transformers", families.child, "transformers", 7200, script=__file__, folder=str(hf), dtype="float32", threads=args.threads, work=wl)
    write_report(args, work, hf, gguf, built, tb, bw, results, time.perf_counter() - start)


def write_report(args: argparse.Namespace, work: families.Workload, hf: Path, gguf: Path, built: dict, tb: TokenBytes, bw: float, results: dict, seconds: float) -> None:
    """The results file."""
    fam = families.FAMILIES[FAMILY]
    size = gguf.stat().st_size
    bound = bw / tb.moe
    ours, theirs = results.get("radixlm"), results.get("llama.cpp")
    rows = []
    for name, weights in (("radixlm", f"GGUF {gguf.name.split('.')[1]}"), ("llama.cpp", f"GGUF {gguf.name.split('.')[1]}"), ("transformers", "fp32 (HF folder)")):
        r = results.get(name, "not run")
        if isinstance(r, dict):
            rows.append(f"| {name} | {weights} | {r['prefill']:.1f} | {r['batch1']:.1f} | {r['batch1'] / bound:.0%} | {r['batch32']:.1f} | {r['rss'] / 2**30:.2f} |")
        else:
            rows.append(f"| {name} | {weights} | failed: {r} | - | - | - | - |")
    mine = ours["batch1"] if isinstance(ours, dict) else None
    paired = ours.get("pair_ratio") if isinstance(ours, dict) else None
    vs_peer = f"{ours['pair_ours']:.1f} / {ours['pair_theirs']:.1f} ({paired:.2f})" if paired is not None else "-"
    unpaired = f"{mine / theirs['batch1']:.2f}" if mine and isinstance(theirs, dict) else "-"
    of_bound = f"{mine / bound:.0%}" if mine else "-"
    met = "n/a" if not mine or paired is None else ("yes" if paired >= 1 and mine >= 0.7 * bound else "no")
    quick = ["**Quick check only (`--quick`): tiny shapes; its speeds say nothing about the real shape.**", ""] if args.quick else []
    text = [
        "# Mixture of experts at a published shape: batch-1 decode, bytes per token, bandwidth bound",
        "",
        *quick,
        f"Machine: {machine()}; {args.threads} threads for every system; all measured one after another in one run ({seconds / 60:.1f} min).",
        f"Command: `{' '.join(sys.argv)}`",
        "",
        "## Model",
        "",
        f"- {fam.model}'s config (`{fam.config_class}`), random weights, {built['layers']} of {fam.config['num_hidden_layers']} layers: "
        f"{families._count(built['params'])} parameters ({built['fp32_bytes'] / 1e9:.3g} GB in fp32).",
        f"- Measured file: `{gguf.name}`, {size / 2**20:.0f} MiB (llama.cpp's converter, then `llama-quantize`)." if not args.quick
        else f"- Measured file: `{gguf.name}`, {size / 2**20:.1f} MiB (llama.cpp's converter).",
        f"- Routed experts: {tb.experts} a layer, {tb.chosen} chosen per token; their tensors {tb.routed / 2**20:.0f} MiB of the file.",
        "",
        "## Bytes of weights per token and the bandwidth bound",
        "",
        "| | bytes per token MiB | bound at the measured bandwidth, tok/s |",
        "|---|---:|---:|",
        f"| this MoE (all but the embeddings, {tb.chosen}/{tb.experts} of the routed experts) | {tb.moe / 2**20:.1f} | {bw / tb.moe:.1f} |",
        f"| a dense model of the same total size (all but the embeddings) | {tb.dense / 2**20:.1f} | {bw / tb.dense:.1f} |",
        "",
        f"Read bandwidth: {bw / 1e9:.1f} GB/s ({args.threads} threads summing a 2 GiB float32 buffer, best of 5). "
        f"The MoE token reads {tb.dense / tb.moe:.2f}x fewer bytes than the dense one.",
        "",
        "## Speed",
        "",
        f"| system | weights | prefill tok/s ({work.prefill} tokens) | batch-1 tok/s | batch-1 / bound | batch-{work.batch} tok/s | peak RSS GiB |",
        "|---|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "## Aims (issue 36)",
        "",
        "| batch 1 paired: radixlm / llama.cpp tok/s (median ratio), same file, aim >= 1 | batch 1: rows above | batch 1: radixlm / bandwidth bound, aim >= 70% | aims met |",
        "|---:|---:|---:|---|",
        f"| {vs_peer} | {unpaired} | {of_bound} | {met} |",
        "",
        "## Notes",
        "",
        f"- Workload: prefill = one {work.prefill}-token prompt, 1 new token (best of 2); batch 1 = {work.new_tokens} new tokens from an "
        f"8-token prompt (best of {families.BATCH1_RUNS}); batch {work.batch} = {work.batch} prompts of 6-9 tokens at once, {work.new_tokens} new tokens each.",
        "  Greedy, EOS ignored, tok/s from wall time; radixlm in-process (`Engine.generate`), llama-server over HTTP "
        f"(`-t {args.threads} -tb {args.threads} --parallel {work.batch}`), transformers with `generate`.",
        "- The bound counts weights only: the KV cache, activations and the per-step work of routing are on top of it,",
        "  so no system reaches 100%.",
        "- The rows run one system after another. The batch-1 aim against llama.cpp is paired: in radixlm's process, llama-server",
        f"  is started on the same file and {families.PAIRS} batch-1 decodes of each alternate (the same tokens, wall time); the aim is the",
        "  median of the pairs' ratios, which a shared machine's drift from minute to minute moves far less than the rows' ratio.",
        "- radixlm decodes the file in its fused C++ decode stack (every layer of a step in one call, the router and the",
        "  routed experts included), so the Python per-layer cost that the 44 layers cut here would multiply is not paid.",
        "",
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(text))
    print(out.read_text())


if __name__ == "__main__":
    main()
