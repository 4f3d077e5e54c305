"""FP8 checkpoints (``fp8`` and ``compressed-tensors``): read exactly as stored, multiplied by the
FP8 layer, never held dense."""

from __future__ import annotations

import re

import pytest
import torch
from quantized_checkpoints import (
    dense_copies,
    engine_greedy,
    folder_getter,
    fp8_quantize,
    fp8_value,
    write_quantized,
)
from torch import nn

from radixlm.runtime.checkpoints.fp8 import FP8Weight, read_stored
from radixlm.runtime.layers.fp8_linear import FP8Linear
from radixlm.runtime.layers.stored_weight import DequantizedLinear


def compressed_tensors(strategy: str, block: list[int] | None = None, activations: bool = True) -> dict:
    """llm-compressor's config for float8 weights (and dynamic per-token float8 activations)."""
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False, "block_structure": block}
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True} if activations else None
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}  # fmt: skip


CASES = {  # granularity, block, config, scale tensor name, static input scales
    "fp8-tensor": ("tensor", None, {"quant_method": "fp8", "activation_scheme": "static", "fmt": "e4m3"}, "weight_scale", True),
    "fp8-block": ("block", (32, 32), {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [32, 32]}, "weight_scale_inv", False),
    "ct-tensor": ("tensor", None, compressed_tensors("tensor"), "weight_scale", False),
    "ct-channel": ("channel", None, compressed_tensors("channel"), "weight_scale", False),
    "ct-block": ("block", (16, 48), compressed_tensors("block", [16, 48], activations=False), "weight_scale", False),
}
FUSED = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")), ("self_attn", ("o_proj",)), ("mlp", ("down_proj",)))
PROMPT = [1, 40, 41, 42, 43]


def quantizer(name: str):
    """The case's quantizer: weight, scale (and a static input scale)."""
    granularity, block, _, scale_name, static = CASES[name]

    def quantize(key: str, w: torch.Tensor):
        prefix = key.removesuffix(".weight")
        weight, scale = fp8_quantize(w, granularity, block)
        tensors = {key: weight, f"{prefix}.{scale_name}": scale}
        if static:
            tensors[f"{prefix}.input_scale"] = torch.tensor(0.02)
        return tensors, fp8_value(weight, scale, block)

    return quantize


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_llama):
    """Per case (built on first use): (quantized folder, dense folder of its values, the values)."""
    built = {}

    def get(name: str):
        if name not in built:
            root = tmp_path_factory.mktemp(name)
            values = write_quantized(tiny_llama, root / "q", root / "dense", quantizer(name), CASES[name][2])
            built[name] = (root / "q", root / "dense", values)
        return built[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_stored_weights_dequantize_to_the_quantized_values(folders, name):
    """(a) every float8 linear is read, exactly, with its scale and activation scales consumed."""
    granularity, block, qconfig, scale_name, _ = CASES[name]
    qdir, _, values = folders(name)
    names, get = folder_getter(qdir)
    stored, consumed = read_stored(qconfig, names, get)
    assert set(stored) == set(values)
    for key, value in values.items():
        weight = stored[key]
        assert isinstance(weight, FP8Weight) and weight.granularity == granularity and weight.block == block
        assert torch.equal(weight.dequantize(), value), key
        assert weight.nbytes() <= value.numel() * 1.07
    quant = {n for n in names if n.endswith((".weight", f".{scale_name}", ".input_scale")) and n.replace(f".{scale_name}", ".weight").replace(".input_scale", ".weight") in values}
    assert consumed == quant


@pytest.mark.parametrize("name", list(CASES))
def test_joined_layers_compute_the_stored_weights(folders, name):
    """(b) the fused FP8 layers compute x @ W.T for W the stacked stored values."""
    _, _, qconfig, _, _ = CASES[name]
    qdir, _, values = folders(name)
    stored, _ = read_stored(qconfig, *folder_getter(qdir))
    torch.manual_seed(0)
    for block, projs in FUSED:
        keys = [f"model.layers.0.{block}.{p}.weight" for p in projs]
        w = torch.cat([values[k] for k in keys])
        bias = nn.Parameter(torch.randn(w.shape[0]) * 0.1, requires_grad=False)
        layer = FP8Weight.join([stored[k] for k in keys], bias, torch.device("cpu"))
        assert isinstance(layer, FP8Linear) and layer.bias is bias
        assert torch.equal(layer.dequantize(), w)
        x = torch.randn(3, w.shape[1])
        ref = x @ w.t() + bias
        torch.testing.assert_close(layer(x), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)


def test_parts_whose_block_scales_do_not_stack_are_dequantized():
    """Block scales stack only along whole row blocks: otherwise a dense layer (logged), still exact."""
    torch.manual_seed(1)
    parts, values = [], []
    for rows in (24, 32):
        weight, scale = fp8_quantize(torch.randn(rows, 64), "block", (16, 32))
        parts.append(FP8Weight(rows, 64, weight.view(torch.uint8), scale, (16, 32)))
        values.append(fp8_value(weight, scale, (16, 32)))
    layer = FP8Weight.join(parts, None, torch.device("cpu"))
    assert isinstance(layer, DequantizedLinear) and torch.equal(layer.weight, torch.cat(values))


@pytest.mark.parametrize(
    "qconfig, match",
    [
        ({"quant_method": "fp8", "fmt": "e5m2"}, "e4m3"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "pack-quantized"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}, "8-bit int"),  # fmt: skip
        ({"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}}, "strategy"),  # fmt: skip
    ],
)
def test_unsupported_configs_are_refused(qconfig, match):
    with pytest.raises(ValueError, match=match):
        read_stored(qconfig, [], lambda n: None)


@pytest.mark.parametrize("name", ["fp8-tensor", "fp8-block", "ct-channel"])
def test_loaded_model_is_fp8_and_generates_as_its_dense_values(folders, name):
    """(c) no dense copy of the quantized linears, and the dense model's greedy tokens."""
    from radixlm.runtime.loader import load_model

    qdir, dense_dir, _ = folders(name)
    model, _ = load_model(str(qdir), torch.float32, torch.device("cpu"))
    fp8 = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
    assert fp8 and dense_copies(model) == []
    (output, logprobs), (dense_output, dense_logprobs) = engine_greedy(str(qdir), PROMPT), engine_greedy(str(dense_dir), PROMPT)
    assert output == dense_output
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(dense_logprobs), atol=1e-4, rtol=0)  # the same math in float32


@pytest.mark.parametrize("name", ["fp8-block", "ct-channel"])
def test_a_deepseek_fp8_checkpoint_moves_its_rope_rows_as_the_dense_one(tmp_path, name):
    """DeepSeek's interleaved RoPE rows (query and kv_a projections) are reordered at load: stored
    FP8 weights move theirs as stored, rows with their per-channel scales or inside their blocks of
    rows (32 here: each head's RoPE rows lie in one), and decode as the dense folder of their values."""
    from helpers import make_tiny_model
    from radixlm.runtime.loader import load_model

    src = make_tiny_model("deepseek_v3", tmp_path / "src")
    every_linear = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.[\w.]*_proj(_with_mqa)?\.weight$").search  # experts' and kv_b_proj too
    values = write_quantized(src, tmp_path / "q", tmp_path / "dense", quantizer(name), CASES[name][2], only=every_linear)
    assert any("kv_a_proj_with_mqa" in n for n in values)
    model, _ = load_model(str(tmp_path / "q"), torch.float32, torch.device("cpu"))
    assert any(isinstance(m, FP8Linear) for n, m in model.named_modules() if n.endswith("kv_a_proj_with_mqa"))
    (output, logprobs), (dense_output, dense_logprobs) = engine_greedy(str(tmp_path / "q"), PROMPT), engine_greedy(str(tmp_path / "dense"), PROMPT)
    assert output == dense_output
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(dense_logprobs), atol=1e-4, rtol=0)


def test_rows_that_would_leave_their_fp8_scale_block_are_not_moved():
    weight = FP8Weight(4, 2, torch.zeros(4, 2, dtype=torch.uint8), torch.ones(2, 1), (2, 2))
    assert weight.take_rows(torch.tensor([1, 0, 3, 2])) is not None
    assert weight.take_rows(torch.tensor([2, 1, 0, 3])) is None
