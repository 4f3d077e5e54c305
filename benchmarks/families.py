"""Model families at published shapes with random weights: radixlm against transformers and llama.cpp.

For each family (Qwen3-0.6B, Gemma-3-1B-it text, Gemma-2-2B, Phi-3-mini-4k, SmolLM3-3B,
Mistral-7B-v0.1) the published config.json values, with ``num_hidden_layers`` cut where the fp32
weights would pass ~3 GB (said in the results file), are built by transformers' own classes with
random weights and a small SentencePiece tokenizer (ids 0-399; every model's vocab is larger, the
rest are padding tokens) and saved as a Hugging Face folder. llama.cpp's ``convert_hf_to_gguf.py``
turns the folder into GGUF (``q8_0``; ``--gguf-types q8_0,f16`` adds f16), and THE SAME file is
served by radixlm (natively: Q8_0 runs in its C++ kernels) and by llama.cpp's ``llama-server``
(``--parallel 32``, concurrent HTTP requests), with the same threads. transformers runs the folder
in fp32 (and bf16 where the CPU has AVX512-BF16); radixlm also runs the folder in its default
dtype, for reference. Each system runs in a fresh process, one after another, and is measured on:

- prefill tok/s: one 512-token prompt, 1 new token (wall time; best of 2 after a warm-up);
- decode tok/s at batch 1: 128 new tokens from an 8-token prompt (greedy, ignore EOS), wall time,
  best of 3 (one run of a 2-core machine swings by 20% where a neighbour wakes);
- decode tok/s at batch 32: 32 prompts of 6-9 tokens (left-padded for transformers' static batch
  ``generate``) at once, 128 new tokens each, 32 * 128 / wall time;
- peak resident memory of the process (llama-server: its VmHWM).

The aims (issue): batch 1 at least llama.cpp's speed, batch 32 at least 3x transformers' (fp32),
every family, in one run. A row is written to the results file as each system finishes, so a
partial run leaves results; a failure is written into its row and the run goes on.

    make bench-peers   # builds llama.cpp's llama-server once (~/.cache/radixlm/peers)
    cd /tmp && /work/main/.venv/bin/python /work/main/benchmarks/families.py \
        [--families qwen3,gemma3,gemma2,phi3,smollm3,mistral] [--threads N] [--gguf-types q8_0,f16] \
        [--keep] [--out /work/main/benchmarks/results/families.md]
    ... families.py --quick   # tiny shapes, few tokens: checks the script end to end in minutes

Run it from outside the repository (as above): from its root, ``./kernels`` shadows the package of
that name transformers probes for. Model folders and GGUF files go under
``~/.cache/radixlm/peers/families`` and are deleted after each family unless ``--keep``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from peers.servers import LLAMA_SERVER, PEERS_DIR, llama_server_on  # noqa: E402
from report import machine  # noqa: E402

LLAMA_CPP = PEERS_DIR / "llama.cpp"
CONVERTER = LLAMA_CPP / "convert_hf_to_gguf.py"
WORK = PEERS_DIR / "families"
DEFAULT_OUT = Path(__file__).parent / "results" / "families.md"
TOKENIZER_VOCAB = 400  # SentencePiece pieces; 0 <unk>, 1 <s>, 2 </s>
BATCH1_RUNS = 3  # batch-1 decode: best of this many runs, for every system
PAIRS = 7  # batch-1 decodes of radixlm and llama-server alternated on the same GGUF file, for the aim
SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _every(layers: int, step: int, hit, miss) -> list:
    """``hit`` for every ``step``-th layer (1-based), ``miss`` for the others."""
    return [hit if (i + 1) % step == 0 else miss for i in range(layers)]


@dataclass(frozen=True)
class Family:
    """A family at a published shape: its transformers config class and config.json values."""

    key: str
    model: str  # the published checkpoint whose config.json the values come from
    config_class: str
    config: dict
    layers: int | None = None  # layers kept in the full run (None: all) so fp32 weights stay ~3 GB
    quick: dict = field(default_factory=dict)  # overrides for --quick (tiny shapes)
    converter_args: tuple[str, ...] = ()  # extra flags llama.cpp's converter needs for this family
    bpe_pre: str | None = None  # answer the converter's BPE pre-tokenizer check with this (the benchmark's tokenizer is unknown to it)

    def kwargs(self, quick: bool) -> dict:
        """The config kwargs of the model built: published values, layer cut or quick overrides, derived fields."""
        kw = dict(self.config)
        if self.layers:
            kw["num_hidden_layers"] = self.layers
        if quick:
            kw.update(TINY, **self.quick)
        n = kw["num_hidden_layers"]
        if self.key == "gemma3":  # five sliding-window layers, then one global (llama.cpp fixes this pattern)
            kw["layer_types"] = _every(n, 6, "full_attention", "sliding_attention")
        elif self.key == "gemma2":
            kw["layer_types"] = _every(n, 2, "full_attention", "sliding_attention")
        elif self.key == "smollm3":  # every 4th layer without RoPE
            kw["no_rope_layers"] = _every(n, 4, 0, 1)
        elif self.key == "qwen3_5":  # three Gated DeltaNet layers, then one full-attention layer
            kw["layer_types"] = _every(n, 4, "full_attention", "linear_attention")
        return {**kw, **SPECIAL_IDS}


TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
GEMMA_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}

FAMILIES = {
    f.key: f
    for f in [
        Family("llama", "meta-llama/Llama-3.2-1B", "LlamaConfig", dict(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu",
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
        ), quick=dict(head_dim=16)),
        Family("qwen3", "Qwen/Qwen3-0.6B", "Qwen3Config", dict(
            vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, hidden_act="silu",
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, attention_bias=False, tie_word_embeddings=True,
        ), quick=dict(head_dim=16)),
        Family("gemma3", "google/gemma-3-1b-it", "Gemma3TextConfig", dict(
            vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512, max_position_embeddings=32768,
            rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", rope_parameters=GEMMA_ROPE,
            final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True,
        ), layers=12, quick=dict(num_hidden_layers=6, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=32)),
        Family("gemma2", "google/gemma-2-2b", "Gemma2Config", dict(
            vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
            num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0, max_position_embeddings=8192, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
        ), layers=2, quick=dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=32)),
        Family("phi3", "microsoft/Phi-3-mini-4k-instruct", "Phi3Config", dict(
            vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=32, max_position_embeddings=4096, original_max_position_embeddings=4096, rms_norm_eps=1e-5,
            hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=2047,
            tie_word_embeddings=False,
        ), layers=4, quick=dict(num_key_value_heads=4)),
        Family("smollm3", "HuggingFaceTB/SmolLM3-3B", "SmolLM3Config", dict(
            vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
            num_key_value_heads=4, max_position_embeddings=65536, rms_norm_eps=1e-6, hidden_act="silu",
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0}, no_rope_layer_interval=4,
            use_sliding_window=False, tie_word_embeddings=True,
        ), layers=6, quick=dict(num_hidden_layers=4)),
        Family("mistral", "mistralai/Mistral-7B-v0.1", "MistralConfig", dict(
            vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-5, hidden_act="silu",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=4096, tie_word_embeddings=False,
        ), layers=2, quick=dict(head_dim=16)),
        Family("qwen3_5", "Qwen/Qwen3.5-0.8B (text model)", "Qwen3_5TextConfig", dict(
            vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144, rms_norm_eps=1e-6,
            hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
            attention_bias=False, tie_word_embeddings=True,
        ), quick=dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
           converter_args=("--no-mtp",), bpe_pre="qwen2"),
        Family("qwen3_moe", "Qwen/Qwen3-30B-A3B", "Qwen3MoeConfig", dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
            hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, attention_bias=False,
            tie_word_embeddings=False,
        ), layers=4, quick=dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32), bpe_pre="qwen2"),
    ]
}  # fmt: skip
# Llama-3.2-1B is benchmarks/checkpoints.py's real-shaped model, Qwen3.5-0.8B benchmarks/hybrid.py's,
# Qwen3-30B-A3B benchmarks/moe.py's
DEFAULT_FAMILIES = [k for k in FAMILIES if k not in ("llama", "qwen3_5", "qwen3_moe")]


@dataclass(frozen=True)
class Workload:
    """Token counts of one run."""

    prefill: int = 512
    new_tokens: int = 128
    batch: int = 32

    def prompts(self) -> dict:
        """The prompts (token ids inside the tokenizer's vocab), the same for every system."""
        rng = random.Random(0)

        def ids(n: int) -> list[int]:
            return [rng.randrange(3, TOKENIZER_VOCAB) for _ in range(n)]

        return {"long": ids(self.prefill), "long_warm": ids(self.prefill), "short": ids(8), "batch": [ids(6 + i % 4) for i in range(self.batch)]}


# ---------------------------------------------------------------- building and converting (children)


def make_tokenizer(folder: Path) -> None:
    """A small trained SentencePiece BPE model (``tokenizer.model``, which llama.cpp's converter reads
    for every family here) and the same tokenizer as a transformers fast tokenizer (``tokenizer.json``)."""
    import io

    import sentencepiece as spm
    from transformers import LlamaTokenizer

    rng = random.Random(0)
    words = ["the", "of", "and", "model", "token", "cache", "radix", "prefix", "decode", "batch", "serve", "weight", "layer", "window", "rotary", "gate"]
    lines = [" ".join(rng.choice(words) + rng.choice(["", "s", "ed", "ing", "er"]) for _ in range(20)) for _ in range(3000)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=TOKENIZER_VOCAB, model_type="bpe", byte_fallback=True,
        hard_vocab_limit=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    vocab = {sp.IdToPiece(i): i for i in range(sp.vocab_size())}
    merges = sorted(
        ((p[:k], p[k:]) for p in vocab if not sp.IsControl(vocab[p]) for k in range(1, len(p)) if p[:k] in vocab and p[k:] in vocab),
        key=lambda m: (vocab[m[0] + m[1]], vocab[m[0]], vocab[m[1]]),
    )
    LlamaTokenizer(vocab=vocab, merges=merges).save_pretrained(str(folder))


def build(family: str, quick: bool, folder: str, threads: int) -> dict:
    """Save ``family``'s random-weight model (fp32 safetensors) and tokenizer into ``folder``."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out)
    fam = FAMILIES[family]
    cfg = getattr(transformers, fam.config_class)(**fam.kwargs(quick))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    std = 1.6 / cfg.hidden_size**0.5  # wide enough that greedy tokens vary from step to step
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
            elif name.endswith("bias"):
                p.normal_(0, 0.02)
            else:  # norms: Gemma's and Qwen3.5's store w for a (1 + w) scale (not Qwen3.5's gated output norm)
                offset = ("gemma" in family or family == "qwen3_5") and not name.endswith("linear_attn.norm.weight")
                p.normal_(0.0 if offset else 1.0, 0.1)
    model.save_pretrained(str(out))
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "fp32_bytes": 4 * params, "layers": cfg.num_hidden_layers}


# runs the converter with its BPE pre-tokenizer check answered (argv[1]: the answer, the rest: its arguments)
_CONVERT_WITH_PRE = (
    "import runpy, sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/gguf-py']; import conversion.base as base; "
    "base.TextModel.get_vocab_base_pre = lambda self, tokenizer, pre=sys.argv[2]: pre; "
    "sys.argv = [sys.argv[1] + '/convert_hf_to_gguf.py', *sys.argv[3:]]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def convert(folder: Path, out: Path, outtype: str, family: str | None = None) -> None:
    """llama.cpp's converter: the HF folder as a GGUF file of ``outtype``; raises with its last log lines."""
    fam = FAMILIES.get(family) if family else None
    args = [str(folder), "--outtype", outtype, "--outfile", str(out), *(fam.converter_args if fam else ())]
    if fam is not None and fam.bpe_pre:
        cmd = [sys.executable, "-c", _CONVERT_WITH_PRE, str(LLAMA_CPP), fam.bpe_pre, *args]
    else:
        cmd = [sys.executable, str(CONVERTER), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=PEERS_DIR)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(_last_error(proc.stderr + proc.stdout))


# ---------------------------------------------------------------- measuring (children)


def peak_rss() -> int:
    """This process's peak resident bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def best_of(n: int, fn) -> float:
    """The shortest of ``n`` timed calls of ``fn``, in seconds."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_radixlm(path: str, tokenizer: str, threads: int, work: dict, peer: bool = False) -> dict:
    """radixlm in-process on ``path`` (GGUF file or HF folder): prefill, batch-1 and batch-32 decode tok/s;
    with ``peer``, also ``PAIRS`` batch-1 decodes alternated with llama-server's on the same file."""
    import radixlm
    from radixlm.kernels.cpu_ext import cpu_kernels

    w, p = Workload(**work), Workload(**work).prompts()
    cpu_kernels()
    tokens = max(8192, w.batch * (w.new_tokens + 16) + w.prefill + 64)
    engine = radixlm.Engine(model_path=path, tokenizer_path=tokenizer, num_threads=threads, max_total_tokens=tokens, disable_radix_cache=True)
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": w.new_tokens}
    try:
        engine.generate(input_ids=p["long_warm"], sampling_params={**params, "max_new_tokens": 1})
        prefill = w.prefill / best_of(2, lambda: engine.generate(input_ids=p["long"], sampling_params={**params, "max_new_tokens": 1}))
        engine.generate(input_ids=p["short"], sampling_params={**params, "max_new_tokens": 4})
        runs: list[dict] = []
        batch1 = w.new_tokens / best_of(BATCH1_RUNS, lambda: runs.append(engine.generate(input_ids=p["short"], sampling_params=params)))
        out = runs[-1]
        assert len(out["output_ids"]) == w.new_tokens, len(out["output_ids"])
        engine.generate(input_ids=p["batch"], sampling_params={**params, "max_new_tokens": 4})
        start = time.perf_counter()
        outs = engine.generate(input_ids=p["batch"], sampling_params=params)
        batch32 = w.batch * w.new_tokens / (time.perf_counter() - start)
        assert all(len(o["output_ids"]) == w.new_tokens for o in outs)
        result = {"prefill": prefill, "batch1": batch1, "batch32": batch32, "rss": peak_rss(), "distinct": len(set(out["output_ids"]))}
        if peer:
            result.update(paired_batch1(engine, Path(path), threads, w))
    finally:
        engine.shutdown()
    return result


def paired_batch1(engine, path: Path, threads: int, w: Workload) -> dict:
    """Batch-1 decode speeds of ``engine`` and of llama-server on the same GGUF file, ``PAIRS`` of
    each alternated (wall time of 128 new tokens from the 8-token prompt, as the rows): both see
    the same neighbours, so their ratio holds where a shared machine's speed drifts by 20%."""
    import httpx

    short = w.prompts()["short"]
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": w.new_tokens}
    with llama_server_on(path, threads, slots=1, context=1024) as server, httpx.Client(timeout=3600) as client:
        post = _completion(client, server.base_url)
        post(short, 4)

        def timed(fn) -> float:
            start = time.perf_counter()
            fn()
            return w.new_tokens / (time.perf_counter() - start)

        pairs = [(timed(lambda: engine.generate(input_ids=short, sampling_params=params)), timed(lambda: post(short, w.new_tokens))) for _ in range(PAIRS)]
    return {"pair_ours": statistics.median(a for a, _ in pairs), "pair_theirs": statistics.median(b for _, b in pairs),
            "pair_ratio": statistics.median(a / b for a, b in pairs)}  # fmt: skip


def measure_transformers(folder: str, dtype: str, threads: int, work: dict) -> dict:
    """transformers on the HF folder in ``dtype``: one forward for prefill, ``generate`` (greedy) for decode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    w, p = Workload(**work), Workload(**work).prompts()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # never stop early (ignore EOS)

    def generate(prompts: list[list[int]], n: int) -> torch.Tensor:
        width = max(map(len, prompts))  # left padding, as batched generation wants
        ids = torch.tensor([[0] * (width - len(q)) + q for q in prompts])
        mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in prompts])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)
        assert out.shape[1] - width == n, (out.shape, width, n)
        return out[:, width:]

    with torch.inference_mode():
        model(torch.tensor([p["long_warm"]]))
        prefill = w.prefill / best_of(2, lambda: model(torch.tensor([p["long"]])))
        generate([p["short"]], 4)
        runs: list[torch.Tensor] = []
        batch1 = w.new_tokens / best_of(BATCH1_RUNS, lambda: runs.append(generate([p["short"]], w.new_tokens)))
        out = runs[-1]
        generate(p["batch"], 4)
        start = time.perf_counter()
        generate(p["batch"], w.new_tokens)
        batch32 = w.batch * w.new_tokens / (time.perf_counter() - start)
    return {"prefill": prefill, "batch1": batch1, "batch32": batch32, "rss": peak_rss(), "distinct": len(set(out[0].tolist()))}


def measure_llama_cpp(path: Path, threads: int, work: dict) -> dict:
    """llama-server on the GGUF file (``--parallel 32``): prefill, batch-1 and concurrent batch-32 decode tok/s."""
    import httpx

    w, p = Workload(**work), Workload(**work).prompts()
    per_slot = -(-(w.prefill + w.new_tokens + 64) // 256) * 256  # enough for the long prompt in any one slot
    with llama_server_on(path, threads, slots=w.batch, context=w.batch * per_slot) as server, httpx.Client(timeout=3600) as client:
        post = _completion(client, server.base_url)
        post(p["long_warm"], 1)
        prefill = w.prefill / best_of(2, lambda: post(p["long"], 1))
        post(p["short"], 4)
        runs: list[dict] = []
        batch1 = w.new_tokens / best_of(BATCH1_RUNS, lambda: runs.append(post(p["short"], w.new_tokens)))
        out = runs[-1]
        assert out["tokens_predicted"] == w.new_tokens, out["tokens_predicted"]
        with concurrent.futures.ThreadPoolExecutor(w.batch) as pool:
            list(pool.map(lambda q: post(q, 4), p["batch"]))
            start = time.perf_counter()
            outs = list(pool.map(lambda q: post(q, w.new_tokens), p["batch"]))
            batch32 = w.batch * w.new_tokens / (time.perf_counter() - start)
        assert all(o["tokens_predicted"] == w.new_tokens for o in outs)
        status = Path(f"/proc/{server.proc.pid}/status").read_text().splitlines()
        hwm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
    return {"prefill": prefill, "batch1": batch1, "batch32": batch32, "rss": hwm}


def _completion(client, base: str):
    """A function posting one greedy, EOS-ignoring ``/completion`` of token ids to llama-server; returns its JSON."""

    def post(prompt: list[int], n: int) -> dict:
        r = client.post(base + "/completion", json={"temperature": 0, "ignore_eos": True, "cache_prompt": False, "prompt": prompt, "n_predict": n})
        r.raise_for_status()
        return r.json()

    return post


CHILDREN = {"build": build, "radixlm": measure_radixlm, "transformers": measure_transformers}


# ---------------------------------------------------------------- the parent: running and reporting


def _last_error(text: str) -> str:
    """The line of a log or traceback that says what went wrong, shortened."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    hits = [line for line in lines if "Error" in line or "error" in line or "Exception" in line or "raise" in line.split(" ")[:1]]
    line = (hits or lines or ["(no output)"])[-1]
    return line if len(line) <= 300 else line[:297] + "..."


def child(kind: str, timeout: float, script: str = __file__, **kwargs) -> dict:
    """Run ``CHILDREN[kind](**kwargs)`` of ``script`` (this file, or a benchmark built on it) in a
    fresh process (cwd outside the repository); its JSON result."""
    cmd = [sys.executable, str(Path(script).resolve()), "--child", kind, "--child-args", json.dumps(kwargs)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=PEERS_DIR, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"timed out after {timeout:.0f} s") from e
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].startswith("{"):
        raise RuntimeError(_last_error(proc.stderr or proc.stdout))
    return json.loads(lines[-1])


def run_child(children: dict, kind: str, args_json: str) -> None:
    """In a child process: run ``children[kind]`` and print its JSON result (exit 1 on failure)."""
    try:
        result = children[kind](**json.loads(args_json))
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    print(json.dumps(result), flush=True)


def has_bf16() -> bool:
    """Whether the CPU reports AVX512-BF16 (or AMX-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass
class Report:
    """The results file, rewritten whole after every row."""

    args: argparse.Namespace
    work: Workload
    shapes: list[str] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def write(self, final: bool = False) -> None:
        """Write the markdown so far to ``--out``."""
        a, w = self.args, self.work
        title = "# Model families at published shapes: radixlm, transformers, llama.cpp"
        quick = [
            "**Quick check only (`--quick`): tiny shapes (hidden 64, 2-6 layers, vocab 512), few tokens. It shows the script",
            "runs end to end; its speeds say nothing about the real shapes. The real run is the command without `--quick`.**",
            "",
        ] if a.quick else []  # fmt: skip
        text = [
            title,
            "",
            *quick,
            f"Machine: {machine()}; {a.threads} threads for every system; all measured one after another in one run.",
            f"Command: `{' '.join(sys.argv)}`" + ("" if final else " (in progress: rows so far)"),
            f"Workload: prefill = one {w.prefill}-token prompt, 1 new token (best of 2); batch 1 = {w.new_tokens} new tokens from an 8-token prompt (best of {BATCH1_RUNS});",
            f"batch 32 = {w.batch} prompts of 6-9 tokens at once, {w.new_tokens} new tokens each. Greedy, EOS ignored; tok/s from wall time.",
            f"The batch-1 aim is paired: in radixlm's Q8_0 process, llama-server is started on the same file and {PAIRS} batch-1 decodes of each",
            "alternate (the same 128 tokens, wall time); the aim is the median of the pairs' ratios, which a neighbour's load moves far less than",
            "it moves two systems measured minutes apart (this machine's batch-1 speed swings by 20% between runs).",
            "",
            "## Shapes",
            "",
            "| family | published config | layers used / published | parameters | fp32 weights GB |",
            "|---|---|---:|---:|---:|",
            *self.shapes,
            "",
            "## Results",
            "",
            "| family | system | weights | prefill tok/s | batch-1 tok/s | batch-32 tok/s | peak RSS GiB |",
            "|---|---|---|---:|---:|---:|---:|",
            *self.rows,
            "",
            "## Aims (same run)",
            "",
            "| family | batch 1 paired: radixlm / llama.cpp tok/s (median ratio), same Q8_0 file, aim >= 1 | batch 1: rows above | batch 32: radixlm Q8_0 / transformers fp32, aim >= 3 | batch 32: radixlm fp32 / transformers fp32 | aims met |",
            "|---|---:|---:|---:|---:|---|",
            *self.summary,
            "",
            "## Notes",
            "",
            "- Random weights (transformers' own classes, normal init with std 1.6/sqrt(hidden), so greedy tokens vary); a 400-piece",
            "  SentencePiece tokenizer saved both as `tokenizer.model` (read by llama.cpp's converter) and `tokenizer.json`; each",
            "  model's vocab beyond it is padding. Prompts are token ids, so the tokenizer costs nothing in the figures.",
            "- GGUF files come from llama.cpp's own `convert_hf_to_gguf.py`; radixlm and llama-server serve the same file.",
            "  radixlm is given the HF folder's tokenizer (`tokenizer_path`); llama-server uses the GGUF's.",
            f"- llama-server: `-t {a.threads} -tb {a.threads} --parallel {w.batch}`, batch 32 as {w.batch} concurrent HTTP requests; radixlm",
            "  runs in-process (`Engine.generate`), transformers with `generate` on a static left-padded batch (default dynamic KV cache).",
            "- Mistral: llama.cpp's converter writes `MistralForCausalLM` as the `llama` architecture, dropping the sliding window",
            "  (4096, longer than any sequence here, so it changes nothing in these runs).",
            *[f"- {n}" for n in self.notes],
            "",
        ]
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(text))


def _count(n: int) -> str:
    """A parameter count in B, M or K."""
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M" if n >= 1e5 else f"{n / 1e3:.0f} K"


def fmt(result: dict | str, key: str, digits: int = 1) -> str:
    """A figure of a result, or nothing where it failed."""
    return f"{result[key]:.{digits}f}" if isinstance(result, dict) else "-"


def run_family(fam: Family, args: argparse.Namespace, report: Report) -> None:
    """Build, convert and measure one family, writing each row as it completes."""
    work, quick = report.work, args.quick
    label = f"{fam.model}" + (" (tiny)" if quick else "")
    folder = WORK / ("quick" if quick else "full") / fam.key
    hf = folder / "hf"
    wl = {"prefill": work.prefill, "new_tokens": work.new_tokens, "batch": work.batch}
    results: dict[str, dict | str] = {}

    def row(system: str, weights: str, result: dict | str, key: str | None = None) -> None:
        results[key or system] = result
        if isinstance(result, dict):
            cells = [fmt(result, "prefill"), fmt(result, "batch1"), fmt(result, "batch32"), f"{result['rss'] / 2**30:.2f}"]
        else:
            cells = [f"failed: {result}", "-", "-", "-"]
        report.rows.append(f"| {fam.key} | {system} | {weights} | " + " | ".join(cells) + " |")
        print(report.rows[-1], flush=True)
        report.write()

    def attempt(fn, *a, **kw) -> dict | str:
        try:
            return fn(*a, **kw)
        except Exception as e:  # noqa: BLE001 - a failure is a result: written into its row
            return str(e) or type(e).__name__

    start = time.perf_counter()
    shutil.rmtree(folder, ignore_errors=True)
    built = attempt(child, "build", 3600, family=fam.key, quick=quick, folder=str(hf), threads=args.threads)
    published = fam.config["num_hidden_layers"]
    if isinstance(built, str):
        report.shapes.append(f"| {fam.key} | {label} | - | - | build failed: {built} |")
        report.write()
        return
    report.shapes.append(f"| {fam.key} | {label} (`{fam.config_class}`) | {built['layers']} / {published} | {_count(built['params'])} | {built['fp32_bytes'] / 1e9:.3g} |")

    ggufs: dict[str, Path | str] = {}
    if fam.bpe_pre or fam.converter_args:
        report.notes.append(f"{fam.key}: llama.cpp's converter run with {' '.join(fam.converter_args) or 'no extra flags'}"
                            + (f", its BPE pre-tokenizer check answered `{fam.bpe_pre}` (the benchmark's tokenizer is unknown to it)" if fam.bpe_pre else "") + ".")
    for t in args.gguf_types:
        out = folder / f"{fam.key}.{t}.gguf"
        ggufs[t] = out if CONVERTER.is_file() else f"llama.cpp's converter not found at {CONVERTER}"
        if CONVERTER.is_file():
            err = attempt(convert, hf, out, t, fam.key)
            if isinstance(err, str):
                ggufs[t] = err
                report.notes.append(f"{fam.key}: llama.cpp's converter failed for {t}: {err}")
    os.sync()  # the files just written go to disk now, not while the first system is measured
    for t, g in ggufs.items():
        name = f"GGUF {t.upper()}"
        if isinstance(g, str):
            row("radixlm", name, f"no GGUF: {g}", key=f"radixlm {t}")
            continue
        size = g.stat().st_size / 2**20
        name += f" ({size:.0f} MiB)" if size >= 10 else f" ({size:.2f} MiB)"
        peer = t == "q8_0" and LLAMA_SERVER.is_file()  # the aim's file: batch 1 also paired with llama-server
        row("radixlm", name, attempt(child, "radixlm", 3600, path=str(g), tokenizer=str(hf), threads=args.threads, work=wl, peer=peer), key=f"radixlm {t}")
        if LLAMA_SERVER.is_file():
            row(f"llama.cpp {t}", name, attempt(measure_llama_cpp, g, args.threads, wl))
    row("radixlm (HF folder)", "fp32 (default dtype)", attempt(child, "radixlm", 3600, path=str(hf), tokenizer=str(hf), threads=args.threads, work=wl))
    row("transformers", "fp32", attempt(child, "transformers", 7200, folder=str(hf), dtype="float32", threads=args.threads, work=wl))
    if has_bf16():
        row("transformers bf16", "bf16", attempt(child, "transformers", 7200, folder=str(hf), dtype="bfloat16", threads=args.threads, work=wl))

    def ratio(a: str, b: str, key: str) -> tuple[str, float | None]:
        x, y = results.get(a), results.get(b)
        if not isinstance(x, dict) or not isinstance(y, dict):
            return "-", None
        return f"{x[key] / y[key]:.2f}", x[key] / y[key]

    b1u, _ = ratio("radixlm q8_0", "llama.cpp q8_0", "batch1") if "q8_0" in ggufs else ("-", None)
    ours = results.get("radixlm q8_0")
    r1 = ours["pair_ratio"] if isinstance(ours, dict) and "pair_ratio" in ours else None
    b1 = f"{ours['pair_ours']:.1f} / {ours['pair_theirs']:.1f} ({r1:.2f})" if r1 is not None else "-"
    b32, r32 = ratio("radixlm q8_0", "transformers", "batch32") if "q8_0" in ggufs else ("-", None)
    b32f, _ = ratio("radixlm (HF folder)", "transformers", "batch32")
    met = "n/a" if r1 is None or r32 is None else ("yes" if r1 >= 1 and r32 >= 3 else "no" + (" (batch 1)" if r1 < 1 else "") + (" (batch 32)" if r32 < 3 else ""))
    report.summary.append(f"| {fam.key} | {b1} | {b1u} | {b32} | {b32f} | {met} |")
    report.write()
    print(f"{fam.key}: {time.perf_counter() - start:.0f} s", flush=True)
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(DEFAULT_FAMILIES), help=f"comma-separated, of: {', '.join(FAMILIES)}")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few tokens: checks the script end to end")
    ap.add_argument("--gguf-types", default=None, help="llama.cpp converter --outtype values (default q8_0; q8_0,f16 with --quick)")
    ap.add_argument("--keep", action="store_true", help="keep the model folders and GGUF files (default: deleted after each family)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-args", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # a fresh process measuring one thing: its JSON result on the last line
        run_child(CHILDREN, args.child, args.child_args)
        return
    args.gguf_types = (args.gguf_types or ("q8_0,f16" if args.quick else "q8_0")).split(",")
    keys = args.families.split(",")
    unknown = [k for k in keys if k not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    WORK.mkdir(parents=True, exist_ok=True)
    report = Report(args, Workload(prefill=64, new_tokens=16) if args.quick else Workload())
    if not LLAMA_SERVER.is_file():
        report.notes.append(f"llama.cpp skipped: no llama-server at {LLAMA_SERVER} (build it with `make bench-peers`).")
        print(report.notes[-1], file=sys.stderr)
    if not CONVERTER.is_file():
        report.notes.append(f"No GGUF files: llama.cpp's converter is not at {CONVERTER} (`make bench-peers` fetches it).")
    if not has_bf16():
        report.notes.append("transformers bf16 not run: this CPU reports no AVX512-BF16.")
    start = time.perf_counter()
    for key in keys:
        run_family(FAMILIES[key], args, report)
    report.notes.append(f"Whole run: {(time.perf_counter() - start) / 60:.1f} min.")
    report.write(final=True)


if __name__ == "__main__":
    main()
