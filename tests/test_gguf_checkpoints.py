"""GGUF checkpoints load as stored: each type's layers compute what the dequantized weights do,
greedy tokens equal the dequantized model's, the embedded default runs its Q4_1 blocks in the
int4 kernels with no second rounding, and the memory a model takes is about its file's size."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import write_gguf
from safetensors.torch import load_file, save_file
from torch import nn

import radixlm
from helpers import make_tiny_model
from radixlm.runtime.checkpoints import open_checkpoint
from radixlm.runtime.layers.gguf_linear import GGUFEmbedding, GGUFLinear, kernel_types
from radixlm.runtime.layers.quantized_linear import Int4Linear
from radixlm.runtime.layers.stored_weight import DequantizedLinear
from radixlm.runtime.loader import load_model, serve_as_stored, stored_formats, weight_bytes

CPU = torch.device("cpu")
# a Q4_K_M-like mix: Q6_K for v and down projections and the head, Q4_K elsewhere
MIXES = {
    "Q4_0": lambda name: "Q4_0",
    "Q4_1": lambda name: "Q4_1",
    "Q5_0": lambda name: "Q5_0",
    "Q5_1": lambda name: "Q5_1",
    "Q8_0": lambda name: "Q8_0",
    "Q4_K": lambda name: "Q4_K",
    "Q6_K": lambda name: "Q6_K",
    "Q4_K_M": lambda name: "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else "Q4_K",
}
PROMPTS = [[5, 17, 33, 40], [101, 7, 250, 12, 9, 300], [64, 65, 66]]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny mistral (untied head, interleaved RoPE rows in GGUF) and qwen2 (tied head, q/k/v
    biases) models wide enough for K-quants' 256-weight blocks."""
    root = tmp_path_factory.mktemp("gguf_hf")
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    folders = {arch: make_tiny_model(arch, root / arch, seed=3, **shape) for arch in ("mistral", "qwen2")}
    for folder in folders.values():  # a gain of ~1 a projection (not 3): rounding is not amplified layer by layer
        file = Path(folder) / "model.safetensors"
        tensors = load_file(str(file))
        save_file({k: t * 0.4 if ".layers." in k and t.dim() == 2 else t for k, t in tensors.items()}, str(file))
    return folders


@pytest.fixture(scope="module")
def gguf_file(hf_models, tmp_path_factory):
    """``gguf_file(arch, mix)``: the tiny model as a GGUF file of that mix (written once)."""
    root = tmp_path_factory.mktemp("gguf_files")
    made: dict[tuple[str, str], str] = {}

    def make(arch: str, mix: str) -> str:
        if (arch, mix) not in made:
            made[arch, mix] = str(write_gguf(hf_models[arch], root / f"{arch}-{mix}.gguf", MIXES[mix]))
        return made[arch, mix]

    return make


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if name.endswith(("_proj", "lm_head"))}


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: 8 bits per block of 32 (scale max |x| / 127)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / torch.where(scale > 0, scale, 1)) * scale).reshape(x.shape)


@pytest.mark.parametrize("mix", list(MIXES))
def test_every_gguf_type_runs_as_stored_and_computes_the_dequantized_product(gguf_file, mix, cpp_ext):
    native, _ = load_model(gguf_file("mistral", mix), torch.float32, CPU)
    dense, _ = load_model(gguf_file("mistral", mix), torch.float32, CPU, native=False)
    want = Int4Linear if mix in ("Q4_0", "Q4_1") else GGUFLinear
    gen = torch.Generator().manual_seed(0)
    for name, layer in _linears(native).items():
        assert isinstance(layer, want), f"{name} is {type(layer).__name__}, not {want.__name__}"
        ref = _linears(dense)[name]
        x = torch.randn(3, ref.in_features, generator=gen)
        got = layer(x)
        exact = _int8_rounded(x).double() @ ref.weight.double().t()  # the kernels' arithmetic, summed in fp64
        torch.testing.assert_close(got.double(), exact, atol=2e-4 * exact.abs().max().item(), rtol=1e-4)
    if mix in ("Q4_0", "Q4_1"):
        return
    assert not any(isinstance(m, nn.Linear) for m in native.modules()), "a dense copy of a stored weight was made"


def greedy_gaps(engine: radixlm.Engine, prompt: list[int], output: list[int]) -> list[float]:
    """For each output token, how far its logprob is below the best token's under ``engine``
    given the same prefix (teacher-forced): zero for the tokens ``engine`` picks itself."""
    params = {"max_new_tokens": 1, "temperature": 0}
    out = engine.generate(input_ids=prompt + output, sampling_params=params, return_logprob=True, logprob_start_len=len(prompt), top_logprobs_num=1)
    meta = out["meta_info"]
    taken = [lp for lp, _, _ in meta["input_token_logprobs"]]
    best = [tops[0][0] for tops in meta["input_top_logprobs"]]
    return [b - t for b, t in zip(best, taken)]


@pytest.mark.parametrize("arch,mix", [("mistral", "Q8_0"), ("mistral", "Q4_K_M"), ("qwen2", "Q4_1"), ("qwen2", "Q6_K")])
def test_greedy_tokens_are_the_dequantized_models_best_up_to_activation_rounding(gguf_file, hf_models, arch, mix):
    """The kernels multiply activations rounded to 8 bits per 32 (as llama.cpp does): where two of
    the dequantized model's logits are closer than that rounding, either may win; elsewhere the
    tokens are the same (a wrong block decoder would pick tokens far from the best)."""
    path = gguf_file(arch, mix)
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(model_path=path, tokenizer_path=hf_models[arch], max_total_tokens=512) as engine:
        runs = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in PROMPTS]
        formats = engine.runner.weight_formats
    assert formats == stored_formats(path) and formats
    with radixlm.Engine(model_path=path, tokenizer_path=hf_models[arch], max_total_tokens=512, quantization="none") as dense:
        assert dense.runner.weight_formats == formats and not any(isinstance(m, GGUFLinear) for m in dense.runner.model.modules())
        gaps = [g for prompt, output in zip(PROMPTS, runs) for g in greedy_gaps(dense, prompt, output)]
    assert max(gaps) < 0.2 and sum(g == 0 for g in gaps) >= 0.9 * len(gaps), str([round(g, 3) for g in gaps])


def test_a_tied_head_and_the_embedding_share_one_copy_of_the_blocks(gguf_file, cpp_ext):
    model, cfg = load_model(gguf_file("qwen2", "Q8_0"), torch.float32, CPU)
    assert cfg.tie_word_embeddings and isinstance(model.embed_tokens, GGUFEmbedding)
    assert isinstance(model.lm_head, GGUFLinear)
    assert model.lm_head.parts[0].data_ptr() == model.embed_tokens.blocks.data_ptr()
    ids = torch.tensor([[0, 5, 399]])
    dense, _ = load_model(gguf_file("qwen2", "Q8_0"), torch.float32, CPU, native=False)
    assert torch.equal(model.embed_tokens(ids), dense.embed_tokens(ids))  # row lookups are exact


def test_the_embedded_default_runs_its_q4_1_blocks_as_stored(smollm2_path, cpp_ext):
    """No second rounding: the int4 tiles hold the file's codes, scales and minimums."""
    from gguf import GGUFReader

    model, _ = load_model(smollm2_path, torch.float32, CPU)
    layer = model.layers[0].mlp.down_proj
    assert isinstance(layer, Int4Linear) and layer.kernel == "cpp"
    reader = GGUFReader(smollm2_path)
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    from gguf.quants import dequantize

    w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
    x = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(1))
    exact = _int8_rounded(x).double() @ w.double().t()
    torch.testing.assert_close(layer(x).double(), exact, atol=2e-4 * exact.abs().max().item(), rtol=1e-4)
    assert isinstance(model.embed_tokens, GGUFEmbedding) and not isinstance(model.lm_head, DequantizedLinear)


def test_weights_take_about_the_files_size(smollm2_path, cpp_ext):
    model, _ = load_model(smollm2_path, torch.float32, CPU)
    size = os.path.getsize(smollm2_path)
    # Q4_1 blocks become tiles of the same bytes; the Q8_0 table and head are one copy
    assert weight_bytes(model) <= 1.1 * size
    dense, _ = load_model(smollm2_path, torch.float32, CPU, native=False)
    assert weight_bytes(dense) > 4 * size


def test_the_served_process_stays_near_the_file_size(smollm2_path, cpp_ext):
    """Resident memory added by loading the model, measured in a fresh process."""
    script = textwrap.dedent(f"""
        import json, os, resource, torch
        from radixlm.kernels.cpu_ext import cpu_kernels
        cpu_kernels()
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        from radixlm.runtime.loader import load_model  # imports before the baseline: the weights are measured
        before = rss()
        model, _ = load_model({smollm2_path!r}, torch.float32, torch.device("cpu"))
        print(json.dumps({{"added": rss() - before, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    size = os.path.getsize(smollm2_path)
    # the fp32 form would add ~540 MB; the rest over the weights (92 MiB) is allocator slack
    assert measured["added"] < 1.25 * size + 40 * 2**20, measured


def test_quantization_flags_on_a_stored_checkpoint(smollm2_path, caplog):
    caplog.set_level(logging.INFO, logger="radixlm.runtime.loader")
    assert serve_as_stored({"gguf:Q4_1"}, None)
    assert serve_as_stored({"gguf:Q4_1"}, "int4")  # int4 of an int4 file: as stored
    assert serve_as_stored(set(), "int8")  # a dense checkpoint: nothing stored to override
    assert not serve_as_stored({"gguf:Q4_K"}, "int4")
    assert not serve_as_stored({"gguf:Q4_1"}, "none")
    assert not serve_as_stored({"fp8"}, "int8")
    assert "second rounding" in caplog.text and "--quantization none" in caplog.text
    assert stored_formats(smollm2_path) == {"gguf:Q4_1"}


def test_a_dequantized_open_has_no_stored_weights(gguf_file):
    path = gguf_file("mistral", "Q4_K")
    assert open_checkpoint(path).formats == {"gguf:Q4_K"}
    dense = open_checkpoint(path, native=False)
    assert dense.formats == set() and dict(dense.plain())["model.layers.0.self_attn.q_proj.weight"][:].dtype == torch.float32


def test_server_info_reports_the_weights_bytes(tiny_client):
    info = tiny_client.get("/get_server_info").json()
    assert info["weight_bytes"] > 0 and info["weight_formats"] == []


def test_gguf_type_names_and_sizes_agree_with_the_gguf_package():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from radixlm.runtime.layers.gguf_linear import KERNEL_TYPES, Q4_Z, block_shape, type_name

    for t in KERNEL_TYPES:
        if t != Q4_Z:
            assert block_shape(t) == GGML_QUANT_SIZES[GGMLQuantizationType(t)]
            assert type_name(t) == GGMLQuantizationType(t).name
    assert type_name(Q4_Z) == "Q4_Z" and block_shape(Q4_Z) == (32, 20)
    assert set(kernel_types()) <= set(KERNEL_TYPES)
    np.testing.assert_equal(len(KERNEL_TYPES), len(set(KERNEL_TYPES)))


def test_stored_weights_that_do_not_fit_a_layer_are_refused_by_name(gguf_file):
    from radixlm.runtime.checkpoints.install import install_stored
    from radixlm.runtime.layers.gguf_linear import Q8_0, GGUFWeight
    from radixlm.runtime.models.registry import family_for

    checkpoint = open_checkpoint(gguf_file("mistral", "Q8_0"))
    cfg = checkpoint.config
    stored = dict(checkpoint.stored)
    name = "model.layers.1.mlp.down_proj.weight"
    good = stored[name]
    stored[name] = GGUFWeight(Q8_0, good.blocks[:, : good.blocks.shape[1] // 2].contiguous(), good.in_features // 2)
    with torch.device("meta"):
        model = family_for(cfg.architecture)(cfg, None, None)
    with pytest.raises(ValueError, match="layers.1.mlp.down_proj"):
        install_stored(model, stored, CPU, torch.float32)
    stored[name] = GGUFWeight(Q8_0, good.blocks[:-4].contiguous(), good.in_features)  # too few rows
    with torch.device("meta"):
        model = family_for(cfg.architecture)(cfg, None, None)
    with pytest.raises(ValueError, match="cover"):
        install_stored(model, stored, CPU, torch.float32)
    with pytest.raises(ValueError, match="take"):
        GGUFWeight(Q8_0, good.blocks[:, :-1], good.in_features)  # rows of the wrong byte length
