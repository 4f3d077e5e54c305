"""GPTQ and AWQ int4 checkpoints: read exactly as stored, multiplied by int4 layers, never held dense."""

from __future__ import annotations

import zlib

import pytest
import torch
from quantized_checkpoints import (
    awq_tensors,
    dense_copies,
    engine_greedy,
    folder_getter,
    gptq_tensors,
    greedy_gaps,
    int4_groups,
    write_quantized,
)
from torch import nn

from helpers import missing_under_ci
from radixlm.runtime.checkpoints.gptq_awq import (
    Int4GroupWeight,
    gpu_layer,
    q4_z_blocks,
    read_stored,
)
from radixlm.runtime.layers.gguf_linear import Q4_Z, GGUFLinear, dequantize_blocks, kernel_types
from radixlm.runtime.layers.int4_group_linear import Int4GroupLinear, PermutedInput
from radixlm.runtime.layers.quantized_linear import Int4Linear
from radixlm.runtime.layers.stored_weight import DequantizedLinear

CASES = {
    "gptq-sym-v1-g32": dict(method="gptq", group=32, sym=True, v1=True),
    "gptq-asym-v2-g64": dict(method="gptq", group=64, sym=False, v1=False),
    "gptq-asym-v1-g128": dict(method="gptq", group=128, sym=False, v1=True, wide=True),
    "gptq-sym-rowgroup": dict(method="gptq", group=-1, sym=True, v1=False),
    "gptq-sym-actorder-g32": dict(method="gptq", group=32, sym=True, v1=True, act_order=True),
    "gptq-asym-actorder-g64": dict(method="gptq", group=64, sym=False, v1=False, act_order=True),
    "awq-g32": dict(method="awq", group=32, sym=False),
    "awq-g128": dict(method="awq", group=128, sym=False, wide=True),
}
INPUTS = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "down"}
PROMPT = [1, 40, 41, 42, 43]
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",))


def qconfig(case: dict) -> dict:
    """The quantization_config the quantizing library would write."""
    if case["method"] == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": case["group"], "zero_point": True, "version": "gemm"}
    return {"quant_method": "gptq", "bits": 4, "group_size": case["group"], "sym": case["sym"], "desc_act": bool(case.get("act_order")),
            "checkpoint_format": "gptq" if case["v1"] else "gptq_v2", "true_sequential": True, "damp_percent": 0.01}  # fmt: skip


def quantizer(case: dict):
    """The case's quantizer: act-order permutations shared by the projections that see the same input."""

    def quantize(name: str, w: torch.Tensor):
        prefix = name.removesuffix(".weight")
        layer, proj = prefix.split(".")[2], prefix.split(".")[-1]
        perm = None
        if case.get("act_order"):
            gen = torch.Generator().manual_seed(zlib.crc32(f"{layer}.{INPUTS[proj]}".encode()))
            perm = torch.randperm(w.shape[1], generator=gen)
        q = int4_groups(w, case["group"], case["sym"], perm, zero_min=1 if case.get("v1") else 0)
        tensors = awq_tensors(prefix, q) if case["method"] == "awq" else gptq_tensors(prefix, q, case["v1"])
        return tensors, q.dequantize()

    return quantize


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_llama):
    """Per case (built on first use): (quantized folder, dense folder of its values, the values)."""
    from helpers import make_tiny_model

    built, wide = {}, []

    def get(name: str):
        if name not in built:
            case = CASES[name]
            src = tiny_llama
            if case.get("wide"):  # inputs of 128 and 256, for groups of 128
                if not wide:
                    wide.append(make_tiny_model("llama", tmp_path_factory.mktemp("wide"), hidden_size=128, intermediate_size=256))
                src = wide[0]
            root = tmp_path_factory.mktemp(name)
            values = write_quantized(src, root / "q", root / "dense", quantizer(case), qconfig(case))
            built[name] = (root / "q", root / "dense", values)
        return built[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_stored_weights_dequantize_to_the_quantized_values(folders, name):
    """(a) every quantized linear is read, exactly, and its tensors are consumed."""
    qdir, _, values = folders(name)
    names, get = folder_getter(qdir)
    stored, consumed = read_stored(qconfig(CASES[name]), names, get)
    assert set(stored) == set(values)
    for key, value in values.items():
        weight = stored[key]
        assert isinstance(weight, Int4GroupWeight) and weight.format == CASES[name]["method"]
        assert (weight.out_features, weight.in_features) == tuple(value.shape)
        assert torch.equal(weight.dequantize(), value), key
        assert weight.nbytes() < value.numel() * 0.6 + (value.numel() * 8 if weight.perm is not None else 0)
    quant_names = {n for n in names if n.rsplit(".", 1)[1] in ("qweight", "qzeros", "scales", "g_idx")}
    assert consumed == quant_names
    assert any(w.perm is not None for w in stored.values()) == bool(CASES[name].get("act_order"))


def expected_layer(case: dict, k: int) -> type:
    """The layer a CPU join builds for the case."""
    if case["sym"]:
        return Int4Linear
    return GGUFLinear if Q4_Z in kernel_types() else DequantizedLinear


@pytest.mark.parametrize("name", list(CASES))
def test_joined_layers_compute_the_stored_weights(folders, name):
    """(b) the fused layers' outputs are x @ W.T for W the stacked stored values (int8-quantized x)."""
    case = CASES[name]
    qdir, _, values = folders(name)
    stored, _ = read_stored(qconfig(case), *folder_getter(qdir))
    torch.manual_seed(0)
    for projs in FUSED:
        keys = [f"model.layers.1.{'self_attn' if projs[0] in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{p}.weight" for p in projs]
        parts = [stored[k] for k in keys]
        w = torch.cat([values[k] for k in keys])
        bias = nn.Parameter(torch.randn(w.shape[0]) * 0.1, requires_grad=False)
        layer = type(parts[0]).join(parts, bias, torch.device("cpu"))
        inner = layer.inner if isinstance(layer, PermutedInput) else layer
        assert isinstance(layer, PermutedInput) == (parts[0].perm is not None)  # one group of all inputs: no permutation
        assert isinstance(inner, expected_layer(case, w.shape[1])), type(inner)
        if not isinstance(inner, DequantizedLinear):
            assert not any(p.is_floating_point() and p.numel() >= w.numel() // 2 for p in [*layer.parameters(), *layer.buffers()])
        x = torch.randn(3, w.shape[1])
        ref = x @ w.t() + bias
        out = layer(x)
        assert out.shape == ref.shape and out.dtype == x.dtype
        torch.testing.assert_close(out, ref, atol=0.02 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("name", ["gptq-asym-v2-g64", "awq-g32", "gptq-asym-v1-g128"])
def test_q4_z_blocks_hold_the_stored_values(folders, name):
    """The CPU layout for zero points (our Q4_Z blocks) decodes to the same matrix."""
    qdir, _, values = folders(name)
    stored, _ = read_stored(qconfig(CASES[name]), *folder_getter(qdir))
    for key, weight in stored.items():
        reps = weight.group // 32
        blocks = q4_z_blocks(weight.codes(), weight.scale.repeat_interleave(reps, 1), weight.zero.repeat_interleave(reps, 1))
        assert blocks.shape == (weight.out_features, weight.in_features // 32 * 20)
        assert torch.equal(dequantize_blocks(blocks, Q4_Z, weight.in_features), values[key]), key


def test_parts_with_different_act_orders_are_dequantized(folders):
    """Parts that permute their inputs differently share no layer: dense, still exact."""
    qdir, _, values = folders("gptq-sym-actorder-g32")
    stored, _ = read_stored(qconfig(CASES["gptq-sym-actorder-g32"]), *folder_getter(qdir))
    keys = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"]
    assert not torch.equal(stored[keys[0]].perm, stored[keys[1]].perm)
    layer = Int4GroupWeight.join([stored[k] for k in keys], None, torch.device("cpu"))
    assert isinstance(layer, DequantizedLinear)
    assert torch.equal(layer.weight, torch.cat([values[k] for k in keys]))


def test_unsupported_configs_are_refused():
    with pytest.raises(ValueError, match="3-bit"):
        read_stored({"quant_method": "gptq", "bits": 3, "group_size": 128}, [], lambda n: None)
    with pytest.raises(ValueError, match="checkpoint_format"):
        read_stored({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, [], lambda n: None)
    with pytest.raises(ValueError, match="GEMM"):
        read_stored({"quant_method": "awq", "bits": 4, "version": "gemv"}, [], lambda n: None)


@pytest.mark.parametrize("name", ["gptq-asym-actorder-g64", "gptq-sym-rowgroup", "awq-g128"])
def test_gpu_layer_runs_the_zero_point_kernel(folders, name):
    """The GPU layer (Triton; its interpreter without a GPU), groups of all inputs and act-order included."""
    try:
        import radixlm.kernels.triton_int4_linear  # noqa: F401
    except ImportError:
        missing_under_ci("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    qdir, _, values = folders(name)
    stored, _ = read_stored(qconfig(CASES[name]), *folder_getter(qdir))
    torch.manual_seed(0)
    permuted = 0
    for block, projs in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("down_proj",))):
        keys = [f"model.layers.0.{block}.{p}.weight" for p in projs]
        parts = [stored[k] for k in keys]
        permuted += parts[0].perm is not None
        w = torch.cat([values[k] for k in keys]).to(device)
        bias = nn.Parameter(torch.randn(w.shape[0], device=device) * 0.1, requires_grad=False)
        layer = gpu_layer(parts, bias, device)
        assert isinstance(layer, Int4GroupLinear) and layer.bias is bias
        assert layer.group == max(g for g in (32, 64, 128) if parts[0].group % g == 0)  # the fewest scales the kernel takes
        assert layer.weight_bytes() < w.numel() * 0.6
        x = torch.randn(2, w.shape[1], device=device)
        ref = x @ w.t() + bias
        torch.testing.assert_close(layer(x), ref, atol=1e-3 * ref.abs().max().item(), rtol=1e-3)
    assert (permuted > 0) == bool(CASES[name].get("act_order"))


# ---------------------------------------------------------------- whole models
def loaded_as_stored(path: str) -> nn.Module:
    """The model the loader builds for ``path`` on CPU, in float32."""
    from radixlm.runtime.loader import load_model

    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    return model


@pytest.mark.parametrize("name", ["gptq-sym-v1-g32", "gptq-asym-actorder-g64", "awq-g32"])
def test_loaded_model_is_int4_and_generates_as_its_dense_values(folders, name):
    """(c) no dense copy of the quantized linears, and the dense model's greedy tokens."""
    if not CASES[name]["sym"] and Q4_Z not in kernel_types():
        missing_under_ci("the C++ kernels for Q4_Z blocks (without them asymmetric int4 is dequantized)")
    qdir, dense_dir, _ = folders(name)
    model = loaded_as_stored(str(qdir))
    assert dense_copies(model) == []
    # the int4 kernels multiply activations rounded to int8 per 32: where two logits of the dense
    # model are within that rounding (a few hundredths here), either may win; elsewhere the same token
    output, _ = engine_greedy(str(qdir), PROMPT)
    gaps = greedy_gaps(str(dense_dir), PROMPT, output)
    assert max(gaps) < 0.1 and sum(g == 0 for g in gaps) >= len(gaps) - 2, gaps
