"""Mixture-of-experts layers: each family's routing, experts run grouped, whole blocks against transformers'.

The end-to-end checks (greedy tokens of Mixtral and Qwen3-MoE models against transformers in
every scheduling situation, tensor parallelism, quantized experts) are the family tests'
(``tests/test_families.py``, ``tests/test_family_options.py``); these check the layers alone.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from radixlm.runtime.layers.activation import silu_and_mul
from radixlm.runtime.layers.moe import ExpertMLP, MoEBlock, run_experts
from radixlm.runtime.layers.moe_router import Router, RouterSpec, route
from radixlm.runtime.models.config import MoEConfig

HIDDEN = 32
TOKENS = 13

# family (model type) -> (transformers config class, its MoE settings, transformers' block class)
BLOCKS = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=6, num_experts_per_tok=2), "mixtral.MixtralSparseMoeBlock"),
    "qwen3_moe": (
        "Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False),
        "qwen3_moe.Qwen3MoeSparseMoeBlock",
    ),
    "qwen3_moe_renormalized": (
        "Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True),
        "qwen3_moe.Qwen3MoeSparseMoeBlock",
    ),
    "deepseek_v3": (  # sigmoid scores, correction bias, best 2 of 4 groups, scaling, one shared expert
        "DeepseekV3Config", dict(
            n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1, n_group=4,
            topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        ), "deepseek_v3.DeepseekV3MoE",
    ),
    "deepseek_v2": (  # softmax, best 2 of 4 groups by their best expert, scaling, two shared experts
        "DeepseekV2Config", dict(
            n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=2, n_group=4,
            topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5, first_k_dense_replace=1,
        ), "deepseek_v2.DeepseekV2Moe",
    ),
}  # fmt: skip


def _hf_config(class_name: str, **moe):
    base = dict(vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return getattr(transformers, class_name)(**base, **moe)


def _hf_block(case: str):
    """transformers' MoE block of ``case`` with random weights, its config, and the family name."""
    class_name, moe, block_path = BLOCKS[case]
    cfg = _hf_config(class_name, **moe)
    module, cls = block_path.split(".")
    block = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
        for name, b in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    return block.eval(), cfg, case.removesuffix("_renormalized")


def _ours_from(block, cfg, family: str) -> MoEBlock:
    """Our block with transformers' block's weights, routing read from its config."""
    moe = MoEConfig.from_hf_dict(cfg.to_dict(), family)
    ours = MoEBlock(HIDDEN, moe.router, moe.intermediate_size, silu_and_mul, moe.shared_intermediate_size)
    with torch.no_grad():
        ours.router.weight.copy_(block.gate.weight)
        if ours.router.correction_bias is not None:
            ours.router.correction_bias.copy_(block.gate.e_score_correction_bias)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(block.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(block.experts.down_proj[e])
        if ours.shared_experts is not None:
            shared = block.shared_experts
            ours.shared_experts.gate_up_proj.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
            ours.shared_experts.down_proj.weight.copy_(shared.down_proj.weight)
    return ours


@pytest.mark.parametrize("case", list(BLOCKS))
def test_moe_block_equals_transformers_block_and_routes_the_same_experts(case):
    block, cfg, family = _hf_block(case)
    ours = _ours_from(block, cfg, family)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        expected = block(x.unsqueeze(0)).reshape(TOKENS, HIDDEN)
        got = ours(x)
        _, hf_weights, hf_ids = block.gate(x)
        weights, ids = ours.router(x)
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.float().gather(1, hf_order), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_gpt_oss_router_takes_the_top_logits_then_their_softmax():
    cfg = _hf_config("GptOssConfig", num_local_experts=8, num_experts_per_tok=3, head_dim=8)
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    theirs = GptOssTopKRouter(cfg)
    torch.manual_seed(2)
    with torch.no_grad():
        theirs.weight.normal_(0, 0.3)
        theirs.bias.normal_(0, 0.3)
    ours = Router(HIDDEN, MoEConfig.from_hf_dict(cfg.to_dict(), "gpt_oss").router)
    with torch.no_grad():
        ours.weight.copy_(theirs.weight)
        ours.bias.copy_(theirs.bias)
        x = torch.randn(TOKENS, HIDDEN)
        _, hf_weights, hf_ids = theirs(x)
        weights, ids = ours(x)
    assert torch.equal(ids, hf_ids)  # both sorted by logit
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7)


def test_router_ties_go_to_the_lower_expert_and_the_lower_group():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 0.0], [0.0] * 6])
    weights, ids = route(logits, RouterSpec(num_experts=6, top_k=2, renormalize=True))
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert torch.allclose(weights, torch.full((2, 2), 0.5))
    # three groups of two scoring the same: the first two groups are kept, so expert 4 and 5 are not chosen
    grouped = RouterSpec(num_experts=6, top_k=3, scoring="sigmoid", n_group=3, topk_group=2, group_score="top2_sum")
    _, ids = route(torch.tensor([[0.5, 0.1, 0.1, 0.5, 0.5, 0.1]]), grouped)
    assert sorted(ids[0].tolist()) == [0, 1, 3]


def _experts_recording_calls() -> tuple[nn.ModuleList, list[tuple[int, int]]]:
    """Six random experts, and the list their calls append (expert, rows) to."""
    torch.manual_seed(0)
    experts = nn.ModuleList(ExpertMLP(HIDDEN, 32, silu_and_mul) for _ in range(6))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    calls: list[tuple[int, int]] = []
    for e, expert in enumerate(experts):
        expert.register_forward_hook(lambda _m, args, _out, e=e: calls.append((e, args[0].shape[0])))
    return experts, calls


def test_grouped_experts_equal_a_per_token_loop_and_run_each_chosen_expert_once():
    experts, calls = _experts_recording_calls()
    ids = torch.tensor([[0, 2], [2, 0], [4, 2], [0, 4], [2, 4], [4, 0], [0, 2], [2, 4], [4, 0]])  # 1, 3, 5: no token
    weights = torch.rand(ids.shape)
    x = torch.randn(ids.shape[0], HIDDEN)
    with torch.no_grad():
        got = run_experts(x, weights, ids, experts)
        calls_grouped = list(calls)
        expected = torch.stack([sum(weights[t, j] * experts[int(ids[t, j])](x[t : t + 1])[0] for j in range(2)) for t in range(len(x))])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert calls_grouped == [(0, 6), (2, 6), (4, 6)]  # one call per chosen expert, with all of its rows


def test_one_token_adds_its_experts_in_ascending_id_as_the_grouped_path_does():
    experts, calls = _experts_recording_calls()
    ids, weights, x = torch.tensor([[4, 0, 2]]), torch.rand(1, 3), torch.randn(1, HIDDEN)
    with torch.no_grad():
        got = run_experts(x, weights, ids, experts)
        assert calls == [(0, 1), (2, 1), (4, 1)]
        expected = torch.zeros_like(x)  # the grouped path's index_add_, expert after expert
        for j in (1, 2, 0):
            expected.index_add_(0, torch.tensor([0]), experts[int(ids[0, j])](x) * weights[0, j])
    assert torch.equal(got, expected)


def test_a_single_token_reads_only_its_chosen_experts():
    torch.manual_seed(0)
    spec = RouterSpec(num_experts=16, top_k=2)
    block = MoEBlock(HIDDEN, spec, 32, silu_and_mul)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    touched: set[int] = set()
    for e, expert in enumerate(block.experts):
        expert.register_forward_hook(lambda *_a, e=e: touched.add(e))
    with torch.no_grad():
        _, ids = block.router(x := torch.randn(1, HIDDEN))
        block(x)
    assert touched == set(ids[0].tolist())


def test_moe_layers_follow_each_config_spelling():
    qwen = MoEConfig.from_hf_dict(
        dict(num_hidden_layers=6, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
             decoder_sparse_step=2, mlp_only_layers=[3]), "qwen3_moe")  # fmt: skip
    assert qwen.sparse_layers == (False, True, False, False, False, True)
    assert qwen.intermediate_size == 32 and qwen.shared_intermediate_size == 0 and not qwen.router.renormalize
    deepseek = MoEConfig.from_hf_dict(
        dict(num_hidden_layers=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64,
             first_k_dense_replace=2, n_shared_experts=2, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4,
             topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5), "deepseek_v3")  # fmt: skip
    assert deepseek.sparse_layers == (False, False, True, True)
    assert deepseek.shared_intermediate_size == 32
    assert deepseek.router == RouterSpec(8, 2, "sigmoid", True, 4, 2, "top2_sum", 2.5, correction_bias=True)
    mixtral = MoEConfig.from_hf_dict(dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=64), "mixtral")
    assert mixtral.sparse_layers == (True, True) and mixtral.intermediate_size == 64 and mixtral.router.renormalize
    assert MoEConfig.from_hf_dict(dict(num_hidden_layers=2, intermediate_size=64), "llama") is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(num_experts=4, top_k=5), "num_experts_per_tok"),
        (dict(num_experts=6, top_k=2, n_group=4), "n_group"),
        (dict(num_experts=8, top_k=2, n_group=4, topk_group=5), "topk_group"),
        (dict(num_experts=8, top_k=5, n_group=4, topk_group=2), "num_experts_per_tok"),
    ],
)
def test_impossible_routing_settings_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RouterSpec(**kwargs)


def test_int8_quantization_quantizes_every_expert_and_keeps_the_router_exact(tmp_path):
    from helpers import make_tiny_model
    from radixlm import ServerArgs
    from radixlm.runtime.engine import build_parts
    from radixlm.runtime.layers.quantized_linear import Int8Linear

    path = make_tiny_model("qwen3_moe", tmp_path / "qwen3_moe")
    plain = build_parts(ServerArgs(model_path=path, max_total_tokens=256)).runner.model
    quantized = build_parts(ServerArgs(model_path=path, max_total_tokens=256, quantization="int8")).runner.model
    assert type(quantized.layers[0].mlp.gate_up_proj) is Int8Linear  # the dense first layer (mlp_only_layers)
    block, plain_block = quantized.layers[1].mlp, plain.layers[1].mlp
    assert all(type(e.gate_up_proj) is Int8Linear and type(e.down_proj) is Int8Linear for e in block.experts)
    assert torch.equal(block.router.weight, plain_block.router.weight)
    x = torch.randn(5, block.router.weight.shape[1])
    with torch.no_grad():
        assert torch.equal(block.router(x)[1], plain_block.router(x)[1])


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from radixlm.runtime.layers.mxfp4 import dequantize_mxfp4

    gen = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=gen)  # 3 experts, 8 rows, 64 columns
    scales = torch.randint(120, 134, (3, 8, 2), dtype=torch.uint8, generator=gen)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [experts, columns, rows]
    assert torch.equal(dequantize_mxfp4(blocks, scales), theirs.transpose(1, 2))
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        dequantize_mxfp4(blocks, scales[..., :1])


def test_mxfp4_blocks_move_into_gguf_mxfp4_rows_with_the_same_values():
    """Hugging Face's MXFP4 (even value in the low nibble) repacked as GGUF's MXFP4 (Q4_0's nibble
    order, the same scale byte) dequantizes, by the gguf package, to the same values, subnormal
    scales included."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from radixlm.runtime.checkpoints.mxfp4 import gguf_blocks
    from radixlm.runtime.layers.mxfp4 import dequantize_mxfp4

    gen = torch.Generator().manual_seed(6)
    blocks = torch.randint(0, 256, (2, 5, 3, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 140, (2, 5, 3), dtype=torch.uint8, generator=gen)
    scales[0, 0] = torch.tensor([0, 1, 2], dtype=torch.uint8)
    rows = gguf_blocks(blocks, scales)
    assert rows.shape == (2, 5, 3 * 17)
    theirs = dequantize(rows.reshape(-1, 3 * 17).numpy(), GGMLQuantizationType.MXFP4).reshape(2, 5, 96)
    assert torch.equal(torch.from_numpy(theirs.copy()), dequantize_mxfp4(blocks, scales))


def test_gpt_oss_mxfp4_experts_read_as_the_per_expert_tensors_of_their_stacked_values():
    """A folder's MXFP4 blocks and scales become per-expert GGUF MXFP4 weights (gate rows even, up
    odd) whose values are what the family cuts from the same experts stacked dense."""
    from radixlm.runtime.checkpoints.mxfp4 import read_stored
    from radixlm.runtime.layers.mxfp4 import dequantize_mxfp4
    from radixlm.runtime.models.gpt_oss import GptOssForCausalLM

    gen = torch.Generator().manual_seed(4)
    prefix = "model.layers.0.mlp.experts"
    blocks = {p: torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen) for p, shape in (("gate_up_proj", (2, 8, 1, 16)), ("down_proj", (2, 32, 4, 16)))}
    scales = {p: torch.randint(124, 130, b.shape[:-1], dtype=torch.uint8, generator=gen) for p, b in blocks.items()}
    packed = {**{f"{prefix}.{p}_blocks": blocks[p] for p in blocks}, **{f"{prefix}.{p}_scales": scales[p] for p in scales}}
    stacked = [(f"{prefix}.{p}", dequantize_mxfp4(blocks[p], scales[p]).transpose(1, 2)) for p in blocks]  # as transformers holds them
    model = object.__new__(GptOssForCausalLM)  # checkpoint_tensors reads only the class's arch
    from_stacked = dict(model.checkpoint_tensors(stacked))
    stored, consumed = read_stored({"quant_method": "mxfp4"}, sorted(packed), packed.__getitem__)
    assert consumed == set(packed) and sorted(stored) == sorted(from_stacked) == sorted(
        f"{prefix}.{e}.{p}.weight" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")
    )
    for name, weight in stored.items():
        assert weight.format == "gguf:MXFP4" and torch.equal(weight.dequantize(), from_stacked[name]), name
    assert from_stacked[f"{prefix}.1.gate_proj.weight"].shape == (4, 32)  # interleaved rows: gate even, up odd
    with pytest.raises(ValueError, match="has no"):
        read_stored({"quant_method": "mxfp4"}, [f"{prefix}.down_proj_blocks"], packed.__getitem__)


def test_a_gpt_oss_mxfp4_checkpoint_decodes_as_transformers_on_its_dequantized_weights(tmp_path):
    """A folder whose experts are MXFP4 blocks and scales (quant_method mxfp4, as published)
    runs its experts as GGUF MXFP4 blocks (the same bytes, nibbles moved) and gives transformers'
    greedy tokens on the same weights dequantized; so does ``--quantization none``."""
    from safetensors.torch import load_file, save_file

    from helpers import hf_greedy_divergence, load_hf_model, make_tiny_model
    from radixlm import Engine
    from radixlm.runtime.layers.mxfp4 import dequantize_mxfp4

    plain = Path(make_tiny_model("gpt_oss", tmp_path / "plain"))
    packed = tmp_path / "mxfp4"
    shutil.copytree(plain, packed)
    dense, stored = load_file(str(plain / "model.safetensors")), {}
    gen = torch.Generator().manual_seed(5)
    for name in [n for n in dense if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = dense[name].shape  # transformers holds [experts, in, out]
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(122, 125, blocks.shape[:-1], dtype=torch.uint8, generator=gen)
        dense[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
        stored[f"{name}_blocks"], stored[f"{name}_scales"] = blocks, scales
    save_file(dense, str(plain / "model.safetensors"))
    save_file({**{k: v for k, v in dense.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}, **stored},
              str(packed / "model.safetensors"))  # fmt: skip
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (packed / "config.json").write_text(json.dumps(config))

    from radixlm.runtime.layers.gguf_linear import MXFP4, GGUFLinear

    prompt = [5, 17, 33, 40, 8, 91, 150, 3, 77, 12, 300, 45]
    reference = load_hf_model(str(plain))
    for quantization in (None, "none"):
        with Engine(model_path=str(packed), max_total_tokens=512, quantization=quantization) as engine:
            out = engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True})[0]
            experts = [m for n, m in engine.runner.model.named_modules() if ".experts." in n and n.endswith(("gate_up_proj", "down_proj"))]
        native = [isinstance(m, GGUFLinear) and m.types == [MXFP4] * len(m.types) for m in experts]
        assert experts and all(native) if quantization is None else not any(native), quantization
        assert hf_greedy_divergence(reference, prompt, out["output_ids"]) is None, quantization
