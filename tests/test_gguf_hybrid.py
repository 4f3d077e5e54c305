"""GGUF files of the hybrid linear-attention families, Qwen3.5 (``qwen35``) and Qwen3-Next
(``qwen3next``), written as llama.cpp's converter writes them (``write_hybrid_gguf``: ``A_log`` as
``-exp(A_log)``, norms as ``1 + w``, the convolution squeezed, Qwen3-Next's ``in_proj_qkvz`` split,
Qwen3.5's value heads tiled), open as the Hugging Face checkpoints they came from: the config
transformers builds from ours is the original's; every weight is what the file holds, back in
Hugging Face's layout (a quantized one dequantized; ``A_log`` and the norms within float32
rounding of the originals); quantized weights run as stored; and the engine on the file decodes
transformers' greedy tokens, in mixed batches and chunked prefill (on a Q8_0 file: transformers
on the weights the file holds, and as stored, tokens that are those weights' best up to the
kernels' activation rounding).

The tiny checkpoints have 2 key heads serving 4 value heads (so Qwen3.5's value-head order
matters); ``qwen35_wide``'s value heads are one Q8_0 block wide, so ``ssm_out``'s reordered
columns move as blocks (elsewhere it is dequantized); Qwen3-Next has experts on every layer, as
llama.cpp's ``qwen3next`` does.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import hybrid_gguf_layout, metadata_gguf, write_hybrid_gguf

from helpers import (
    assert_same_logits,
    decode_with_stack,
    hf_greedy_divergence,
    load_hf_model,
    make_tiny_model,
    run_scenario,
)
from radixlm.runtime.checkpoints.gguf import gguf_hf_config
from radixlm.runtime.layers.gguf_linear import GGUFLinear

CPU = torch.device("cpu")
CASES = {  # case: (tiny model, make_tiny_model overrides)
    "qwen35": ("qwen3_5", {}),
    "qwen35_wide": ("qwen3_5", {"linear_value_head_dim": 32}),
    "qwen3next": ("qwen3_next", {"mlp_only_layers": []}),
    "qwen35moe": ("qwen3_5_moe", {}),  # Qwen3.5's tiled value heads with experts on every layer
}
FILES = [  # (case, --outtype, variant: write_hybrid_gguf's option)
    ("qwen35", "F32", ""), ("qwen35", "Q8_0", ""), ("qwen35_wide", "Q8_0", ""), ("qwen35", "Q8_0", "fuse_qkv"),
    ("qwen3next", "F32", ""), ("qwen3next", "Q8_0", ""), ("qwen3next", "Q8_0", "ssm_in"), ("qwen3next", "F32", "fuse_qkv"),
    ("qwen35", "F32", "mtp"), ("qwen3next", "Q8_0", "mtp"), ("qwen35moe", "F32", ""), ("qwen35moe", "Q8_0", ""),
]  # fmt: skip
SCENARIOS = {"mixed_batch_chunked_16": ({"chunked_prefill_size": 16}, "staggered"), "chunked_prefill_5": ({"chunked_prefill_size": 5}, "all_at_once")}
SHIFTED = re.compile(r"(?<!linear_attn\.)norm\.weight$|\.A_log$")  # values the converter changed: float32 rounding apart


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid_gguf_hf")
    return {case: make_tiny_model(arch, root / case, **overrides) for case, (arch, overrides) in CASES.items()}


@pytest.fixture(scope="module")
def gguf_of(hf_folders, tmp_path_factory):
    """``gguf_of(case, outtype, variant)``: the case's GGUF file (written once)."""
    root = tmp_path_factory.mktemp("hybrid_gguf")
    made: dict[tuple[str, str, str], str] = {}

    def make(case: str, outtype: str = "F32", variant: str = "") -> str:
        if (case, outtype, variant) not in made:
            out = root / f"{case}-{outtype}-{variant or 'split'}.gguf"
            made[case, outtype, variant] = str(write_hybrid_gguf(hf_folders[case], out, outtype, **({variant: True} if variant else {})))
        return made[case, outtype, variant]

    return make


@pytest.fixture(scope="module")
def as_stored(hf_folders, gguf_of, tmp_path_factory):
    """``as_stored(case, outtype, variant)``: a Hugging Face folder of the weights the file holds.

    Where the converter put each element is found by laying out element indices as it lays out
    values (``hybrid_gguf_layout``), so each tensor's dequantized values go back to their places;
    the values it changed (``A_log``, norms) are the originals."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("hybrid_as_stored")
    made: dict[tuple[str, str, str], str] = {}

    def make(case: str, outtype: str = "F32", variant: str = "") -> str:
        if (case, outtype, variant) in made:
            return made[case, outtype, variant]
        source = Path(hf_folders[case])
        tensors = load_file(str(source / "model.safetensors"))
        index, total = {}, 0
        for name, t in tensors.items():
            index[name] = np.arange(total, total + t.numel()).reshape(t.shape)
            total += t.numel()
        where = hybrid_gguf_layout(str(source), index, **({variant: True} if variant in ("ssm_in", "fuse_qkv") else {}))
        layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
        values = np.full(total, np.nan, np.float32)
        for t in GGUFReader(gguf_of(case, outtype, variant)).tensors:
            if t.name.startswith(f"blk.{layers}."):  # the MTP block
                continue
            values[where[t.name].reshape(-1)] = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(-1)
        out = root / f"{case}-{outtype}-{variant or 'split'}"
        shutil.copytree(source, out)
        held = {n: t if SHIFTED.search(n) else torch.from_numpy(values[index[n]]) for n, t in tensors.items()}
        assert not any(t.isnan().any() for t in held.values()), "an element the file does not hold"
        save_file(held, str(out / "model.safetensors"))
        made[case, outtype, variant] = str(out)
        return made[case, outtype, variant]

    return make


def _prompts() -> list[list[int]]:
    """Prompts short and long (past one 64-token block of the chunked delta rule)."""
    rng = random.Random(7)
    return [[rng.randrange(3, 390) for _ in range(n)] for n in (3, 17, 40, 70)]


def _comparable(config) -> dict:
    skip = {"transformers_version", "_name_or_path", "dtype", "torch_dtype"}
    return {k: v for k, v in config.to_dict().items() if k not in skip}


@pytest.mark.parametrize("case", list(CASES))
def test_the_config_is_the_hf_config(gguf_of, hf_folders, case):
    import transformers

    ours = gguf_hf_config(gguf_of(case))
    original = json.loads((Path(hf_folders[case]) / "config.json").read_text())
    cls = {"qwen3next": transformers.Qwen3NextConfig, "qwen35moe": transformers.Qwen3_5MoeTextConfig}.get(case, transformers.Qwen3_5TextConfig)
    assert _comparable(cls(**ours)) == _comparable(cls(**original))
    for key, value in ours.items():  # what we name, we name as HF does, with HF's value
        if key in original:
            assert value == original[key], key


@pytest.mark.parametrize("case,outtype,variant", FILES)
def test_every_weight_is_what_the_file_holds(gguf_of, as_stored, case, outtype, variant):
    """The model loaded from the file (dequantized) has the weights of the model loaded from a
    Hugging Face folder of what the file holds: the converter's changes undone, layout and values."""
    from radixlm.runtime.loader import load_model

    ours, _ = load_model(gguf_of(case, outtype, variant), torch.float32, CPU, native=False)
    reference, _ = load_model(as_stored(case, outtype, variant), torch.float32, CPU)
    want = dict(reference.named_parameters())
    got = dict(ours.named_parameters())
    assert set(got) == set(want)
    for name, param in got.items():
        if SHIFTED.search(name):  # (1 + w) - 1, log(exp(x)): an ulp or two
            torch.testing.assert_close(param, want[name], rtol=0, atol=3e-7, msg=name)
        else:
            assert torch.equal(param, want[name]), name


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the GGUF kernels see it: 8 bits per block of 32 (scale max |x| / 127)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / torch.where(scale > 0, scale, 1)) * scale).reshape(x.shape)


@pytest.mark.parametrize("case,variant", [("qwen35", ""), ("qwen35_wide", ""), ("qwen3next", ""), ("qwen3next", "ssm_in"), ("qwen35moe", "")])
def test_quantized_weights_run_as_stored(gguf_of, case, variant, cpp_ext):
    """Each Q8_0 projection (the DeltaNet's four-part ``in_proj`` and ``out_proj``, experts, the
    shared expert) runs over its blocks and computes the dequantized model's product; ``ssm_out``
    whose reordered value heads are not whole blocks is dequantized once."""
    from radixlm.runtime.loader import load_model

    path = gguf_of(case, "Q8_0", variant)
    native, _ = load_model(path, torch.float32, CPU)
    dense, _ = load_model(path, torch.float32, CPU, native=False)
    gen = torch.Generator().manual_seed(0)
    kinds = {}
    for name, layer in native.named_modules():
        if not name.endswith(("_proj", "lm_head")):
            continue
        ref = dense.get_submodule(name)
        kinds[name] = isinstance(layer, GGUFLinear)
        x = torch.randn(3, ref.in_features, generator=gen)
        if kinds[name]:
            exact = _int8_rounded(x).double() @ ref.weight.double().t()
            torch.testing.assert_close(layer(x).double(), exact, atol=2e-4 * exact.abs().max().item(), rtol=1e-4, msg=name)
        else:
            assert torch.equal(layer.weight, ref.weight), name
    assert kinds["layers.0.linear_attn.in_proj"] and kinds["layers.3.self_attn.qkv_proj"]
    assert kinds["layers.0.linear_attn.out_proj"] == (case not in ("qwen35", "qwen35moe"))  # a value head of 8 columns is a quarter block
    if case in ("qwen3next", "qwen35moe"):
        assert kinds["layers.0.mlp.experts.1.gate_up_proj"] and kinds["layers.2.mlp.shared_experts.gate_up_proj"]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("case", ["qwen35", "qwen3next", "qwen35moe"])
def test_the_engine_on_the_f32_file_decodes_transformers_greedy_tokens(gguf_of, hf_folders, case, scenario):
    options, arrival = SCENARIOS[scenario]
    prompts = _prompts()
    outputs, _ = run_scenario(gguf_of(case), prompts, {"tokenizer_path": hf_folders[case], **options}, arrival, expect_hits=False, max_new_tokens=16)
    original = load_hf_model(hf_folders[case])
    for i, (prompt, ours) in enumerate(zip(prompts, outputs)):
        where = hf_greedy_divergence(original, prompt, ours)
        assert len(ours) == 16 and where is None, f"{case}: prompt {i} ({len(prompt)} tokens) diverged from transformers at token {where}"


def _gaps(model, prompt: list[int], output: list[int]) -> list[float]:
    """How far below its best token each output token's logprob is under ``model``, teacher-forced."""
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    return (logprobs.max(-1).values - logprobs[torch.arange(len(output)), output]).tolist()


@pytest.mark.parametrize("case", ["qwen35_wide", "qwen3next"])
def test_the_engine_on_a_q8_0_file_decodes_the_held_weights_greedy_tokens(gguf_of, hf_folders, as_stored, case, cpp_ext):
    """Dequantized (``--quantization none``): transformers' greedy tokens on the weights the file
    holds. As stored: tokens those weights rank best but for near-ties the kernels' 8-bit
    activations may break the other way (these tiny models' best two tokens are ~0.3 nats apart
    at the median, a random token ~5 nats below the best)."""
    path, options, arrival = gguf_of(case, "Q8_0"), *SCENARIOS["mixed_batch_chunked_16"]
    prompts = _prompts()
    held = load_hf_model(as_stored(case, "Q8_0"))
    dense, _ = run_scenario(path, prompts, {"tokenizer_path": hf_folders[case], "quantization": "none", **options}, arrival, expect_hits=False, max_new_tokens=16)
    for prompt, ours in zip(prompts, dense):
        assert hf_greedy_divergence(held, prompt, ours) is None, (prompt, ours)
    native, rt = run_scenario(path, prompts, {"tokenizer_path": hf_folders[case], **options}, arrival, expect_hits=False, max_new_tokens=16)
    assert any(isinstance(m, GGUFLinear) for m in rt.runner.model.modules())
    gaps = [g for prompt, ours in zip(prompts, native) for g in _gaps(held, prompt, ours)]
    assert max(gaps) < 1.0 and sum(g == 0 for g in gaps) >= 0.8 * len(gaps), str([round(g, 3) for g in gaps])


SSM = {"ssm.conv_kernel": 4, "ssm.state_size": 16, "ssm.group_count": 2, "ssm.time_step_rank": 4, "ssm.inner_size": 32, "rope.dimension_count": 4}
RULES = {
    # case: (arch, metadata, layers, what the config says)
    "recurrent layers as the file marks them": ("qwen35", {**SSM, "attention.recurrent_layers": [True, False, True, True]}, 4,
                                                {"layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"]}),
    "no marks: the last of every full_attention_interval layers attends": ("qwen35", {**SSM, "full_attention_interval": 2}, 4,
                                                                           {"layer_types": ["linear_attention", "full_attention"] * 2}),
    "no interval either: every fourth": ("qwen35", SSM, 8, {"layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2}),
    "MTP layers after the model's are not the model's": ("qwen35", {**SSM, "nextn_predict_layers": 1, "attention.recurrent_layers": [True, True, True, False, False]}, 5,
                                                         {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}),
    "value heads as wide as the inner size says": ("qwen35", {**SSM, "ssm.inner_size": 64}, 4,
                                                   {"linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_value_heads": 4}),
    "RoPE over part of a head, the head from key_length": ("qwen35", {**SSM, "attention.key_length": 32}, 4,
                                                           {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125}}),
    "without key_length the head is hidden / heads, not the rotated part": ("qwen35", {**SSM, "attention.key_length": None}, 4,
                                                                            {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}),
    "qwen3next: the shared expert's width": ("qwen3next", {**SSM, "expert_count": 4, "expert_used_count": 2, "expert_shared_feed_forward_length": 96}, 4,
                                             {"shared_expert_intermediate_size": 96, "num_experts": 4, "mlp_only_layers": [], "norm_topk_prob": True}),
}  # fmt: skip


@pytest.mark.parametrize("case", ["qwen35moe", "qwen3next"])
def test_the_decode_stack_runs_hybrid_experts_and_their_shared_expert_as_the_python_path_does(gguf_of, hf_folders, case, cpp_ext):
    """Gated DeltaNet layers with routed experts and a gated shared expert (Qwen3.5-MoE, Qwen3-Next)
    from a Q8_0 file in the fused C++ decode stack: one row and several give the Python layers'
    logits bit for bit."""
    path = gguf_of(case, "Q8_0")
    for prompts in ([[5, 17, 33, 40, 8]], [[5, 17, 33, 40, 8], [101, 7, 250, 12], [9, 300, 64]]):
        _, _, fused, ran = decode_with_stack(path, prompts, True, tokenizer_path=hf_folders[case])
        _, _, plain, ran_plain = decode_with_stack(path, prompts, False, tokenizer_path=hf_folders[case])
        assert ran >= 9 and ran_plain == 0
        assert_same_logits(fused, plain)


@pytest.mark.parametrize("case", list(RULES))
def test_llama_cpp_rules_for_hybrids(tmp_path, case):
    arch, kv, layers, want = RULES[case]
    cfg = gguf_hf_config(metadata_gguf(tmp_path / "m.gguf", arch, kv, layers))
    assert {k: cfg.get(k) for k in want} == want


def test_qwen3next_without_experts_is_refused(tmp_path):
    with pytest.raises(ValueError, match=re.escape("without qwen3next.expert_count")):
        gguf_hf_config(metadata_gguf(tmp_path / "m.gguf", "qwen3next", SSM))
