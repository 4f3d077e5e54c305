"""GGUF files of GPT-OSS (llama.cpp's ``gpt-oss``), written as llama.cpp's converter writes them,
open as the Hugging Face checkpoint they came from: the config, every tensor (gate and up split out
of the interleaved stacked experts, biases, router, sinks), Q8_0 and MXFP4 experts kept as blocks
the C++ kernels run; and our engine on the file decodes transformers' greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_files import dequantize, quantize, write_family_gguf

import radixlm
from helpers import hf_greedy_divergence, load_hf_model, make_tokenizer
from radixlm.runtime.checkpoints import open_checkpoint
from radixlm.runtime.checkpoints.gguf import gguf_hf_config
from radixlm.runtime.layers.gguf_linear import GGUFWeight
from radixlm.runtime.models.gpt_oss import GptOssForCausalLM

PROMPTS = [[5, 17, 33, 40, 8, 91, 150, 3, 77, 12, 300, 45], [101, 7, 250, 12, 9, 300, 64, 65, 66, 67, 200, 18, 19, 44]]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random GPT-OSS saved by transformers: the values llama.cpp assumes where its files
    say nothing (SwiGLU clamp 7, YaRN, a window on every other layer), weights wide enough that
    the clamp bites."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    folder = tmp_path_factory.mktemp("gpt_oss_hf")
    make_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) + 3
    cfg = GptOssConfig(vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.3)
            elif p.dim() >= 2:
                p.normal_(0, 0.5 if ".experts." in name else 0.2)
            else:
                p.normal_(1, 0.2)
    model.save_pretrained(str(folder), safe_serialization=True)
    return str(folder)


@pytest.fixture(scope="module")
def gguf_of(hf_folder, tmp_path_factory):
    """``gguf_of(experts)``: the file with its experts in GGML type ``experts`` (the rest F32)."""
    root = tmp_path_factory.mktemp("gpt_oss_gguf")
    made: dict[str, str] = {}

    def make(experts: str = "F32") -> str:
        if experts not in made:
            made[experts] = str(write_family_gguf(hf_folder, root / f"{experts}.gguf", lambda n: experts if "_exps" in n else "F32"))
        return made[experts]

    return make


def _hf_tensors(hf_folder: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as our GPT-OSS model takes them (stacked experts cut per expert)."""
    from safetensors.torch import load_file

    model = object.__new__(GptOssForCausalLM)  # checkpoint_tensors reads only the class's arch
    loaded = load_file(str(Path(hf_folder) / "model.safetensors"))
    return dict(model.checkpoint_tensors(iter(loaded.items())))


def test_the_config_is_the_hf_config(gguf_of, hf_folder):
    from transformers import GptOssConfig

    ours = gguf_hf_config(gguf_of())
    original = json.loads((Path(hf_folder) / "config.json").read_text())
    skip = {"transformers_version", "_name_or_path", "dtype", "torch_dtype"}
    assert {k: v for k, v in GptOssConfig(**ours).to_dict().items() if k not in skip} == {k: v for k, v in GptOssConfig(**original).to_dict().items() if k not in skip}
    cfg = open_checkpoint(gguf_of()).config
    assert cfg.architecture == "gpt_oss" and (cfg.moe.router.num_experts, cfg.moe.router.top_k, cfg.moe.intermediate_size) == (4, 2, 64)


@pytest.mark.parametrize("experts", ["F32", "Q8_0"])
def test_every_tensor_is_the_hf_tensor(gguf_of, hf_folder, experts):
    want = _hf_tensors(hf_folder)
    checkpoint = open_checkpoint(gguf_of(experts))
    plain = dict(checkpoint.plain())
    assert set(plain) | set(checkpoint.stored) == set(want)
    quantized = {n for n in want if ".experts." in n and n.endswith("proj.weight")} if experts == "Q8_0" else set()
    assert set(checkpoint.stored) == quantized
    for name, weight in checkpoint.stored.items():  # the experts' rows of blocks, as stored
        assert isinstance(weight, GGUFWeight) and weight.format == "gguf:Q8_0", name
        assert torch.equal(weight.dequantize().float(), torch.from_numpy(dequantize(quantize(want[name].numpy(), "Q8_0"), "Q8_0").copy())), name
    for name, tensor in plain.items():
        assert torch.equal(tensor.float(), want[name].float()), name


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the GGUF kernels see it: 8 bits per block of 32 (scale max |x| / 127)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / torch.where(scale > 0, scale, 1)) * scale).reshape(x.shape)


@pytest.mark.parametrize("experts", ["Q8_0", "MXFP4"])
def test_quantized_experts_run_as_stored_with_their_biases(gguf_of, hf_folder, experts, cpp_ext):
    """Q8_0 and MXFP4 experts stay the file's blocks (MXFP4 equal to the gguf package's reading of
    them) in GGUF layers that compute the dequantized product plus the expert's bias."""
    from radixlm.runtime.layers.gguf_linear import GGUFLinear
    from radixlm.runtime.loader import load_model

    want = _hf_tensors(hf_folder)
    for name, weight in open_checkpoint(gguf_of(experts)).stored.items():
        assert weight.format == f"gguf:{experts}", name
        ref = torch.from_numpy(dequantize(quantize(want[name].numpy(), experts), experts).copy())
        assert torch.equal(weight.dequantize().float(), ref), name
    native, _ = load_model(gguf_of(experts), torch.float32, torch.device("cpu"))
    dense, _ = load_model(gguf_of(experts), torch.float32, torch.device("cpu"), native=False)
    gen = torch.Generator().manual_seed(0)
    layers = [n for n, m in native.named_modules() if ".experts." in n and n.endswith(("gate_up_proj", "down_proj"))]
    assert len(layers) == 2 * 2 * 4
    for name in layers:
        layer, ref = native.get_submodule(name), dense.get_submodule(name)
        assert isinstance(layer, GGUFLinear) and layer.bias is not None, name
        x = torch.randn(3, ref.in_features, generator=gen)
        exact = _int8_rounded(x).double() @ ref.weight.double().t() + ref.bias.double()
        torch.testing.assert_close(layer(x).double(), exact, atol=2e-4 * exact.abs().max().item(), rtol=1e-4)


@pytest.mark.parametrize("experts", ["F32", "Q8_0", "MXFP4"])
def test_the_engine_on_the_gguf_decodes_transformers_greedy_tokens(gguf_of, hf_folder, experts):
    """F32: transformers' greedy tokens on the Hugging Face folder. Quantized experts: the engine
    runs them as stored (their products checked above)."""
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(model_path=gguf_of(experts), tokenizer_path=hf_folder, max_total_tokens=512) as engine:
        outputs = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in PROMPTS]
    if experts == "F32":
        original = load_hf_model(hf_folder)
        for prompt, output in zip(PROMPTS, outputs):
            assert len(output) == 12 and hf_greedy_divergence(original, prompt, output) is None, (prompt, output)
    else:
        assert all(len(o) == 12 for o in outputs)
