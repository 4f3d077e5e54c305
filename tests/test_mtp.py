"""DeepSeek-V3's MTP layer as a speculative draft (``--speculative-algorithm mtp``), on a tiny random
V3 checkpoint with MTP tensors added under ``model.layers.{num_hidden_layers}``.

The MTP's logits are checked against a plain-PyTorch reference of the formula (transformers'
own decoder layer for its attention and experts); greedy output with MTP drafts must equal output
without speculation, and a proposal that raises must leave every output unchanged.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import Driver, failing_every, load_hf_model, make_tiny_model
from radixlm.runtime.engine import build_parts
from radixlm.runtime.server_args import ServerArgs

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [5, 6, 7, 8, 9, 10, 11, 12, 40, 41], list(range(60, 110)), [7, 8, 9, 7, 8, 9, 7, 8]]


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory) -> str:
    """The tiny V3 (two layers, the second sparse) with an MTP layer: layer 1's tensors with noise,
    random enorm/hnorm/eh_proj, and the model's embedding and head as the MTP's own."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("mtp") / "v3_mtp"
    make_tiny_model("deepseek_v3", folder, seed=4)
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    extra = {name.replace("model.layers.1.", "model.layers.2."): t + 0.05 * torch.randn(t.shape, generator=gen) for name, t in tensors.items() if name.startswith("model.layers.1.")}
    extra["model.layers.2.enorm.weight"] = 1 + 0.3 * torch.randn(64, generator=gen)
    extra["model.layers.2.hnorm.weight"] = 1 + 0.3 * torch.randn(64, generator=gen)
    extra["model.layers.2.eh_proj.weight"] = 0.2 * torch.randn(64, 128, generator=gen)
    extra["model.layers.2.shared_head.norm.weight"] = 1 + 0.3 * torch.randn(64, generator=gen)
    extra["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    extra["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file({**tensors, **extra}, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def _reference_mtp(path: str, tokens: list[int], draft: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP's logits at the last of ``tokens[:-1]``'s positions, and at the next position fed
    ``draft`` and the MTP's own hidden state, from the checkpoint's tensors directly."""
    from safetensors.torch import load_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
    )

    hf = load_hf_model(path)
    cfg = hf.config
    tensors = load_file(f"{path}/model.safetensors")
    mtp = {k.removeprefix("model.layers.2."): v for k, v in tensors.items() if k.startswith("model.layers.2.")}
    layer = DeepseekV3DecoderLayer(cfg, layer_idx=1).eval()
    state = {k: v for k, v in mtp.items() if k.split(".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm") and ".experts." not in k}
    experts = range(cfg.n_routed_experts)  # transformers keeps the experts stacked, gate rows then up rows
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([mtp[f"mlp.experts.{e}.gate_proj.weight"], mtp[f"mlp.experts.{e}.up_proj.weight"]]) for e in experts])
    state["mlp.experts.down_proj"] = torch.stack([mtp[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    layer.load_state_dict(state)

    def norm(name: str) -> DeepseekV3RMSNorm:
        n = DeepseekV3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        n.weight.data.copy_(mtp[f"{name}.weight"])
        return n

    enorm, hnorm, final = norm("enorm"), norm("hnorm"), norm("shared_head.norm")
    kept = {}
    hf.model.layers[-1].register_forward_hook(lambda _m, _i, out: kept.update(h=out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        hf(torch.tensor([tokens]))
        h = kept["h"][0, :-1]  # the target's pre-norm hidden states at positions 0 .. n-2
        emb = mtp["embed_tokens.weight"]
        logits = []
        for step in range(2):
            ids = torch.tensor(tokens[1:] + [draft] * step)
            u = torch.cat([enorm(emb[ids]), hnorm(h)], dim=-1) @ mtp["eh_proj.weight"].t()
            pos = torch.arange(len(ids))[None]
            mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
            out = layer(u[None], attention_mask=mask, position_ids=pos, position_embeddings=hf.model.rotary_emb(u[None], pos))
            out = (out[0] if isinstance(out, tuple) else out)[0]
            logits.append(final(out[-1]) @ mtp["shared_head.head.weight"].t())
            h = torch.cat([h, out[-1:]])  # chained: the MTP's own pre-norm hidden state
    return logits[0], logits[1]


def _parts(path: str, algorithm: str | None, **kw):
    rt = build_parts(ServerArgs(model_path=path, max_total_tokens=2048, speculative_algorithm=algorithm, **kw))
    if algorithm is not None:  # always draft: every step verifies MTP drafts
        rt.scheduler.speculator.gate.plan = lambda _req, max_tokens, *a, **k: max_tokens
    return rt


def _greedy(rt, rounds: int = 2, **params) -> list[list[int]]:
    d = Driver(rt)
    for _ in range(rounds):  # the second round hits the radix cache
        rids = [d.add(p, max_new_tokens=16, temperature=0.0, ignore_eos=True, **params) for p in PROMPTS]
        d.run()
    rt.scheduler.check_accounting()
    return [d.results[r].output_ids for r in rids]


def test_mtp_logits_equal_the_formula_from_the_checkpoints_tensors(mtp_dir):
    rt = _parts(mtp_dir, "mtp")
    proposer = rt.scheduler.speculator.model
    assert proposer.model.embed_tokens is rt.runner.model.embed_tokens and proposer.model.lm_head is rt.runner.model.lm_head  # equal: shared
    rt.scheduler.speculator.step = lambda *a, **k: None  # proposals made by hand below
    d = Driver(rt)
    d.add(PROMPTS[0], max_new_tokens=8, temperature=0.0, ignore_eos=True)
    d.step()
    req = rt.scheduler.running[0]
    seen = []
    forward = proposer._forward
    proposer._forward = lambda rows: seen.append(forward(rows)) or seen[-1]
    (prop,) = proposer.propose([req], [2])
    first, second = _reference_mtp(mtp_dir, req.fill_ids, prop.tokens[0])
    torch.testing.assert_close(proposer.model.compute_logits(seen[0])[0], first, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(proposer.model.compute_logits(seen[1])[0], second, atol=1e-4, rtol=1e-4)
    assert prop.tokens == [int(first.argmax()), int(second.argmax())]


@pytest.mark.parametrize("page_size", [4])
def test_greedy_output_with_mtp_drafts_equals_output_without_speculation(mtp_dir, page_size):
    plain = _greedy(_parts(mtp_dir, None, page_size=page_size))
    rt = _parts(mtp_dir, "mtp", page_size=page_size)
    assert _greedy(rt) == plain
    stats = rt.scheduler.speculator.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_verify_passes"] > 0
    assert 0 <= stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    assert rt.scheduler.speculator.model._passes > 0


def test_accepted_mtp_drafts_are_counted(mtp_dir):
    rt = _parts(mtp_dir, "mtp")
    d = Driver(rt)
    rids = [d.add(p, max_new_tokens=16, temperature=0.0, ignore_eos=True) for p in PROMPTS]
    d.run()
    metas = [d.results[r].meta_info for r in rids]
    stats = rt.scheduler.speculator.stats()
    assert stats["spec_draft_tokens"] == sum(m["spec_draft_tokens"] for m in metas)
    assert stats["spec_accepted_tokens"] == sum(m["spec_accepted_tokens"] for m in metas)


def test_an_mtp_proposal_that_raises_leaves_outputs_unchanged(mtp_dir):
    plain = _greedy(_parts(mtp_dir, None), rounds=1)
    rt = _parts(mtp_dir, "mtp")
    proposer = rt.scheduler.speculator.model
    proposer._forward, calls = failing_every(proposer._forward, 3, 1, "mtp pass failed")  # the first: a catch-up inside observe
    assert _greedy(rt, rounds=1) == plain
    assert calls["n"] > 3 and rt.scheduler.speculator.stats()["spec_draft_tokens"] > 0
    rt.kv.check_accounting([])


def test_mtp_on_a_model_without_mtp_weights_is_refused_naming_the_option(tmp_path, tiny_llama):
    v3 = make_tiny_model("deepseek_v3", tmp_path / "v3", seed=4)
    for path in (v3, tiny_llama):
        with pytest.raises(ValueError, match="speculative_algorithm 'mtp'"):
            build_parts(ServerArgs(model_path=path, max_total_tokens=2048, speculative_algorithm="mtp"))
    declared = tmp_path / "declared"  # the config declares an MTP layer the tensors do not hold
    shutil.copytree(v3, declared)
    cfg = json.loads((declared / "config.json").read_text())
    (declared / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match="speculative_algorithm 'mtp'"):
        build_parts(ServerArgs(model_path=str(declared), max_total_tokens=2048, speculative_algorithm="mtp"))


def test_an_fp8_checkpoints_mtp_layer_is_read_alone_and_drafts(mtp_dir, tmp_path):
    """An FP8 (block-scaled) V3 with its MTP layer: the target serves its FP8 weights as stored,
    the MTP reads only its own layer's tensors (dequantized), and greedy output is unchanged."""
    import re

    from quantized_checkpoints import fp8_quantize, fp8_value, write_quantized

    from radixlm.runtime.checkpoints import folder

    def quantize(key: str, w: torch.Tensor):
        weight, scale = fp8_quantize(w, "block", (32, 32))
        return {key: weight, key.replace(".weight", ".weight_scale_inv"): scale}, fp8_value(weight, scale, (32, 32))

    every_linear = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.[\w.]*_proj(_with_mqa)?\.weight$").search
    write_quantized(mtp_dir, tmp_path / "fp8", tmp_path / "dense", quantize, {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}, only=every_linear)
    read = []
    real = folder.dense_tensors
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("radixlm.runtime.speculative.mtp.dense_tensors", lambda path, prefix: read.extend(n for n, _ in real(path, prefix)) or real(path, prefix))
        rt = _parts(str(tmp_path / "fp8"), "mtp")
    assert read and all(n.startswith("model.layers.2.") for n in read) and any("eh_proj" in n for n in read)
    assert _greedy(rt, rounds=1) == _greedy(_parts(str(tmp_path / "fp8"), None), rounds=1)
    assert rt.scheduler.speculator.stats()["spec_draft_tokens"] > 0
