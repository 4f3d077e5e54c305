"""Test helpers: tiny checkpoints, a Hugging Face greedy reference, and a manual scheduler driver."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from fastapi import Request

TINY_ARCHS = ("llama", "qwen2", "mistral")
# The families beyond Llama's layout, each at a tiny size that still exercises what it adds.
FAMILY_ARCHS = ("qwen3", "gemma2", "gemma3", "phi3", "smollm3", "mistral_swa", "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3")
HYBRID_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # linear-attention layers between full-attention ones (tests/test_hybrid.py)
TINY_WINDOW = 8  # the sliding window of the tiny sliding-window models (prompts run to several times it)

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


THINK_TEMPLATE = (  # DeepSeek-R1 style: the generation prompt opens the reasoning; earlier answers lose theirs
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ (message['content'] or '').split('</think>')[-1] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)

HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
HARMONY_TEMPLATE = (  # GPT-OSS's harmony, cut down: tools in a developer message, earlier calls and results as channels
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n{% for t in tools %}{{ t.function.name }}: {{ t.function.parameters | tojson }}\n{% endfor %}<|end|>{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' or m.role == 'developer' -%}<|start|>developer<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'user' -%}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}{%- for c in m.tool_calls -%}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>"
    "{{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}<|call|>{%- endfor -%}"
    "{%- elif m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' -%}<|start|>functions.{{ m.name or 'tool' }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Radix trees share prefixes; caches reuse keys and values.",
    "Question: what is two plus two? Answer: four.",
    '{"name": "Ada", "age": 36, "tags": ["math", "engines"]}',
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "Once upon a time, in a small village, there lived a curious engineer.",
] * 20


API_KEY = "sekret"  # the key of the session's shared ``keyed_server`` (tests/conftest.py)
ADMIN_KEY = "admin-sekret"  # its admin key (given through $RADIXLM_ADMIN_API_KEY, never on argv)

def make_tokenizer(folder: Path) -> None:
    """Train a small byte-level BPE tokenizer with chat tokens and save it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))


def make_tiny_model(arch: str, folder: Path, seed: int = 0, **overrides) -> str:
    """Save a tiny random-weight checkpoint of ``arch`` (``TINY_ARCHS`` or ``FAMILY_ARCHS``)
    with a tokenizer into ``folder``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) + 3
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if arch == "llama":
        cfg = LlamaConfig(
            rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            **common,
        )
    elif arch == "qwen2":
        cfg = Qwen2Config(tie_word_embeddings=True, **common)
    elif arch == "mistral":
        cfg = MistralConfig(sliding_window=None, **common)
    elif arch in FAMILY_ARCHS or arch in HYBRID_ARCHS:
        cfg = _family_config(arch, common)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so greedy paths are not all one token
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif p.dim() >= 2:  # matrices, and experts stacked as [experts, rows, cols]
                p.normal_(0, 0.2)
            elif arch in FAMILY_ARCHS or arch in HYBRID_ARCHS:  # norms (and sinks, decays) too, so a wrong norm offset shows
                p.normal_(0 if "gemma" in arch or arch in HYBRID_ARCHS else 1, 0.3)
    model.save_pretrained(str(folder), safe_serialization=True)
    return str(folder)


# name -> (rank, alpha, targets, rslora) of the tiny Llama's test adapters (``lora_adapters`` in
# conftest.py): different ranks and target sets; "fused" targets only parts of our fused
# projections (q/k/v in qkv_proj, gate/up in gate_up_proj)
LORA_ADAPTERS = {
    "attn": (4, 8, ["q_proj", "v_proj", "o_proj"], False),
    "mlp": (16, 16, ["down_proj", "up_proj"], True),
    "fused": (8, 32, ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"], False),
}


def make_harmony_model(folder: Path) -> str:
    """A tiny random GPT-OSS checkpoint whose tokenizer holds harmony's markers as special tokens
    and whose chat template writes harmony (``HARMONY_TEMPLATE``); ``<|return|>`` and ``<|call|>``
    end generation, as GPT-OSS's do."""
    from transformers import AutoTokenizer

    make_tiny_model("gpt_oss", folder, vocab_size=416)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": HARMONY_MARKERS})
    tok.chat_template = HARMONY_TEMPLATE
    tok.save_pretrained(folder)
    ids = tok.convert_tokens_to_ids(HARMONY_MARKERS)
    assert max(ids) < 416, ids
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").unlink(missing_ok=True)
    return str(folder)


def make_adapter(base: str, folder: Path, rank: int, alpha: int, targets: list[str], rslora: bool = False, seed: int = 0) -> str:
    """Save a PEFT LoRA adapter with random non-zero A and B for the checkpoint ``base``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(str(folder))
    return str(folder)


def _family_config(arch: str, common: dict):
    """The transformers config of a tiny ``FAMILY_ARCHS`` model (each family's distinctive piece switched on)."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        Gemma2Config,
        Gemma3TextConfig,
        GptOssConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        Qwen3NextConfig,
        SmolLM3Config,
    )

    if arch in HYBRID_ARCHS:  # three Gated DeltaNet layers, then gated full attention; 2 key heads serving 4 value heads
        hybrid = {  # overrides reach these too
            **dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_conv_kernel_dim=4),
            **common, "num_hidden_layers": 4,
        }  # fmt: skip
        if arch == "qwen3_5":
            return Qwen3_5TextConfig(tie_word_embeddings=False, **hybrid)
        if arch == "qwen3_5_moe":  # experts on every layer, always renormalised, and the gated shared expert
            return Qwen3_5MoeTextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, **hybrid)
        # routed experts plus the gated shared expert, and one dense MLP layer (unless overridden)
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, mlp_only_layers=[1])
        return Qwen3NextConfig(**{**moe, **hybrid})
    if arch == "qwen3":  # head_dim apart from hidden / heads
        return Qwen3Config(head_dim=32, tie_word_embeddings=False, **common)
    if arch == "gemma2":  # soft-caps small enough to bend random scores and logits
        return Gemma2Config(
            head_dim=16, query_pre_attn_scalar=24, sliding_window=TINY_WINDOW, attn_logit_softcapping=2.0,
            final_logit_softcapping=4.0, layer_types=["sliding_attention", "full_attention"], **common,
        )  # fmt: skip
        # (Gemma's hidden_activation defaults to the tanh GELU)
    if arch == "gemma3":
        return Gemma3TextConfig(
            head_dim=16, query_pre_attn_scalar=24, sliding_window=TINY_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
            **{**common, "num_hidden_layers": 3},
        )  # fmt: skip
    if arch == "phi3":  # longrope (short factors below the original length) rotating 3/4 of each head
        half = int(16 * 0.75) // 2
        return Phi3Config(
            pad_token_id=0, original_max_position_embeddings=4096, partial_rotary_factor=0.75,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                             "short_factor": [1.0 + 0.25 * i for i in range(half)], "long_factor": [4.0] * half},
            **common,
        )  # fmt: skip
    if arch == "mixtral":  # 4 experts, 2 a token, renormalised
        return MixtralConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=None, **common)
    if arch == "qwen3_moe":  # a dense first layer (mlp_only_layers), then 8 experts, 3 a token, not renormalised
        return Qwen3MoeConfig(
            head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64, mlp_only_layers=[0],
            norm_topk_prob=False, tie_word_embeddings=False, **common,
        )  # fmt: skip
    if arch == "gpt_oss":  # sinks, a sliding then a full layer, YaRN, biases, 4 experts (2 a token), a SwiGLU clamp that bites
        return GptOssConfig(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=TINY_WINDOW, swiglu_limit=1.0,
                            layer_types=["sliding_attention", "full_attention"], **common)  # fmt: skip
    if arch in ("deepseek_v2", "deepseek_v3"):  # MLA (value heads wider than the nope part), a dense first layer, then experts
        mla = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, moe_intermediate_size=32,
                   n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                   **{**common, "num_key_value_heads": common["num_attention_heads"]})  # fmt: skip
        if arch == "deepseek_v2":  # V2-Lite's layout: no query compression; softmax routing, best groups by their max
            yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                    "mscale": 0.707, "mscale_all_dim": 0.707}  # fmt: skip
            return DeepseekV2Config(q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5, rope_parameters=yarn, **mla)
        # V3: compressed queries, sigmoid routing with the correction bias, groups by their top-2 sum; YaRN whose mscale bends the softmax scale
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}  # fmt: skip
        return DeepseekV3Config(q_lora_rank=64, routed_scaling_factor=2.5, rope_parameters=yarn, **mla)
    if arch == "smollm3":  # the second of every two layers without RoPE
        return SmolLM3Config(no_rope_layers=[1, 0], pad_token_id=0, **common)
    return MistralConfig(sliding_window=TINY_WINDOW, **common)  # mistral_swa: every layer slides


def hf_greedy_divergence(model, prompt_ids: list[int], output_ids: list[int]) -> int | None:
    """Where ``output_ids`` first differs from transformers' greedy continuation of ``prompt_ids``
    (``None``: nowhere), from one teacher-forced forward pass over prompt + output.

    The argmax after prompt + output[:j] is transformers' greedy token j whenever output[:j] is
    its greedy prefix, so by induction the first j whose argmax is not output[j] is exactly where
    transformers' greedy ``generate`` (one forward pass per token) would have diverged: the same
    check for a fraction of the time.
    """
    assert prompt_ids and output_ids
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) + list(output_ids)])).logits[0, len(prompt_ids) - 1 : -1]
    greedy = logits.argmax(-1).tolist()
    return next((j for j, (a, b) in enumerate(zip(greedy, output_ids)) if a != b), None)


def load_hf_model(path: str):
    """The transformers model for a checkpoint folder or GGUF file, in fp32."""
    import os

    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        folder, name = os.path.split(path)
        with _gguf_parsed_once():
            return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


@contextlib.contextmanager
def _gguf_parsed_once():
    """While transformers loads a GGUF: parse the file once, not twice, and build gguf's tensor-name
    map once, not once per module (together ~30 s of pure Python for SmolLM2, of ~45 s).

    transformers reads the file with ``gguf.GGUFReader`` for the config and again for the weights,
    and ``get_gguf_hf_weights_map`` builds ``gguf.get_tensor_name_map(arch, n)`` for each of the
    model's ~400 modules. Both are read-only and depend only on their arguments, so sharing them
    gives the same model. Where a gguf version lacks either name, it is left as it is.
    """
    import functools
    from unittest import mock

    import gguf

    patches = [mock.patch.object(gguf, name, functools.lru_cache(maxsize=None)(getattr(gguf, name))) for name in ("GGUFReader", "get_tensor_name_map") if hasattr(gguf, name)]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


class Driver:
    """Runs a scheduler by hand, step by step, collecting each request's final output."""

    def __init__(self, runtime) -> None:
        self.rt = runtime
        self.sched = runtime.scheduler
        self.results: dict[str, object] = {}
        self.stream_events: dict[str, list] = {}
        self.steps = 0

    def add(self, input_ids: list[int], rid: str | None = None, **params) -> str:
        """Queue a request made of token ids; returns its id."""
        from radixlm.runtime.request import Req
        from radixlm.runtime.sampling_params import SamplingParams

        extra = {k: params.pop(k) for k in ("return_logprob", "top_logprobs_num", "logprob_start_len", "stream", "priority", "return_cache_info") if k in params}
        rid = rid or f"r{len(self.stream_events)}"
        self.stream_events[rid] = []

        def sink(out, rid=rid):
            self.stream_events[rid].append(out)
            if out.finished:
                self.results[rid] = out

        req = Req(rid=rid, input_ids=list(input_ids), params=SamplingParams.from_dict(params), sink=sink, **extra)
        if req.params.seed is not None:
            req.generator = torch.Generator().manual_seed(req.params.seed)
        if req.params.constraint is not None:
            req.grammar = self.rt.grammars.compile(*req.params.constraint).matcher()
        self.sched.add(req)
        return rid

    def step(self, check: bool = True) -> bool:
        """One scheduler step; checks the KV accounting afterwards."""
        ran = self.sched.step()
        self.steps += 1
        if check:
            self.sched.check_accounting()
        return ran

    def run(self, max_steps: int = 10_000, on_step: Callable[[int], None] | None = None) -> None:
        """Step until every request is done."""
        for i in range(max_steps):
            if on_step is not None:
                on_step(i)
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("requests did not finish")


class ServerProcess:
    """``radixlm serve`` as a child process on a free loopback port."""

    def __init__(self, model_path: str, *extra: str, env: dict | None = None) -> None:
        import os
        import socket
        import subprocess
        import sys

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [str(Path(sys.executable).parent / "radixlm"), "serve", "--model-path", model_path, "--port", str(self.port), *extra]
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"radixlm-server-{self.port}.log", "w+")
        inherited = {k: v for k, v in os.environ.items() if k not in ("RADIXLM_API_KEY", "RADIXLM_ADMIN_API_KEY")}  # keys only when given
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**inherited, "RADIXLM_NUM_THREADS": "1", **(env or {})})
        try:
            self.wait_healthy()
        except BaseException:  # a server that never came up must not outlive the test
            self.stop()
            raise

    def wait_healthy(self, timeout: float = 180.0) -> None:
        """Block until /health answers 200 (or fail with the server's log)."""
        import time

        import httpx

        deadline = time.monotonic() + timeout
        # One client for all the polls: httpx.get builds one (an SSL context, ~0.1 s of CPU) per
        # call, taken from the server starting up beside it.
        with httpx.Client(timeout=2, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
                try:
                    if client.get(self.base_url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
        raise RuntimeError(f"server did not become healthy:\n{self.output()}")

    def output(self) -> str:
        """Everything the server printed."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        """SIGTERM, wait, and return the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def tokenizer_parts(model_path: str) -> tuple:
    """``(tokenizer, vocab_size, end_ids)`` of a model, as the grammar backends take them."""
    from radixlm.runtime.loader import load_model_config
    from radixlm.runtime.tokenizer import end_token_ids, load_tokenizer

    tok = load_tokenizer(model_path)
    cfg = load_model_config(model_path)
    return tok, cfg.vocab_size, end_token_ids(tok, cfg.eos_token_ids)


def grammar_backends(tok, vocab: int, ends: set[int]) -> dict:
    """Both grammar backends over one tokenizer, by name."""
    from radixlm.runtime.constrained.llguidance_backend import LLGuidanceBackend
    from radixlm.runtime.constrained.outlines_backend import OutlinesBackend

    return {"llguidance": LLGuidanceBackend(tok, vocab, ends), "outlines": OutlinesBackend(tok, vocab, ends)}


def accepts_text(backend, tok, vocab: int, ends: set[int], kind: str, spec: str, text: str) -> bool:
    """True when ``text`` is accepted token by token and the grammar may end after it."""
    import torch

    from radixlm.runtime.constrained.base import bitmask_width, unpack_bitmask

    m = backend.compile(kind, spec).matcher()
    bitmask = torch.zeros(1, bitmask_width(vocab), dtype=torch.int32)
    for t in tok.encode(text, add_special_tokens=False):
        m.fill_bitmask(bitmask, 0)
        if not unpack_bitmask(bitmask, vocab)[0, t] or not m.accept(t):
            return False
    if m.is_terminated():
        return True
    m.fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask(bitmask, vocab)[0]
    return any(bool(allowed[e]) for e in ends)


# ------------------------------------------------------------ in-process HTTP servers (router tests)
def missing_under_ci(what: str) -> None:
    """Skip a test for lack of ``what``; under CI, which installs it, fail instead."""
    import os

    import pytest

    if os.environ.get("CI"):
        pytest.fail(f"{what} under CI, which provides it", pytrace=False)
    pytest.skip(f"{what} here")


def built_cpp_kernels():
    """The C++ kernels' module; a skip where they cannot be built, a failure under CI."""
    from radixlm.kernels.cpu_ext import cpu_kernels

    ext = cpu_kernels()
    if ext is None:
        missing_under_ci("the C++ kernels could not be built (no compiler?)")
    return ext


def wait_until(condition: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> None:
    """Poll ``condition`` until it is true; fail after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def good_and_bad_requests(good_ids: list[int], bad_ids: list[int]) -> tuple[list, dict]:
    """Two greedy requests of 6 tokens, rids "good" and "bad" (a test makes the bad one's row
    fail), and the dict their latest outputs land in, by rid."""
    from radixlm.runtime.request import Req
    from radixlm.runtime.sampling_params import SamplingParams

    outs: dict = {}
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    reqs = [Req(rid=rid, input_ids=list(ids), params=params, sink=lambda out, rid=rid: outs.__setitem__(rid, out)) for rid, ids in (("good", good_ids), ("bad", bad_ids))]
    return reqs, outs


def run_and_check_only_bad_failed(scheduler, reqs: list, outs: dict) -> None:
    """Run ``reqs`` on a manual scheduler to the end; only "bad" failed (a 500 abort), "good" ran
    to its length, and every KV slot is accounted for."""
    for req in reqs:
        scheduler.add(req)
    while scheduler.waiting or scheduler.running:
        scheduler.step()
    assert outs["bad"].finished and outs["bad"].meta_info["finish_reason"]["status"] == 500
    assert outs["good"].finished and outs["good"].meta_info["finish_reason"]["type"] == "length"
    scheduler.check_accounting()


class ServerThread:
    """An ASGI app served by uvicorn in a background thread on a loopback port."""

    def __init__(self, app, port: int = 0, lifespan: str = "on") -> None:
        self.app, self.port, self.lifespan = app, port, lifespan
        self.server = None
        self.thread = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        """Serve (on the same port as before, if restarted) and wait until it listens."""
        import threading

        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error", lifespan=self.lifespan, timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), 30, "uvicorn to start")
        assert self.server.started, "uvicorn did not start"
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, force: bool = True) -> None:
        """Stop serving (the port refuses connections afterwards); ``force``: at once, as if
        killed (no lifespan shutdown), else gracefully (open connections get 1 s)."""
        self.begin_stop(force)
        self.join()

    def begin_stop(self, force: bool = True) -> None:
        """Ask it to stop, without waiting (stop several at once, then ``join`` each)."""
        if self.server is not None:
            self.server.should_exit = True
            self.server.force_exit = force

    def join(self) -> None:
        """Wait until it has stopped."""
        if self.thread is not None:
            self.thread.join(timeout=30)
            assert not self.thread.is_alive(), "uvicorn did not stop"


class FakeWorker:
    """A stand-in for ``radixlm serve``: records what it gets, answers by its settings (or by the
    ``fake`` object of a request's body): ``status``, ``chunks``, ``delay`` between chunks,
    ``break_after`` (chunks, then the connection breaks), ``hang`` (answer only once released),
    ``answer_after`` (seconds before any answer, errors too)."""

    def __init__(self, name: str) -> None:
        import asyncio
        import threading

        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

        self.name = name
        self.requests: list[tuple[str, dict]] = []
        self.disconnects: list[str] = []  # paths whose client went away before the answer ended
        self.answered: list[str] = []  # paths of the unstreamed answers it sent (errors too)
        self.status, self.health_status, self.chunks, self.delay, self.answer_after = 200, 200, 3, 0.0, 0.0
        self.break_after: int | None = None
        self.hang = False
        self.release = threading.Event()  # ends every hang
        self.flushes = 0
        self.metrics_auth: str | None = None  # the Authorization header of the last GET /metrics
        app = FastAPI()
        self.http = ServerThread(app, lifespan="off")

        def setting(body: dict, key: str):
            return (body.get("fake") or {}).get(key, getattr(self, key))

        @app.get("/health")
        async def health():
            return PlainTextResponse("", status_code=self.health_status)

        async def hang_until_released(request: Request, path: str) -> bool:
            """Wait for ``release``; True if the client went away first (recorded)."""
            while not self.release.is_set():
                if await request.is_disconnected():
                    self.disconnects.append(path)
                    return True
                await asyncio.sleep(0.01)
            return False

        async def generate(request: Request):
            body = await request.json()
            path = request.url.path
            self.requests.append((path, body))
            await asyncio.sleep(setting(body, "answer_after"))
            status = setting(body, "status")
            if status != 200:
                self.answered.append(path)
                return JSONResponse({"object": "error", "message": f"{self.name} says {status}", "type": "X", "param": None, "code": status}, status_code=status)
            if not body.get("stream"):
                if setting(body, "hang") and await hang_until_released(request, path):
                    return PlainTextResponse("", status_code=499)
                self.answered.append(path)
                return {"text": f"from {self.name}", "worker": self.name, "bootstrap_room": body.get("bootstrap_room")}

            async def events():
                done = False
                try:
                    if setting(body, "hang"):
                        while not self.release.is_set():
                            await asyncio.sleep(0.01)
                    for i in range(setting(body, "chunks")):
                        if setting(body, "break_after") == i:
                            raise RuntimeError("the fake worker breaks the connection")
                        yield f"data: {json.dumps({'text': f'{self.name}-{i}', 'worker': self.name})}\n\n"
                        await asyncio.sleep(setting(body, "delay"))
                    yield "data: [DONE]\n\n"
                    done = True
                finally:
                    if not done:
                        self.disconnects.append(path)

            return StreamingResponse(events(), media_type="text/event-stream")

        for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/embeddings", "/v1/rerank", "/v1/score"):
            app.add_api_route(path, generate, methods=["POST"])

        @app.get("/metrics")
        async def metrics(request: Request):
            self.metrics_auth = request.headers.get("authorization")
            return PlainTextResponse(f'# HELP radixlm_num_running_requests Running.\n# TYPE radixlm_num_running_requests gauge\nradixlm_num_running_requests {len(self.requests)}\n# HELP radixlm_requests_total Finished.\n# TYPE radixlm_requests_total counter\nradixlm_requests_total{{finish_reason="stop"}} 7\n')

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": f"model-{self.name}", "object": "model"}]}

        @app.get("/get_server_info")
        async def server_info():
            return {"name": self.name}

        @app.post("/flush_cache")
        async def flush_cache():
            self.flushes += 1
            return PlainTextResponse("cache flushed")

        @app.post("/abort_request")
        async def abort_request(request: Request):
            body = await request.json()
            self.requests.append(("/abort_request", body))
            return {"rid": body.get("rid"), "aborted": self.name == "a"}

    @property
    def url(self) -> str:
        return self.http.url

    def paths(self) -> list[str]:
        """The paths of the requests it got (generation and aborts), in order."""
        return [p for p, _ in self.requests]

    def start(self) -> FakeWorker:
        self.http.start()
        return self

    def stop(self) -> None:
        self.http.stop()


class FakeAdapter:
    """An adapter of random pairs of ``ranks`` (by output part; None: the whole module) on ``module``
    (``width`` inputs, output parts of ``part_rows`` rows), packed as load_adapter packs them."""

    def __init__(self, name: str, ranks: dict[int | None, int], module: str = "layers.0.m", width: int = 6, part_rows: tuple[int, int] = (2, 3), dtype: torch.dtype = torch.float32) -> None:
        from radixlm.runtime.lora.adapter import _pack

        rows = {0: part_rows[0], 1: part_rows[1], None: sum(part_rows)}
        parts = {p: (torch.randn(r, width), torch.randn(rows[p], r)) for p, r in ranks.items()}
        a, b, blocks = _pack(parts, list(part_rows), 0.5, dtype, "cpu")
        self.name, self.weights, self.blocks, self.compact = name, {module: (a, b)}, {module: blocks}, {}


def run_scenario(path: str, prompts: list[list[int]], options: dict, arrival: str, expect_hits: bool = True, max_total_tokens: int = 4096, **params):
    """Greedy outputs of ``prompts`` on an engine over ``path`` with ``options``, the requests
    arriving ``one_by_one``, ``all_at_once``, ``twice`` (all, then all again: the second round
    must repeat the first, from the cache where ``expect_hits``) or ``staggered`` (one joins every
    other step while others decode); returns the outputs and the engine's parts."""
    from radixlm import ServerArgs
    from radixlm.runtime.engine import build_parts

    args = ServerArgs(model_path=path, max_total_tokens=options.pop("max_total_tokens", max_total_tokens), **options)
    rt = build_parts(args)
    d = Driver(rt)
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True, **params}
    rids: list[str] = []
    if arrival == "one_by_one":
        for p in prompts:
            rids.append(d.add(p, **params))
            d.run()
    elif arrival in ("all_at_once", "twice"):
        rids = [d.add(p, **params) for p in prompts]
        d.run()
        if arrival == "twice":
            first = [d.results[r].output_ids for r in rids]
            rids = [d.add(p, **params) for p in prompts]
            d.run()
            assert [d.results[r].output_ids for r in rids] == first
            assert sum(d.results[r].meta_info["cached_tokens"] for r in rids) > 0 or not expect_hits
    else:
        pending = list(prompts)

        def on_step(i: int) -> None:
            if pending and i % 2 == 0:
                rids.append(d.add(pending.pop(0), **params))

        d.run(on_step=on_step)
        while pending:  # the engine went idle before every prompt had joined
            rids.append(d.add(pending.pop(0), **params))
            d.run()
    rt.scheduler.check_accounting()
    return [d.results[r].output_ids for r in rids], rt


def assert_masked_greedy(hf, rt, constraint: tuple, prompt: list[int], ours: list[int], label: str = "") -> object:
    """Every token of ``ours`` is transformers' argmax (model ``hf``) among the tokens the compiled
    ``constraint`` allows at that point (the engine parts ``rt`` compile it); returns the matcher
    after the last token."""
    from radixlm.runtime.constrained.base import bitmask_width, unpack_bitmask

    vocab = rt.runner.config.vocab_size
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1, :vocab]
    matcher = rt.grammars.compile(*constraint).matcher()
    for j, token in enumerate(ours):
        bits = torch.full((1, bitmask_width(vocab)), -1, dtype=torch.int32)
        matcher.fill_bitmask(bits, 0)
        allowed = unpack_bitmask(bits, vocab)[0]
        best = int(logits[j].masked_fill(~allowed, float("-inf")).argmax())
        assert best == token, f"{label}: constrained token {j} is {token}, transformers' masked argmax {best}"
        assert matcher.accept(token)
    return matcher


def decode_with_stack(model_path: str, prompts: list[list[int]], stack: bool, fail_row_of: str | None = None, **args) -> tuple[Driver, list[str], list[torch.Tensor], int]:
    """Greedy decoding of ``prompts`` (10 tokens each) with the C++ decode stack on or off: the
    driver, the rids, every forward's logits and how many forwards the stack ran. ``fail_row_of``:
    the rid whose row makes every stack call it is in raise after the stack ran (states staged);
    ``args``: more engine options."""
    from radixlm.runtime.engine import build_parts
    from radixlm.runtime.server_args import ServerArgs

    rt = build_parts(ServerArgs(model_path=model_path, max_total_tokens=4096, disable_decode_stack=not stack, **args))
    stacks, d = rt.runner.model.decode_stacks, Driver(rt)
    original, ran, logits = stacks.run, [0], []

    def run(x, ropes, batch):
        out = original(x, ropes, batch)
        ran[0] += out is not None
        victim = next((r for r in d.sched.running if r.rid == fail_row_of), None)
        if out is not None and victim is not None and victim.kv is not None and victim.kv.row in batch.req_rows.tolist():
            raise RuntimeError("stack fault after staging")
        return out

    stacks.run = run
    forward = rt.runner.forward
    rt.runner.forward = lambda batch: logits.append(forward(batch)) or logits[-1]
    rids = [d.add(p, rid=f"r{i}", max_new_tokens=10, temperature=0.0, ignore_eos=True) for i, p in enumerate(prompts)]
    d.run()
    rt.scheduler.check_accounting()
    return d, rids, logits, ran[0]


def assert_same_logits(fused: list[torch.Tensor], plain: list[torch.Tensor]) -> None:
    """Every forward's logits of two runs equal bit for bit (the decode stack's and the Python layers')."""
    assert len(fused) == len(plain)
    for step, (a, b) in enumerate(zip(fused, plain)):
        assert torch.equal(a, b), f"forward {step}: the stack's logits differ by up to {(a - b).abs().max():.3g}"


def failing_every(fn: Callable, period: int, phase: int, message: str) -> tuple[Callable, dict]:
    """``fn`` wrapped to raise ``RuntimeError(message)`` on its calls whose count modulo ``period``
    is ``phase`` (the first call counts 1), and the counter (``{"n": calls so far}``)."""
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] % period == phase:
            raise RuntimeError(message)
        return fn(*args, **kwargs)

    return wrapped, calls
