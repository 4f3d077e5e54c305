"""ServerArgs: every engine and server option, with its command-line help, in one dataclass."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def parse_bootstrap(address: str) -> tuple[str, int]:
    """``(host, port)`` of a ``HOST:PORT`` bootstrap address (ValueError naming the option otherwise)."""
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"disaggregation_bootstrap must be HOST:PORT, got {address!r}")
    return host, int(port)


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class ServerArgs:
    """Options shared by ``radixlm.Engine``, ``radixlm generate`` and ``radixlm serve``."""

    model_path: str | None = _opt(None, "Hugging Face folder (config.json + safetensors) or .gguf file; default: the embedded SmolLM2-135M-Instruct.")
    tokenizer_path: str | None = _opt(None, "Tokenizer folder or .gguf file, if not the model's own.")
    dtype: str = _opt("auto", "Weight and KV dtype: auto (fp32 on CPU, the model's dtype on GPU), float32, bfloat16, float16.", choices=["auto", "float32", "bfloat16", "float16"])
    kv_cache_dtype: str = _opt("auto", "KV-cache storage: auto (the model's dtype), bfloat16, float16, int8 or fp8_e4m3 / fp8_e5m2 (8-bit values with one fp16 scale per token and KV head: about 4x the tokens of an fp32 pool, 2x a bf16 one; see docs/kv-cache-dtypes.md).", choices=["auto", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2"])
    device: str = _opt("auto", "auto (cuda when available, else cpu), cpu or cuda.")
    context_length: int | None = _opt(None, "Longest prompt + output; default and upper bound: the model's context length.")
    max_total_tokens: int | None = _opt(None, "KV pool size in tokens; default: a share (mem_fraction_static) of free memory.")
    mem_fraction_static: float = _opt(0.15, "Share of free memory given to the KV pool when max_total_tokens is not set.")
    page_size: int = _opt(1, "Tokens per KV page; the radix cache shares whole pages.")
    max_running_requests: int = _opt(128, "Most requests decoding at once.")
    chunked_prefill_size: int = _opt(512, "Most prompt tokens computed in one step (longer prompts are split).")
    prefill_yield_share: float = _opt(0.2, "A prompt longer than one chunk sits steps out while others decode or a short prompt waits, for at most this share of its own expected prefill time (so a huge prompt cannot stall everyone, nor be starved); 0 turns this off. See benchmarks/results/long_prompt.md.")
    schedule_policy: str = _opt("lpm", "Admission order: lpm (longest cached prefix first), fcfs, or priority (each request's priority class first, smaller is more urgent, then lpm within a class; a waiting request preempts running ones of a less urgent class when the batch or the KV pool is full). See docs/priorities.md.", choices=["lpm", "fcfs", "priority"])
    priority_aging_s: float = _opt(30.0, "With --schedule-policy priority: a request moves up one priority class for every this many seconds it waits (so no class starves); 0 turns aging off.")
    disable_radix_cache: bool = _opt(False, "Do not share KV between requests (for ablations).")
    disable_cache_explain: bool = _opt(False, "Do not record who computed each cached prefix nor explain cache hits (for measuring its cost).")
    quantization: str | None = _opt(None, "Weight-only quantization. Unset: a pre-quantized checkpoint (GGUF, AWQ/GPTQ, FP8) runs as stored, a dense one in --dtype. none: dequantize a pre-quantized checkpoint to --dtype. int8, int4 (group 32, like GGUF Q4_1; these two on GPUs too, with Triton kernels), int4_bf16 (int4 for small batches, a bf16 copy for large ones where this CPU measures bf16 faster), or auto (per batch size, the fastest of fp32, bf16, int8 and int4 as a start-up micro-benchmark measures, cached per machine); int4 asked of an int4 checkpoint serves it as stored; other modes re-quantize it (logged).", choices=[None, "none", "int8", "int4", "int4_bf16", "auto"])
    attention_backend: str = _opt("auto", "auto, torch or triton.", choices=["auto", "torch", "triton"])
    num_threads: int | None = _opt(None, "Torch intra-op threads on CPU (per tensor-parallel rank); default: one per CPU, divided among the ranks.")
    tp_size: int = _opt(1, "Tensor parallelism: split the model over this many processes (ranks), each with its share of the heads, MLP and vocabulary and of the KV pool; gloo on CPU, NCCL on CUDA (one GPU per rank). See docs/tensor-parallel.md.")
    tp_timeout: float = _opt(300.0, "Seconds a tensor-parallel collective may wait for a peer before the engine gives up on the group.")
    random_seed: int = _opt(0, "Seed of the sampler for requests without their own seed.")
    grammar_backend: str = _opt("llguidance", "Constrained-decoding backend: llguidance or outlines.", choices=["llguidance", "outlines"])
    reasoning_parser: str = _opt("auto", "Reasoning sections (<think>...</think>, or GPT-OSS's harmony channels): auto (when the chat template writes both markers, or harmony's, chat answers carry the reasoning apart in reasoning_content, harmony's tool calls in tool_calls, and constraints apply to the answer after the reasoning) or none (the output is all content).", choices=["auto", "none"])
    grammar_mask: str = _opt("lazy", "When a constrained row's grammar mask is computed: lazy (pick first, compute the mask only when the grammar refuses the pick; exact for greedy rows and rows without top-k/top-p/min-p, the others get it first) or eager (every step).", choices=["lazy", "eager"])
    grammar_compile_timeout: float = _opt(30.0, "Seconds a grammar may take to compile before the request fails.")
    disable_jump_forward: bool = _opt(False, "Decode forced grammar text token by token instead of appending it at once.")
    disable_decode_stack: bool = _opt(False, "On CPUs, run decode steps through the Python layers instead of the C++ decoder stack (every layer of a step in one call; the same results); for comparisons.")
    disable_cuda_graph: bool = _opt(False, "On CUDA, run every decode step eagerly instead of replaying a captured CUDA graph of the whole forward (one per batch-size bucket, captured on first use; the same results up to float rounding, as a padded batch may take other matmul kernels).")
    cuda_graph_max_bs: int = _opt(32, "Largest decode batch replayed from a CUDA graph (buckets 1, 2, 4, 8, then every 8); larger batches run eagerly.")
    speculative_algorithm: str | None = _opt(None, "Speculative decoding: ngram (propose the continuation of the latest n-gram match in the request's own prompt and output, in its OpenAI prediction, and in recent outputs of all requests; no extra model) draft (a smaller model proposes; see --speculative-draft-model-path), or mtp (a DeepSeek-V3 checkpoint's own multi-token-prediction layer proposes from the model's hidden states; only for checkpoints that carry its weights). Each request speculates only while its measured acceptance pays and the running batch is small. Greedy output is unchanged; sampling keeps the model's distribution. Default: off (a request with an OpenAI prediction still speculates from it).", choices=[None, "ngram", "draft", "mtp"])
    speculative_num_draft_tokens: int = _opt(4, "Most tokens proposed per request per step (1-16); each is one more position in the verifying pass.")
    speculative_draft_model_path: str | None = _opt(None, "With --speculative-algorithm draft: folder or .gguf of a smaller model with the same tokenizer; default: the target's own weights quantized (self-speculation).")
    speculative_draft_quantization: str | None = _opt(None, "With --speculative-algorithm draft: quantize the draft model's weights to int8 or int4 (default for a self-draft: int4).", choices=[None, "int8", "int4"])
    disaggregation_mode: str | None = _opt(None, "Prefill/decode disaggregation: prefill (compute prompts and hand their KV to a decode worker) or decode (take prompts' KV from a prefill worker, then decode); requests join a pair through radixlm router --pd-disaggregation. Default: off (one engine does both).", choices=[None, "prefill", "decode"])
    disaggregation_bootstrap: str | None = _opt(None, "With --disaggregation-mode: HOST:PORT of the KV link; the prefill worker listens there, the decode worker connects there.")
    disaggregation_secret_file: str | None = _opt(None, "With --disaggregation-mode: a file of this user's (mode 600) holding the secret both workers sign the KV link's records with. Default: $RADIXLM_KV_SECRET; else, on a loopback bootstrap, a per-user file in the radixlm cache; required beyond loopback.")
    disaggregation_timeout: float = _opt(60.0, "Seconds one side of a prefill/decode pair waits for the other's half of a request before failing it.")
    pooling: str | None = _opt(None, "How /v1/embeddings and Engine.embed pool the final hidden states: last (the last prompt token's) or mean (every prompt token's; reads nothing from the radix cache). Default: what the model folder's sentence-transformers files say (modules.json, 1_Pooling/config.json), else last. See docs/embeddings.md.", choices=[None, "last", "mean"])
    matryoshka_dims: str | None = _opt(None, "Embedding sizes a request's dimensions may ask for (Matryoshka: the first d entries, renormalised): any (every size up to the hidden size) or a comma-separated list. Default: what config.json says (matryoshka_dimensions, or is_matryoshka: true for any), else none.")
    enable_lora: bool = _opt(False, "Serve LoRA adapters (on when --lora-paths is given): requests pick one by lora / lora_path / model \"base:name\"; adapters load and unload at run time. See docs/lora.md.")
    lora_paths: list[str] | None = _opt(None, "LoRA adapters (PEFT folders: adapter_config.json + adapter_model.safetensors) to serve, as name=path (a bare path is named by its folder).", nargs="+")
    max_loras_per_batch: int = _opt(8, "Most distinct LoRA adapters among the running requests (and so in one batch); a request of another adapter waits.")
    lora_dtype: str = _opt("auto", "How LoRA adapters are stored: auto (the model's dtype), float32, bfloat16 or float16. A decode step of many adapters reads each one's pairs, so bfloat16 halves that traffic for an fp32 model; it needs the grouped kernels (the C++ one on CPUs, Triton on GPUs), and elsewhere falls back to the model's dtype (logged).", choices=["auto", "float32", "bfloat16", "float16"])
    max_loaded_loras: int | None = _opt(None, "Most LoRA adapters held in memory; past it, the least recently used one no running request uses is evicted (and read again from its folder when next asked for). Default: no bound.")
    kv_host_cache_gb: float = _opt(0.0, "A host-memory tier under the radix cache, this many GiB: KV the pool evicts is kept there (on CPUs as an 8-bit copy, see --kv-tier-format) and loaded back when a prompt continues it, instead of being recomputed. 0: off (1 GiB when --kv-disk-cache-dir is set). See docs/kv-tiers.md.")
    kv_disk_cache_dir: str | None = _opt(None, "A disk tier under the host tier: KV the host tier evicts is written to files in this folder (in the background) and found again after a restart; replicas may share the folder.")
    kv_disk_cache_gb: float = _opt(16.0, "With --kv-disk-cache-dir: the most GiB its files take (least recently used removed first).")
    kv_tier_format: str = _opt("auto", "How the KV tiers store blocks: auto (an 8-bit pool's own bytes; an int8 copy of a wider pool on CPUs, its exact bytes on GPUs), exact (the pool's bytes: resumed requests compute exactly what cold ones do) or int8 (a quarter of an fp32 pool's bytes, within 8-bit rounding).", choices=["auto", "exact", "int8"])
    kv_tier_block_tokens: int = _opt(16, "Tokens per block the KV tiers store (rounded up to whole pages): a prefix is kept and found in whole blocks, so the last partial block of an evicted prefix is recomputed.")
    log_level: str = _opt("warning", "Logging level: debug, info, warning, error.")
    debug_check_accounting: bool = _opt(False, "Check after every step that each KV slot is free, cached or held by one request (slow; for tests). Also on when RADIXLM_CHECK_ACCOUNTING=1.")
    debug_fault_injection: bool = _opt(False, "Test only: a request whose rid starts with fault-<stage>- fails at that stage (admit, grammar, sample, forward, output, nan).")

    def resolved_device(self) -> str:
        """The concrete device name."""
        if self.device == "auto":
            import torch  # here, so that reading server options never loads torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        return self.device

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        """The concrete torch dtype."""
        import torch

        if self.dtype == "auto":
            return torch.float32 if device.type == "cpu" else torch.bfloat16
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
        except KeyError:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}") from None

    def validate(self) -> None:
        """Raise ValueError naming the first invalid option."""
        positive = ["page_size", "max_running_requests", "chunked_prefill_size", "cuda_graph_max_bs"]
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not isinstance(self.tp_size, int) or isinstance(self.tp_size, bool) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {self.tp_size!r}")
        if self.tp_timeout <= 0:
            raise ValueError(f"tp_timeout must be positive, got {self.tp_timeout}")
        if self.tp_size > 1 and self.speculative_algorithm in ("draft", "mtp"):
            raise ValueError(f"speculative_algorithm={self.speculative_algorithm!r} does not run with tp_size > 1 yet (use 'ngram', which needs no draft model)")
        for name in ("context_length", "max_total_tokens", "num_threads"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        if self.context_length is not None and self.context_length < self.page_size:
            raise ValueError(f"context_length ({self.context_length}) must be at least page_size ({self.page_size})")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens ({self.max_total_tokens}) must be at least page_size ({self.page_size})")
        if not isinstance(self.prefill_yield_share, (int, float)) or isinstance(self.prefill_yield_share, bool) or not 0 <= self.prefill_yield_share <= 1:
            raise ValueError(f"prefill_yield_share must be a number in [0, 1], got {self.prefill_yield_share!r}")
        if not isinstance(self.priority_aging_s, (int, float)) or isinstance(self.priority_aging_s, bool) or not 0 <= self.priority_aging_s < float("inf"):
            raise ValueError(f"priority_aging_s must be a number >= 0, got {self.priority_aging_s!r}")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        self._validate_speculative()
        self._validate_disaggregation()
        self._validate_kv_tiers()
        self._validate_lora()
        dims = self.matryoshka_dims
        if dims is not None and dims.strip().lower() != "any" and not all(p.strip().isdigit() and int(p) > 0 for p in dims.split(",")):
            raise ValueError(f"matryoshka_dims must be 'any' or a comma-separated list of positive integers, got {dims!r}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {getattr(self, f.name)!r}")

    def _validate_speculative(self) -> None:
        k = self.speculative_num_draft_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_num_draft_tokens must be an integer in [1, 16], got {k!r}")
        if self.speculative_algorithm != "draft":
            for name in ("speculative_draft_model_path", "speculative_draft_quantization"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} applies only with speculative_algorithm='draft' (got speculative_algorithm={self.speculative_algorithm!r})")

    def _validate_lora(self) -> None:
        if not isinstance(self.max_loras_per_batch, int) or isinstance(self.max_loras_per_batch, bool) or self.max_loras_per_batch < 1:
            raise ValueError(f"max_loras_per_batch must be a positive integer, got {self.max_loras_per_batch!r}")
        n = self.max_loaded_loras
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"max_loaded_loras must be a positive integer, got {n!r}")
        if self.lora_paths is not None and (isinstance(self.lora_paths, str) or not all(isinstance(p, str) for p in self.lora_paths)):
            raise ValueError(f"lora_paths must be a list of name=path strings, got {self.lora_paths!r}")
        if self.lora_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"lora_dtype must be auto, float32, bfloat16 or float16, got {self.lora_dtype!r}")
        if self.lora_enabled and self.tp_size > 1:
            raise ValueError("LoRA adapters (lora_paths, enable_lora) do not run with tp_size > 1 yet")

    def _validate_kv_tiers(self) -> None:
        for name in ("kv_host_cache_gb", "kv_disk_cache_gb"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < float("inf"):
                raise ValueError(f"{name} must be a number of GiB >= 0, got {v!r}")
        if not isinstance(self.kv_tier_block_tokens, int) or isinstance(self.kv_tier_block_tokens, bool) or self.kv_tier_block_tokens < 1:
            raise ValueError(f"kv_tier_block_tokens must be a positive integer, got {self.kv_tier_block_tokens!r}")
        if self.kv_disk_cache_dir is not None and self.kv_disk_cache_gb <= 0:
            raise ValueError(f"kv_disk_cache_gb must be > 0 with kv_disk_cache_dir, got {self.kv_disk_cache_gb}")
        if not self.kv_tiers_enabled:
            return
        if self.disable_radix_cache:
            raise ValueError("kv_host_cache_gb / kv_disk_cache_dir need the radix cache (drop disable_radix_cache)")
        if self.tp_size > 1:
            raise ValueError("kv_host_cache_gb / kv_disk_cache_dir do not run with tp_size > 1 yet (each rank holds part of the KV)")
        if self.speculative_algorithm == "draft":
            raise ValueError("kv_host_cache_gb / kv_disk_cache_dir do not run with speculative_algorithm='draft' yet (the draft model's KV pool is not tiered; use 'ngram')")

    @property
    def kv_tiers_enabled(self) -> bool:
        """True when a host or disk tier sits under the radix cache."""
        return self.kv_host_cache_gb > 0 or self.kv_disk_cache_dir is not None

    @property
    def kv_host_cache_bytes(self) -> int:
        """The host tier's budget in bytes (1 GiB under a disk tier when not given)."""
        gb = self.kv_host_cache_gb if self.kv_host_cache_gb > 0 or self.kv_disk_cache_dir is None else 1.0
        return int(gb * (1 << 30))

    @property
    def lora_enabled(self) -> bool:
        """True when the engine serves LoRA adapters."""
        return self.enable_lora or self.lora_paths is not None

    def _validate_disaggregation(self) -> None:
        if self.disaggregation_mode is None:
            if self.disaggregation_bootstrap is not None:
                raise ValueError("disaggregation_bootstrap applies only with disaggregation_mode prefill or decode")
            return
        if self.disaggregation_bootstrap is None:
            raise ValueError(f"disaggregation_mode={self.disaggregation_mode!r} needs disaggregation_bootstrap (HOST:PORT of the KV link)")
        parse_bootstrap(self.disaggregation_bootstrap)
        if self.tp_size > 1:
            raise ValueError("disaggregation_mode does not run with tp_size > 1 yet (each rank holds part of the KV)")
        if self.disaggregation_timeout <= 0:
            raise ValueError(f"disaggregation_timeout must be positive, got {self.disaggregation_timeout}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Build from keyword arguments; an unknown name is a ValueError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument {unknown[0]!r}")
        args = cls(**kwargs)
        args.validate()
        return args

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """Add one ``--option`` per field to ``parser``."""
        group = parser.add_argument_group("engine options")
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            if f.type in ("bool", bool):
                group.add_argument(flag, action="store_true", help=help_text)
                continue
            kind = {"int | None": int, "int": int, "float": float}.get(str(f.type), str)
            group.add_argument(flag, type=kind, default=f.default, choices=f.metadata.get("choices"), nargs=f.metadata.get("nargs"), help=f"{help_text} (default: {f.default})")

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> ServerArgs:
        """Collect the fields from parsed command-line arguments."""
        values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
        return cls.from_kwargs(**values)
