"""GGUF files of mixtures of experts, written as llama.cpp's converter writes them (Qwen3-MoE as
``qwen3moe``, Mixtral as ``llama`` with an expert count), open as the Hugging Face checkpoints they
came from: the config that transformers' config class builds from ours equals the original's,
every tensor equals the original's (each expert of a merged [experts, rows, columns] tensor under
its own name; a Q8_0 expert's blocks are the file's bytes and dequantize to the original rounded
once), the quantized experts run as stored, and our engine on the file decodes the greedy tokens
transformers computes on the Hugging Face folder (transformers does not read these files)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import EXPERT_LAYOUTS, dequantize, metadata_gguf, quantize, write_family_gguf

import radixlm
from helpers import (
    assert_same_logits,
    decode_with_stack,
    hf_greedy_divergence,
    load_hf_model,
    make_tokenizer,
)
from radixlm.runtime.checkpoints import open_checkpoint
from radixlm.runtime.checkpoints.gguf import gguf_hf_config
from radixlm.runtime.layers.gguf_linear import GGUFLinear, GGUFWeight

FAMILIES = ("qwen3moe", "mixtral")
# (family, expert layout): today's merged tensors; Mixtral also fused gate/up and one tensor an expert (old files)
LAYOUTS = [("qwen3moe", "merged"), ("mixtral", "merged"), ("mixtral", "fused"), ("mixtral", "per_expert")]
# Q8_0 tensors of each layout (the rest F32): experts of both layers and kinds, and an attention tensor
Q8_0 = {
    "merged": ("blk.0.ffn_down_exps.weight", "blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight", "blk.0.attn_output.weight"),
    "fused": ("blk.0.ffn_gate_up_exps.weight", "blk.1.ffn_down_exps.weight", "blk.0.attn_output.weight"),
    "per_expert": ("blk.0.ffn_down.1.weight", "blk.1.ffn_gate.0.weight", "blk.1.ffn_up.0.weight", "blk.0.attn_output.weight"),
}
PROMPTS = [[5, 17, 33, 40, 8, 91, 150, 3, 77, 12, 300, 45], [101, 7, 250, 12, 9, 300, 64, 65, 66, 67, 200, 18, 19, 44]]
CPU = torch.device("cpu")


def _config(family: str, vocab: int):
    """Tiny configs with values llama.cpp stores: Qwen3-MoE renormalising its top k (llama.cpp always
    does) with experts on every layer; Mixtral without a head_dim (its configs leave it unset)."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})  # fmt: skip
    if family == "qwen3moe":
        return Qwen3MoeConfig(intermediate_size=128, head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64,
                              norm_topk_prob=True, **common)  # fmt: skip
    return MixtralConfig(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, **common)


def _make_hf(family: str, folder: Path) -> str:
    """A tiny random checkpoint saved by transformers 5 (experts in memory as 3-D parameters,
    saved one tensor an expert), with a tokenizer."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) + 3
    torch.manual_seed(13)
    model = AutoModelForCausalLM.from_config(_config(family, vocab), torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # the experts' 3-D parameters too
                p.normal_(0, 0.2)
            else:
                p.normal_(1, 0.3)
    model.save_pretrained(str(folder), safe_serialization=True)
    return str(folder)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe_hf")
    return {family: _make_hf(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def gguf_of(hf_folders, tmp_path_factory):
    """``gguf_of(family, layout, mixed)``: the family's GGUF file, all F32 or (mixed) with the layout's Q8_0 tensors."""
    root = tmp_path_factory.mktemp("moe_gguf")
    made: dict[tuple[str, str, bool], str] = {}

    def make(family: str, layout: str = "merged", mixed: bool = True) -> str:
        key = (family, layout, mixed)
        if key not in made:
            out = root / f"{family}-{layout}-{'mixed' if mixed else 'f32'}.gguf"
            quantized = Q8_0[layout] if mixed else ()
            made[key] = str(write_family_gguf(hf_folders[family], out, lambda n: "Q8_0" if n in quantized else "F32", experts=layout))
        return made[key]

    return make


def _comparable(config) -> dict:
    skip = {"transformers_version", "_name_or_path", "dtype", "torch_dtype"}
    return {k: v for k, v in config.to_dict().items() if k not in skip}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_config_is_the_hf_config(gguf_of, hf_folders, family):
    import transformers

    ours = gguf_hf_config(gguf_of(family))
    original = json.loads((Path(hf_folders[family]) / "config.json").read_text())
    cls = transformers.Qwen3MoeConfig if family == "qwen3moe" else transformers.MixtralConfig
    assert _comparable(cls(**ours)) == _comparable(cls(**original))
    for key, value in ours.items():  # what we name, we name as HF does, with HF's value
        if key in original:
            assert value == original[key], key
    cfg = open_checkpoint(gguf_of(family)).config
    assert cfg.architecture == original["model_type"]
    experts, top_k, width = (8, 3, 64) if family == "qwen3moe" else (4, 2, 128)
    assert (cfg.moe.router.num_experts, cfg.moe.router.top_k, cfg.moe.intermediate_size) == (experts, top_k, width)
    assert cfg.moe.router.renormalize and all(cfg.moe.sparse_layers)


_MIXTRAL_NAMES = [(re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
                  (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
                  (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
                  (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate.")]  # fmt: skip


def _hf_name(name: str) -> str:
    """A checkpoint tensor under the names the GGUF reader gives (Mixtral's ``w1/w2/w3``, ``block_sparse_moe``: ``mlp``)."""
    for pattern, repl in _MIXTRAL_NAMES:
        name = pattern.sub(repl, name)
    return name


def _expert_tensor(gguf_name: str) -> tuple[str, ...]:
    """The HF tensors (layer, expert and projection patterns) a GGUF expert tensor holds."""
    layer, kind = gguf_name.split(".")[1:3]
    if kind.endswith("_exps"):  # merged: every expert
        projs = ("gate_proj", "up_proj") if kind == "ffn_gate_up_exps" else (kind[4:-5] + "_proj",)
        return tuple(rf"model\.layers\.{layer}\.mlp\.experts\.\d+\.{p}\.weight" for p in projs)
    if kind.startswith("ffn_") and gguf_name.split(".")[3].isdigit():  # one expert
        return (rf"model\.layers\.{layer}\.mlp\.experts\.{gguf_name.split('.')[3]}\.{kind[4:]}_proj\.weight",)
    assert kind == "attn_output", gguf_name
    return (rf"model\.layers\.{layer}\.self_attn\.o_proj\.weight",)


def _expected(hf_folder: str, layout: str) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The HF state dict under the reader's names, the Q8_0 tensors as their dequantized blocks, and their names."""
    from safetensors.torch import load_file

    tensors = {_hf_name(k): v for k, v in load_file(str(Path(hf_folder) / "model.safetensors")).items()}
    quantized = {n for n in tensors for g in Q8_0[layout] for p in _expert_tensor(g) if re.fullmatch(p, n)}
    for name in quantized:
        tensors[name] = torch.from_numpy(dequantize(quantize(tensors[name].numpy(), "Q8_0"), "Q8_0").copy())
    return tensors, quantized


@pytest.mark.parametrize("family,layout", LAYOUTS)
def test_every_tensor_is_the_hf_tensor(gguf_of, hf_folders, family, layout):
    path = gguf_of(family, layout)
    want, quantized = _expected(hf_folders[family], layout)
    checkpoint = open_checkpoint(path)
    plain = dict(checkpoint.plain())
    assert set(plain) | set(checkpoint.stored) == set(want)
    assert set(checkpoint.stored) == quantized and any(".experts." in n for n in quantized)
    for name, weight in checkpoint.stored.items():
        assert isinstance(weight, GGUFWeight) and weight.format == "gguf:Q8_0", name
        assert torch.equal(weight.dequantize().float(), want[name]), name
    for name, tensor in plain.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, want[name]), name
    dense = dict(open_checkpoint(path, native=False).plain())  # dequantized once, into the disk cache
    assert set(dense) == set(want) and all(torch.equal(dense[n][:], want[n]) for n in want)


def test_an_experts_blocks_are_the_files_bytes(gguf_of):
    """Each expert's GGUFWeight is its rows of the merged tensor's blocks, not a re-quantization."""
    from gguf import GGUFReader

    path = gguf_of("qwen3moe")
    stored = open_checkpoint(path).stored
    merged = {t.name: np.asarray(t.data) for t in GGUFReader(path).tensors}
    for e in range(8):
        for proj, gguf_name in (("down_proj", "blk.0.ffn_down_exps.weight"), ("gate_proj", "blk.1.ffn_gate_exps.weight")):
            layer = gguf_name.split(".")[1]
            blocks = stored[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"].blocks
            assert torch.equal(blocks, torch.from_numpy(merged[gguf_name][e].copy())), (e, proj)


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the GGUF kernels see it: 8 bits per block of 32 (scale max |x| / 127)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / torch.where(scale > 0, scale, 1)) * scale).reshape(x.shape)


@pytest.mark.parametrize("family,layout", [("qwen3moe", "merged"), ("mixtral", "fused")])
def test_quantized_experts_run_as_stored(gguf_of, family, layout, cpp_ext):
    """The Q8_0 experts become GGUF layers over their blocks that compute the dequantized product;
    the F32 ones and the routers stay plain."""
    from radixlm.runtime.loader import load_model

    native, _ = load_model(gguf_of(family, layout), torch.float32, CPU)
    dense, _ = load_model(gguf_of(family, layout), torch.float32, CPU, native=False)
    gen = torch.Generator().manual_seed(0)
    kinds = {}
    for name, layer in native.named_modules():
        if ".experts." not in name or not name.endswith(("gate_up_proj", "down_proj")):
            continue
        kinds[name] = type(layer).__name__
        ref = dense.get_submodule(name)
        x = torch.randn(3, ref.in_features, generator=gen)
        if isinstance(layer, GGUFLinear):
            exact = _int8_rounded(x).double() @ ref.weight.double().t()
            torch.testing.assert_close(layer(x).double(), exact, atol=2e-4 * exact.abs().max().item(), rtol=1e-4)
        else:
            assert torch.equal(layer.weight, ref.weight), name
    quantized = {n for n, k in kinds.items() if k == "GGUFLinear"}
    want = {"layers.0.mlp.experts.{}.down_proj", "layers.1.mlp.experts.{}.gate_up_proj"} if layout == "merged" else \
           {"layers.0.mlp.experts.{}.gate_up_proj", "layers.1.mlp.experts.{}.down_proj"}  # fmt: skip
    experts = 8 if family == "qwen3moe" else 4
    assert quantized == {w.format(e) for w in want for e in range(experts)}
    for i in range(2):
        assert isinstance(native.layers[i].mlp.router.weight, torch.nn.Parameter)
        assert torch.equal(native.layers[i].mlp.router.weight, dense.layers[i].mlp.router.weight)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_on_the_gguf_decodes_transformers_greedy_tokens(gguf_of, hf_folders, family):
    path = gguf_of(family, mixed=False)
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(model_path=path, tokenizer_path=hf_folders[family], max_total_tokens=512) as engine:
        outputs = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in PROMPTS]
    original = load_hf_model(hf_folders[family])
    for prompt, output in zip(PROMPTS, outputs):
        assert len(output) == 12 and hf_greedy_divergence(original, prompt, output) is None, (prompt, output)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_decode_stack_runs_gguf_experts_as_the_python_path_does(cpp_ext, hf_folders, tmp_path, family):
    """Routed experts stored as GGUF blocks in the fused C++ decode stack: one row (its chosen
    experts in one call) and two rows (grouped by expert) give the Python layers' logits bit for bit."""
    path = str(write_family_gguf(hf_folders[family], tmp_path / "experts.gguf", lambda n: "Q8_0" if "_exps" in n else "F32"))
    for prompts in ([PROMPTS[0]], PROMPTS):
        _, _, fused, ran = decode_with_stack(path, prompts, True, tokenizer_path=hf_folders[family])
        _, _, plain, ran_plain = decode_with_stack(path, prompts, False, tokenizer_path=hf_folders[family])
        assert ran >= 9 and ran_plain == 0
        assert_same_logits(fused, plain)


def test_every_layout_is_written():
    assert set(EXPERT_LAYOUTS) == set(Q8_0) == {layout for _, layout in LAYOUTS}


MOE_KEYS = {"expert_count": 8, "expert_used_count": 2}
RULES = {
    # case: (arch, metadata, what the config says)
    "qwen3moe without an expert width: the feed-forward length over the experts used":
        ("qwen3moe", {**MOE_KEYS, "feed_forward_length": 768}, {"moe_intermediate_size": 384, "norm_topk_prob": True}),
    "qwen3moe with one value a layer": ("qwen3moe", {"expert_count": 8, "expert_used_count": [2, 2], "expert_feed_forward_length": [96, 96]},
                                        {"num_experts_per_tok": 2, "moe_intermediate_size": 96}),
    "llama with experts is Mixtral": ("llama", MOE_KEYS, {"architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                                                          "num_experts_per_tok": 2, "intermediate_size": 128, "head_dim": 16}),
    "llama without experts is Llama": ("llama", {}, {"architectures": ["LlamaForCausalLM"], "num_local_experts": None}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(RULES))
def test_llama_cpp_rules_for_experts(tmp_path, case):
    arch, kv, want = RULES[case]
    cfg = gguf_hf_config(metadata_gguf(tmp_path / "m.gguf", arch, kv))
    assert {k: cfg.get(k) for k in want} == want


REFUSED = {
    "an MoE architecture we do not map": ("qwen2moe", MOE_KEYS, "unsupported GGUF architecture 'qwen2moe'"),
    "experts in a dense architecture": ("qwen3", MOE_KEYS, "unsupported GGUF architecture 'qwen3' with experts"),
    "qwen3moe without experts": ("qwen3moe", {}, "without qwen3moe.expert_count"),
    "experts without a count used": ("llama", {"expert_count": 8}, "no llama.expert_used_count"),
    "layers with different expert widths": ("qwen3moe", {**MOE_KEYS, "expert_feed_forward_length": [64, 96]}, "differs between layers"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_is_refused_is_named(tmp_path, case):
    arch, kv, message = REFUSED[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        gguf_hf_config(metadata_gguf(tmp_path / "m.gguf", arch, kv))


def test_the_experts_quantized_types_are_reported_as_stored_formats(hf_folders, tmp_path):
    """``--quantization`` decisions see the merged expert tensors' type (they name no HF tensor themselves)."""
    from radixlm.runtime.loader import stored_formats

    path = write_family_gguf(hf_folders["qwen3moe"], tmp_path / "experts.gguf", lambda n: "Q8_0" if "_exps" in n else "F32")
    assert stored_formats(str(path)) == {"gguf:Q8_0"}


def test_one_tokens_gguf_experts_take_one_call_with_the_layer_by_layer_sum(cpp_ext, monkeypatch):
    """A batch-1 token whose chosen experts are all GGUF blocks (gate/up Q4_K and Q6_K parts, down
    Q8_0) runs them in one C++ call, with the output of the experts called one by one, to the bit."""
    from torch import nn

    from radixlm.runtime.layers import moe
    from radixlm.runtime.layers.activation import silu_and_mul

    rng = np.random.default_rng(0)
    hidden = inter = 256  # whole K-quant super-blocks

    def part(rows: int, k: int, qtype: str) -> tuple[int, torch.Tensor]:
        blocks = quantize(rng.normal(0, 0.1, (rows, k)).astype(np.float32), qtype)
        return {"Q4_K": 12, "Q6_K": 14, "Q8_0": 8}[qtype], torch.from_numpy(np.ascontiguousarray(blocks))

    experts = nn.ModuleList()
    for _ in range(6):
        expert = moe.ExpertMLP(hidden, inter, silu_and_mul)
        expert.gate_up_proj = GGUFLinear([part(inter, hidden, "Q4_K"), part(inter, hidden, "Q6_K")], hidden)
        expert.down_proj = GGUFLinear([part(hidden, inter, "Q8_0")], inter)
        experts.append(expert)
    calls = []
    one_call = cpp_ext.gguf_experts_token
    monkeypatch.setattr(cpp_ext, "gguf_experts_token", lambda *a: calls.append(1) or one_call(*a))
    x, weights, ids = torch.randn(1, hidden), torch.rand(1, 3), torch.tensor([[4, 0, 2]])
    with torch.no_grad():
        got = moe.run_experts(x, weights, ids, experts)
        expected = torch.zeros_like(x)
        for j in (1, 2, 0):  # ascending expert id
            expected += experts[int(ids[0, j])](x) * weights[0, j]
    assert calls == [1]
    assert torch.equal(got, expected)


def test_the_one_call_experts_refuse_bad_inputs_by_name(cpp_ext):
    part = torch.from_numpy(np.ascontiguousarray(quantize(np.ones((64, 32), np.float32), "Q8_0")))
    down = torch.from_numpy(np.ascontiguousarray(quantize(np.ones((32, 32), np.float32), "Q8_0")))
    x, w = torch.randn(1, 32), torch.ones(1)
    cases = [
        ((torch.randn(2, 32), [[part]], [[8]], [[down]], [[8]], w), "x must be one float32 CPU row"),
        ((x, [[part]], [[8]], [[down], [down]], [[8], [8]], w), "one entry per expert"),
        ((x, [[part]], [[8]], [[down]], [[8]], torch.ones(2)), "weights must be float32 [k]"),
        ((x, [[part]], [[8]], [[part]], [[8]], w), "down projection has 64 rows, not H = 32"),
    ]
    for args, reason in cases:
        with pytest.raises(RuntimeError, match=re.escape(reason)):
            cpp_ext.gguf_experts_token(*args)
