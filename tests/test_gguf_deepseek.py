"""GGUF files of DeepSeek-V2 and V3 (llama.cpp's ``deepseek2``), written as llama.cpp's converter
writes them (``write_deepseek_gguf``: ``kv_b_proj`` split per head into ``attn_k_b``, transposed,
and ``attn_v_b``, or whole as files from before the split; experts merged; MLA as one KV head),
open as the Hugging Face checkpoints they came from: the config transformers' config class builds
from ours is the original's; every tensor is the original's (a Q8_0 one dequantized, rounded once;
``kv_b_proj`` rebuilt); the quantized projections run as stored, their interleaved RoPE rows moved
as the plain tensors' are; and our engine on the file decodes the greedy tokens transformers
computes on the Hugging Face folder (transformers does not read these files).

The tiny checkpoints have V2-Lite's layout (a plain ``q_proj``, softmax routing over the best
groups by their best expert) and V3's (compressed queries, sigmoid routing with a nonzero
correction bias, groups by their best two), YaRN whose ``mscale`` equals ``mscale_all_dim`` (the
file keeps only the latter), and a nope part of one Q8_0 block so ``attn_k_b`` quantizes.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import (
    KV_B_FORMS,
    deepseek_gguf_layout,
    deepseek_type,
    dequantize,
    metadata_gguf,
    quantize,
    write_deepseek_gguf,
)

import radixlm
from helpers import hf_greedy_divergence, load_hf_model, make_tokenizer
from radixlm.runtime.checkpoints import open_checkpoint
from radixlm.runtime.checkpoints.gguf import gguf_hf_config
from radixlm.runtime.layers.gguf_linear import GGUFLinear, GGUFWeight

FAMILIES = ("deepseek_v2", "deepseek_v3")
FILES = [("deepseek_v2", "F32", "split"), ("deepseek_v3", "F32", "split"), ("deepseek_v3", "F32", "whole"),
         ("deepseek_v2", "Q8_0", "split"), ("deepseek_v3", "Q8_0", "split"), ("deepseek_v2", "Q8_0", "whole")]  # fmt: skip
PROMPTS = [[5, 17, 33, 40, 8, 91, 150, 3, 77, 12, 300, 45], [101, 7, 250, 12, 9, 300, 64, 65, 66, 67, 200, 18, 19, 44]]
CPU = torch.device("cpu")


def _config(family: str, vocab: int):
    """Tiny configs as the published ones are (``scoring_func``, ``topk_method`` named; YaRN's two
    mscales equal), with nope heads one Q8_0 block wide and values wider than the RoPE part."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24,
                  moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                  first_k_dense_replace=1, n_group=4, topk_group=2)  # fmt: skip
    if family == "deepseek_v2":  # V2-Lite's attention; V2's grouped softmax routing
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 0.707}
        return DeepseekV2Config(q_lora_rank=None, scoring_func="softmax", topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                                rope_parameters=yarn, **common)  # fmt: skip
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.8, "mscale_all_dim": 0.8,
            "beta_fast": 32, "beta_slow": 1}  # fmt: skip
    return DeepseekV3Config(q_lora_rank=64, scoring_func="sigmoid", topk_method="noaux_tc", routed_scaling_factor=2.5, rope_parameters=yarn, **common)


def _make_hf(family: str, folder: Path) -> str:
    """A tiny random checkpoint saved by transformers, with a tokenizer; V3's correction bias large
    enough to change which experts win."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) + 3
    torch.manual_seed(17)
    model = AutoModelForCausalLM.from_config(_config(family, vocab), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # matrices, and experts stacked as [experts, rows, columns]; norms around 1
            if p.dim() >= 2:
                p.normal_(0, 0.2)
            else:
                p.normal_(1, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.5)
    model.save_pretrained(str(folder), safe_serialization=True)
    return str(folder)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("deepseek_hf")
    return {family: _make_hf(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def gguf_of(hf_folders, tmp_path_factory):
    """``gguf_of(family, outtype, kv_b)``: the family's GGUF file, at ``--outtype`` F32 or Q8_0, kv_b split or whole."""
    root = tmp_path_factory.mktemp("deepseek_gguf")
    made: dict[tuple[str, str, str], str] = {}

    def make(family: str, outtype: str = "F32", kv_b: str = "split") -> str:
        if (family, outtype, kv_b) not in made:
            out = root / f"{family}-{outtype}-{kv_b}.gguf"
            made[family, outtype, kv_b] = str(write_deepseek_gguf(hf_folders[family], out, lambda n: outtype, kv_b))
        return made[family, outtype, kv_b]

    return make


def _hf_tensors(hf_folder: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, the correction bias (a buffer) included."""
    from safetensors.torch import load_file

    return load_file(str(Path(hf_folder) / "model.safetensors"))


def _expected(hf_folder: str, outtype: str, kv_b: str) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The HF tensors as the file holds them (each element rounded as its GGUF tensor's type rounds
    it), and the names whose GGUF tensor is quantized. Where the converter put each element is
    found by laying out element indices as it lays out values (``deepseek_gguf_layout``)."""
    cfg = json.loads((Path(hf_folder) / "config.json").read_text())
    tensors = {n: t.numpy() for n, t in _hf_tensors(hf_folder).items()}
    index, total = {}, 0
    for name, t in tensors.items():
        index[name] = np.arange(total, total + t.size).reshape(t.shape)
        total += t.size
    where = deepseek_gguf_layout(cfg, index, kv_b)
    values = np.full(total, np.nan, np.float32)
    quantized_elements = np.zeros(total, bool)
    for gname, arr in deepseek_gguf_layout(cfg, tensors, kv_b).items():
        qtype = deepseek_type(gname, arr, outtype)
        if qtype == "F16":
            arr = arr.astype(np.float16).astype(np.float32)
        elif qtype != "F32":
            arr = dequantize(quantize(arr.reshape(-1, arr.shape[-1]), qtype), qtype).reshape(arr.shape)
            quantized_elements[where[gname].reshape(-1)] = True
        values[where[gname].reshape(-1)] = arr.reshape(-1)
    assert not np.isnan(values).any(), "an element the file does not hold"
    want = {n: torch.from_numpy(values[index[n]]) for n in tensors}
    return want, {n for n in tensors if quantized_elements[index[n]].all()}


def _comparable(config) -> dict:
    skip = {"transformers_version", "_name_or_path", "dtype", "torch_dtype"}
    return {k: v for k, v in config.to_dict().items() if k not in skip}


@pytest.mark.parametrize("kv_b", KV_B_FORMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_config_is_the_hf_config(gguf_of, hf_folders, family, kv_b):
    import transformers

    ours = gguf_hf_config(gguf_of(family, kv_b=kv_b))
    original = json.loads((Path(hf_folders[family]) / "config.json").read_text())
    cls = transformers.DeepseekV2Config if family == "deepseek_v2" else transformers.DeepseekV3Config
    assert _comparable(cls(**ours)) == _comparable(cls(**original))
    for key, value in ours.items():  # what we name, we name as HF does, with HF's value
        if key in original:
            assert value == original[key], key
    cfg = open_checkpoint(gguf_of(family, kv_b=kv_b)).config
    assert cfg.architecture == family and cfg.mla.rope_interleave and cfg.mla.qk_nope_head_dim == 32
    router = cfg.moe.router
    assert (router.scoring, router.group_score, router.correction_bias) == (("softmax", "max", False) if family == "deepseek_v2" else ("sigmoid", "top2_sum", True))
    assert cfg.moe.sparse_layers == (False, True) and cfg.moe.shared_intermediate_size == 32


@pytest.mark.parametrize("family,outtype,kv_b", FILES)
def test_every_tensor_is_the_hf_tensor(gguf_of, hf_folders, family, outtype, kv_b):
    """Plain tensors (``kv_b_proj`` rebuilt, routers, norms) equal the originals as the file rounds
    them; a quantized one's blocks dequantize to them; and so does the file dequantized once."""
    path = gguf_of(family, outtype, kv_b)
    want, quantized = _expected(hf_folders[family], outtype, kv_b)
    checkpoint = open_checkpoint(path)
    plain = dict(checkpoint.plain())
    assert set(plain) | set(checkpoint.stored) == set(want)
    kv_b_names = {n for n in want if n.endswith("kv_b_proj.weight")}
    assert set(checkpoint.stored) == quantized - kv_b_names and kv_b_names <= set(plain)
    if outtype == "Q8_0":
        assert any(".experts." in n for n in quantized) and any("q_proj" in n or "q_b_proj" in n for n in quantized)
        assert kv_b_names <= quantized  # (k_b's and v_b's blocks, dequantized to rebuild it)
    for name, weight in checkpoint.stored.items():
        assert isinstance(weight, GGUFWeight) and weight.format == "gguf:Q8_0", name
        assert torch.equal(weight.dequantize().float(), want[name]), name
    for name, tensor in plain.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, want[name]), name
    dense = dict(open_checkpoint(path, native=False).plain())  # dequantized once, into the disk cache
    assert set(dense) == set(want) and all(torch.equal(dense[n][:], want[n]) for n in want)


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the GGUF kernels see it: 8 bits per block of 32 (scale max |x| / 127)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / torch.where(scale > 0, scale, 1)) * scale).reshape(x.shape)


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_projections_run_as_stored(gguf_of, family, cpp_ext):
    """Each Q8_0 projection runs over its blocks and computes the dequantized model's product (the
    query's and ``kv_a_proj_with_mqa``'s RoPE rows of blocks reordered as the plain rows are); the
    rebuilt ``kv_b_proj`` and the routers are the dequantized model's."""
    from radixlm.runtime.loader import load_model

    path = gguf_of(family, "Q8_0")
    native, _ = load_model(path, torch.float32, CPU)
    dense, _ = load_model(path, torch.float32, CPU, native=False)
    gen = torch.Generator().manual_seed(0)
    kinds = {}
    for name, layer in native.named_modules():
        if not name.endswith(("_proj", "_mqa", "lm_head")) or name.endswith("kv_b_proj"):
            continue
        ref = dense.get_submodule(name)
        kinds[name] = isinstance(layer, GGUFLinear)
        x = torch.randn(3, ref.in_features, generator=gen)
        if kinds[name]:
            exact = _int8_rounded(x).double() @ ref.weight.double().t()
            torch.testing.assert_close(layer(x).double(), exact, atol=2e-4 * exact.abs().max().item(), rtol=1e-4, msg=name)
        else:
            assert torch.equal(layer.weight, ref.weight), name
    query = "q_proj" if family == "deepseek_v2" else "q_b_proj"
    for name in (f"layers.0.self_attn.{query}", "layers.1.self_attn.kv_a_proj_with_mqa", "layers.0.self_attn.o_proj",
                 "layers.0.mlp.gate_up_proj", "layers.1.mlp.experts.5.down_proj", "layers.1.mlp.shared_experts.gate_up_proj", "lm_head"):  # fmt: skip
        assert kinds[name], name
    for i in range(2):
        assert torch.equal(native.layers[i].self_attn.kv_b_proj.weight, dense.layers[i].self_attn.kv_b_proj.weight)
    assert torch.equal(native.layers[1].mlp.router.weight, dense.layers[1].mlp.router.weight)


@pytest.mark.parametrize("family,kv_b", [("deepseek_v2", "split"), ("deepseek_v3", "split"), ("deepseek_v3", "whole")])
def test_the_engine_on_the_gguf_decodes_transformers_greedy_tokens(gguf_of, hf_folders, family, kv_b):
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(model_path=gguf_of(family, kv_b=kv_b), tokenizer_path=hf_folders[family], max_total_tokens=512) as engine:
        outputs = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in PROMPTS]
    original = load_hf_model(hf_folders[family])
    for prompt, output in zip(PROMPTS, outputs):
        assert len(output) == 12 and hf_greedy_divergence(original, prompt, output) is None, (prompt, output)


def test_the_engine_on_a_q8_0_file_runs_its_blocks(gguf_of, hf_folders, tmp_path, cpp_ext):
    """On a Q8_0 file the engine keeps the blocks and decodes the tokens transformers ranks best on
    the weights the file holds, but for near-ties its kernels' 8-bit activations may break the
    other way."""
    from safetensors.torch import save_file

    family = "deepseek_v3"
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(model_path=gguf_of(family, "Q8_0"), tokenizer_path=hf_folders[family], max_total_tokens=512) as engine:
        outputs = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in PROMPTS]
        assert sum(isinstance(m, GGUFLinear) for m in engine.runner.model.modules()) > 20
    held = tmp_path / "held"
    shutil.copytree(hf_folders[family], held)
    want, _ = _expected(hf_folders[family], "Q8_0", "split")
    save_file({n: t.contiguous() for n, t in want.items()}, str(held / "model.safetensors"))
    model = load_hf_model(str(held))
    gaps = []
    with torch.no_grad():
        for prompt, output in zip(PROMPTS, outputs):
            logprobs = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
            gaps += (logprobs.max(-1).values - logprobs[torch.arange(len(output)), output]).tolist()
    assert max(gaps) < 1.0 and sum(g == 0 for g in gaps) >= 0.8 * len(gaps), str([round(g, 3) for g in gaps])


DS_KEYS = {"feed_forward_length": 128, "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32, "expert_shared_count": 1,
           "leading_dense_block_count": 1, "attention.kv_lora_rank": 32, "attention.key_length": 48, "attention.value_length": 32,
           "attention.key_length_mla": 48, "attention.value_length_mla": 24, "rope.dimension_count": 16}  # fmt: skip
RULES = {
    # case: (metadata over DS_KEYS, layers, what the config says)
    "no gating function: softmax (llama.cpp's default), V2": ({}, 2, {"architectures": ["DeepseekV2ForCausalLM"], "topk_method": "greedy", "n_group": 1}),
    "sigmoid routing is V3's": ({"expert_gating_func": 2, "expert_group_count": 4, "expert_group_used_count": 2, "expert_weights_norm": True}, 2,
                                {"model_type": "deepseek_v3", "topk_method": "noaux_tc", "n_group": 4, "topk_group": 2, "norm_topk_prob": True}),
    "softmax over several groups: V2's group-limited greedy": ({"expert_gating_func": 1, "expert_group_count": 4, "expert_group_used_count": 2}, 2,
                                                               {"model_type": "deepseek_v2", "topk_method": "group_limited_greedy", "routed_scaling_factor": 1.0}),
    "the heads' widths from the _mla keys": ({}, 2, {"qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 24, "head_dim": 16,
                                                     "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None}),
    "a legacy file: the heads' widths in key_length and value_length": ({"attention.key_length_mla": None, "attention.value_length_mla": None,
                                                                         "attention.value_length": 24}, 2,
                                                                        {"qk_nope_head_dim": 32, "v_head_dim": 24}),
    "MTP layers after the model's are not the model's": ({"nextn_predict_layers": 1}, 3, {"num_hidden_layers": 2}),
    "YaRN's mscale from the log multiplier": ({"rope.scaling.type": "yarn", "rope.scaling.factor": 40.0, "rope.scaling.original_context_length": 4096,
                                              "rope.scaling.yarn_log_multiplier": 0.0707}, 2,
                                             {"rope_parameters": {"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0, "original_max_position_embeddings": 4096,
                                                                  "mscale": 0.707, "mscale_all_dim": 0.707}}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(RULES))
def test_llama_cpp_rules_for_deepseek(tmp_path, case):
    kv, layers, want = RULES[case]
    cfg = gguf_hf_config(metadata_gguf(tmp_path / "m.gguf", "deepseek2", {**DS_KEYS, **kv}, layers))
    assert {k: cfg.get(k) for k in want} == want


REFUSED = {
    "without the latent rank": ({"attention.kv_lora_rank": None}, "without deepseek2.attention.kv_lora_rank"),
    "without the RoPE width": ({"rope.dimension_count": None}, "without deepseek2.rope.dimension_count"),
    "without the shared experts' count": ({"expert_shared_count": None}, "without deepseek2.expert_shared_count"),
    "without the experts' width": ({"expert_feed_forward_length": None}, "without deepseek2.expert_feed_forward_length"),
    "without experts": ({"expert_count": None}, "without deepseek2.expert_count"),
    "a key width for the heads without a value width": ({"attention.value_length_mla": None}, "without deepseek2.attention.value_length_mla"),
    "a legacy file without the heads' value width": ({"attention.key_length_mla": None, "attention.value_length_mla": None, "attention.value_length": None},
                                                     "without deepseek2.attention.value_length"),
    "a router llama.cpp scores otherwise": ({"expert_gating_func": 3}, "deepseek2.expert_gating_func is 3"),
    "a query temperature (not DeepSeek's)": ({"attention.temperature_scale": 0.1}, "deepseek2.attention.temperature_scale"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_is_refused_is_named(tmp_path, case):
    kv, message = REFUSED[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        gguf_hf_config(metadata_gguf(tmp_path / "m.gguf", "deepseek2", {**DS_KEYS, **kv}))
