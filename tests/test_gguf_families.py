"""GGUF files of Qwen3, Gemma 2, Gemma 3 (text), Phi-3 and SmolLM3, written as llama.cpp's
converter writes them, open as the Hugging Face checkpoints they came from: the config that
transformers' own config class builds from ours equals the original's, every tensor equals the
original state dict's (a Q8_0 one after dequantizing), transformers reading the same file gets
the same logits, and our engine on the file decodes transformers' greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_files import dequantize, metadata_gguf, quantize, write_family_gguf

import radixlm
from helpers import hf_greedy_divergence, load_hf_model, make_tokenizer
from radixlm.runtime.checkpoints import open_checkpoint
from radixlm.runtime.checkpoints.gguf import gguf_hf_config
from radixlm.runtime.checkpoints.gguf_names import gguf_to_hf_name
from radixlm.runtime.layers.gguf_linear import GGUFWeight
from radixlm.runtime.models.registry import supported_architectures

FAMILIES = ("qwen3", "gemma2", "gemma3", "phi3", "smollm3")
TRANSFORMERS_READS = ("qwen3", "gemma2", "gemma3", "phi3")  # transformers' GGUF loader has no smollm3
Q8_0 = ("blk.0.ffn_down.weight", "blk.1.attn_qkv.weight")  # the blocks path, a fused Phi-3 one too
WINDOW = 8  # sliding windows the prompts below outrun
PROMPTS = [[5, 17, 33, 40, 8, 91, 150, 3, 77, 12, 300, 45], [101, 7, 250, 12, 9, 300, 64, 65, 66, 67, 200, 18, 19, 44]]


def _config(arch: str, vocab: int):
    """Each family's tiny config, its own pieces switched on with values llama.cpp can store."""
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config, Qwen3Config, SmolLM3Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)  # fmt: skip
    if arch == "qwen3":  # head_dim apart from hidden / heads
        return Qwen3Config(num_hidden_layers=2, head_dim=32, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **common)  # fmt: skip
    if arch == "gemma2":  # llama.cpp scales queries by head_dim (27B aside), alternates 1:1
        return Gemma2Config(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                            attn_logit_softcapping=2.0, final_logit_softcapping=4.0, **common)  # fmt: skip
    if arch == "gemma3":  # five sliding layers to one global; local base apart from llama.cpp's default
        return Gemma3TextConfig(
            num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, final_logit_softcapping=4.0,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
            **common,
        )  # fmt: skip
    if arch == "phi3":  # longrope past its original context, rotating 3/4 of each head, a window
        half = int(16 * 0.75) // 2
        return Phi3Config(
            num_hidden_layers=2, pad_token_id=0, sliding_window=WINDOW, original_max_position_embeddings=1024,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                             "short_factor": [1.0 + 0.25 * i for i in range(half)], "long_factor": [4.0] * half},
            **common,
        )  # fmt: skip
    return SmolLM3Config(num_hidden_layers=4, pad_token_id=0, **common)  # layer 3 without RoPE


def _make_hf(arch: str, folder: Path) -> str:
    """A tiny random checkpoint of ``arch`` saved by transformers, with a tokenizer. Gemma norm
    weights are bf16 values (as Gemma ships them), for which llama.cpp's ``1 + w`` in float32 is exact."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) + 3
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(_config(arch, vocab), torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif "gemma" in arch:
                p.normal_(0, 0.3)
                p.copy_(torch.where(p.abs() < 2**-8, 2**-8, p).bfloat16().float())
            else:
                p.normal_(1, 0.3)
    model.save_pretrained(str(folder), safe_serialization=True)
    return str(folder)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny Hugging Face checkpoints, one a family."""
    root = tmp_path_factory.mktemp("families_hf")
    return {arch: _make_hf(arch, root / arch) for arch in FAMILIES}


@pytest.fixture(scope="module")
def gguf_of(hf_folders, tmp_path_factory):
    """``gguf_of(arch, mixed)``: the family's GGUF file, all F32 or (mixed) with the Q8_0 tensors."""
    root = tmp_path_factory.mktemp("families_gguf")
    made: dict[tuple[str, bool], str] = {}

    def make(arch: str, mixed: bool = True) -> str:
        if (arch, mixed) not in made:
            out = root / f"{arch}-{'mixed' if mixed else 'f32'}.gguf"
            made[arch, mixed] = str(write_family_gguf(hf_folders[arch], out, lambda n: "Q8_0" if mixed and n in Q8_0 else "F32"))
        return made[arch, mixed]

    return make


def _hf_config_class(arch: str):
    import transformers

    return {"qwen3": transformers.Qwen3Config, "gemma2": transformers.Gemma2Config, "gemma3": transformers.Gemma3TextConfig,
            "phi3": transformers.Phi3Config, "smollm3": transformers.SmolLM3Config}[arch]  # fmt: skip


def _comparable(config) -> dict:
    skip = {"transformers_version", "_name_or_path", "dtype", "torch_dtype"}
    return {k: v for k, v in config.to_dict().items() if k not in skip}


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_config_is_the_hf_config(gguf_of, hf_folders, arch):
    ours = gguf_hf_config(gguf_of(arch))
    original = json.loads((Path(hf_folders[arch]) / "config.json").read_text())
    cls = _hf_config_class(arch)
    assert _comparable(cls(**ours)) == _comparable(cls(**original))
    for key, value in ours.items():  # what we name, we name as HF does, with HF's value
        if key in original:
            assert value == original[key], key
    cfg = open_checkpoint(gguf_of(arch)).config
    assert cfg.architecture == supported_architectures()[original["architectures"][0]]


def _expected(arch: str, hf_folder: str) -> dict[str, torch.Tensor]:
    """The HF state dict, with the Q8_0 tensors as their dequantized blocks."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(hf_folder) / "model.safetensors"))
    for name in Q8_0:
        hf = gguf_to_hf_name(name, arch)
        if hf in tensors:
            tensors[hf] = torch.from_numpy(dequantize(quantize(tensors[hf].numpy(), "Q8_0"), "Q8_0").copy())
    return tensors


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_tensor_is_the_hf_tensor(gguf_of, hf_folders, arch):
    path = gguf_of(arch)
    want = _expected(arch, hf_folders[arch])
    checkpoint = open_checkpoint(path)
    plain = dict(checkpoint.plain())
    assert set(plain) | set(checkpoint.stored) == set(want)
    assert checkpoint.stored and all(isinstance(w, GGUFWeight) and w.format == "gguf:Q8_0" for w in checkpoint.stored.values())
    for name, weight in checkpoint.stored.items():
        assert torch.equal(weight.dequantize().float(), want[name]), name
    for name, tensor in plain.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, want[name]), name
    dense = dict(open_checkpoint(path, native=False).plain())  # dequantized once, into the disk cache
    assert set(dense) == set(want) and all(torch.equal(dense[n][:], want[n]) for n in want)


@pytest.mark.parametrize("arch", TRANSFORMERS_READS)
def test_transformers_reading_the_file_gets_the_original_logits(gguf_of, hf_folders, arch):
    """transformers' own GGUF reader (names, Gemma's ``- 1``, fused Phi-3 tensors) on the F32 file,
    given the original config (its GGUF config reader drops soft-caps, local RoPE, longrope and
    Qwen3's head_dim), computes the original model's logits: the writer is llama.cpp's layout."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(gguf_of(arch, mixed=False))
    config = AutoConfig.from_pretrained(hf_folders[arch])
    from_gguf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config, torch_dtype=torch.float32).eval()
    original = load_hf_model(hf_folders[arch])
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        torch.testing.assert_close(from_gguf(ids).logits, original(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_engine_on_the_gguf_decodes_transformers_greedy_tokens(gguf_of, hf_folders, arch):
    path = gguf_of(arch, mixed=False)
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(model_path=path, tokenizer_path=hf_folders[arch], max_total_tokens=512) as engine:
        outputs = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in PROMPTS]
    original = load_hf_model(hf_folders[arch])
    for prompt, output in zip(PROMPTS, outputs):
        assert len(output) == 12 and hf_greedy_divergence(original, prompt, output) is None, (prompt, output)


RULES = {
    # case: (arch, metadata, layers, what the config says)
    "gemma3 without a window: every layer global": ("gemma3", {}, 6, {"sliding_window": None, "layer_types": ["full_attention"] * 6}),
    "gemma3 pattern key, a count": ("gemma3", {"attention.sliding_window": 512, "attention.sliding_window_pattern": 3}, 6,
                                    {"layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}),
    "gemma3 pattern key, per layer": ("gemma3", {"attention.sliding_window": 512, "attention.sliding_window_pattern": [True, False, False]}, 3,
                                      {"layer_types": ["sliding_attention", "full_attention", "full_attention"]}),
    "gemma3 27B scales queries by hidden / heads": ("gemma3", {"attention.sliding_window": 1024, "attention.key_length": 32}, 62,
                                                     {"query_pre_attn_scalar": 16, "head_dim": 32}),
    "gemma3 local RoPE base defaults to 10000": ("gemma3", {"rope.freq_base": 1000000.0}, 2,
                                                 {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                                      "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}),
    "gemma2 defaults: window 4096, soft-caps 50 and 30": ("gemma2", {}, 2, {"sliding_window": 4096, "attn_logit_softcapping": 50.0,
                                                                            "final_logit_softcapping": 30.0, "tie_word_embeddings": True}),
    "gemma2 27B scales queries by hidden / heads": ("gemma2", {"attention.key_length": 32}, 46, {"query_pre_attn_scalar": 16, "head_dim": 32}),
    "gemma2 other sizes scale by head_dim": ("gemma2", {"attention.key_length": 32}, 42, {"query_pre_attn_scalar": 32}),
    "qwen3 yarn": ("qwen3", {"rope.freq_base": 1000000.0, "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                             "rope.scaling.original_context_length": 32768}, 2,
                   {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0, "original_max_position_embeddings": 32768}}),
    "phi3 partial rotary without longrope": ("phi3", {"rope.dimension_count": 12, "context_length": 4096}, 2,
                                             {"original_max_position_embeddings": 4096, "sliding_window": None,
                                              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}}),
    "smollm3 every fourth layer without RoPE": ("smollm3", {}, 8, {"no_rope_layers": [1, 1, 1, 0, 1, 1, 1, 0]}),
    "end of turn ends generation too": ("qwen3", {"tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 7}, 2, {"eos_token_id": [2, 7]}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(RULES))
def test_llama_cpp_rules_where_the_file_says_nothing(tmp_path, case):
    arch, kv, layers, want = RULES[case]
    cfg = gguf_hf_config(metadata_gguf(tmp_path / "m.gguf", arch, kv, layers))
    assert {k: cfg.get(k) for k in want} == want


def test_an_architecture_we_do_not_map_is_named(tmp_path):
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'"):
        gguf_hf_config(metadata_gguf(tmp_path / "m.gguf", "gemma", {}))
