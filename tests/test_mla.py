"""DeepSeek's multi-head latent attention: the absorbed form equals the expanded one on every
attention path, the latent pool's bytes (and their ratio to per-head K/V at DeepSeek-V2-Lite's
shape), PD transfer of a latent pool, 8-bit latent pools in the engine, the DeepSeek settings
the family tests leave at their defaults (a nonzero correction bias, RoPE not interleaved), the
skipped MTP layer, tensor-parallel refusals, and the backend an MLA model runs on."""

from __future__ import annotations

import pytest
import torch

from helpers import Driver, hf_greedy_divergence, load_hf_model, make_tiny_model
from radixlm import ServerArgs
from radixlm.radix_cache.pool import KVPool
from radixlm.runtime.engine import build_parts
from radixlm.runtime.layers.attention.torch_backend import (
    VERIFY_AS_DECODE_MAX,
    TorchAttentionBackend,
)
from radixlm.runtime.layers.attention_spec import AttentionSpec
from radixlm.runtime.layers.forward_batch import ForwardBatch
from radixlm.runtime.layers.mla import (
    LatentProjection,
    MLASpec,
    absorb_query,
    expand_output,
    expanded_attention,
)
from radixlm.runtime.models.config import ModelConfig
from radixlm.runtime.models.sharding import plan_shard

SPEC = MLASpec(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24)
H, SLOTS = 4, 512
YARN = {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}

# DeepSeek-V2-Lite's config.json (the attention part, and what ModelConfig needs besides)
V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "topk_method": "greedy", "norm_topk_prob": False, "scoring_func": "softmax", "routed_scaling_factor": 1.0,
    "rope_theta": 10000, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 4096},
}  # fmt: skip


def _table(rows: list[list[int]]) -> torch.Tensor:
    table = torch.zeros(len(rows), 128, dtype=torch.int64)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r)
    return table


def _latent_batch(pool: KVPool):
    """Three decode rows sharing a 40-token prefix, a verify row, a long extend over a prefix and
    one without: every path of the PyTorch backend in one pass, over a latent pool."""
    prefix = list(range(300, 220, -2))
    long_e = VERIFY_AS_DECODE_MAX + 3
    rows = [prefix + [10 + i * 5 + j for j in range(i + 2)] for i in range(3)]
    rows += [list(range(100, 112)), list(range(130, 140 + long_e)), list(range(400, 409))]
    prefix_lens = [len(rows[0]) - 1, len(rows[1]) - 1, len(rows[2]) - 1, 9, 10, 0]
    extend_lens = [len(r) - p for r, p in zip(rows, prefix_lens)]
    pool.write(0, torch.arange(1, SLOTS), torch.randn(SLOTS - 1, 1, SPEC.row_dim), None)
    total = sum(extend_lens)
    batch = ForwardBatch(
        input_ids=torch.zeros(total, dtype=torch.int64), positions=torch.zeros(total, dtype=torch.int64),
        out_slots=torch.tensor([s for r, p in zip(rows, prefix_lens) for s in r[p:]]), req_rows=torch.arange(len(rows)),
        prefix_lens=prefix_lens, extend_lens=extend_lens, num_decode=3, logits_indices=torch.tensor([]),
        req_to_token=_table(rows), kv_pool=pool, attn_backend=TorchAttentionBackend(),
    )  # fmt: skip
    return batch, rows


@pytest.mark.parametrize("kv_format", ["auto", "int8", "fp8_e4m3"])
def test_absorbed_attention_over_the_latent_pool_equals_the_expanded_form(kv_format):
    """Queries absorbed into the latent space, one shared latent row a token (decode, cascade
    decode, verify and extend paths), then W_UV: transformers' expanded per-head K/V attention,
    up to fp32 rounding (on an 8-bit pool: over the rows as the pool stores them)."""
    torch.manual_seed(0)
    pool = KVPool(SLOTS, 1, 1, SPEC.row_dim, torch.float32, kv_format=kv_format, latent_dim=SPEC.kv_lora_rank)
    batch, rows = _latent_batch(pool)
    kv_b = LatentProjection(H, SPEC)
    torch.nn.init.normal_(kv_b.weight, std=0.3)
    total = batch.out_slots.numel()
    q_nope, q_pe = torch.randn(total, H, SPEC.qk_nope_head_dim), torch.randn(total, H, SPEC.qk_rope_head_dim)
    new_rows = torch.randn(total, 1, SPEC.row_dim)
    scale = SPEC.softmax_scale(YARN)
    backend = batch.attn_backend
    backend.init_forward_metadata(batch)
    assert len(batch.attn_meta.decode.groups) == 1 and len(batch.attn_meta.extend_rows) == 2
    with torch.no_grad():
        q = torch.cat([absorb_query(q_nope, kv_b.w_uk), q_pe], dim=-1)
        latent_out = backend.forward(q, new_rows, new_rows[..., : SPEC.kv_lora_rank], 0, batch, AttentionSpec(scale))
        out = expand_output(latent_out.view(total, H, SPEC.kv_lora_rank), kv_b.w_uv)
        stored, _ = pool.read(0, torch.arange(SLOTS), torch.float32)  # every row as the pool keeps it
        start = 0
        for r, p, e in zip(rows, batch.prefix_lens, batch.extend_lens):
            seen = stored[torch.tensor(r), 0]
            mask = torch.arange(p + e)[None, :] <= torch.arange(p, p + e)[:, None]
            ref = expanded_attention(q_nope[start : start + e], q_pe[start : start + e], seen[:, : SPEC.kv_lora_rank],
                                     seen[:, SPEC.kv_lora_rank :], kv_b.weight, SPEC.v_head_dim, scale, mask)  # fmt: skip
            torch.testing.assert_close(out[start : start + e], ref, atol=3e-5, rtol=3e-5)
            start += e


def test_the_softmax_scale_takes_yarns_mscale_squared_as_transformers_does():
    from transformers.modeling_rope_utils import yarn_apply_mscale

    assert SPEC.softmax_scale(YARN) == pytest.approx(yarn_apply_mscale(YARN, SPEC.qk_head_dim**-0.5), rel=1e-12)
    assert SPEC.softmax_scale(YARN) > SPEC.qk_head_dim**-0.5 * 1.5  # factor 40: mscale 1.26, squared
    assert SPEC.softmax_scale(None) == SPEC.qk_head_dim**-0.5


@pytest.mark.parametrize("kv_format, elem", [("auto", 4), ("bfloat16", 2), ("int8", 1), ("fp8_e5m2", 1)])
def test_latent_pool_bytes_per_token_are_one_row_a_layer(kv_format, elem):
    layers = 3
    scale_bytes = 2 if elem == 1 else 0  # an 8-bit row's fp16 scale
    want = layers * (SPEC.row_dim * elem + scale_bytes)
    assert KVPool.bytes_per_token(layers, 1, SPEC.row_dim, torch.float32, kv_format, SPEC.kv_lora_rank) == want
    pool = KVPool(64, layers, 1, SPEC.row_dim, torch.float32, kv_format=kv_format, latent_dim=SPEC.kv_lora_rank)
    assert pool.token_bytes() == want and pool.nbytes() == 64 * want
    assert pool.v[0].untyped_storage().data_ptr() == pool.k[0].untyped_storage().data_ptr()  # values are not stored twice


def test_latent_pool_against_per_head_kv_at_deepseek_v2_lite_shape():
    """V2-Lite stores 576 numbers a token and layer (512 latent + 64 RoPE) where per-head K/V would
    store 16 heads x (192 key + 128 value) = 5120: 8.9x fewer bytes, in every dtype."""
    cfg = ModelConfig.from_hf_dict(V2_LITE)
    heads, width, latent = cfg.kv_layout()
    assert (heads, width, latent) == (1, 576, 512)
    latent_bytes = KVPool.bytes_per_token(cfg.num_layers, heads, width, torch.bfloat16, "auto", latent)
    assert latent_bytes == 27 * 576 * 2 == 31104
    mla = cfg.mla
    per_head_bytes = cfg.num_layers * cfg.num_heads * (mla.qk_head_dim + mla.v_head_dim) * 2
    assert per_head_bytes == 27 * 16 * (192 + 128) * 2 == 276480
    assert per_head_bytes / latent_bytes == pytest.approx(5120 / 576) and per_head_bytes / latent_bytes > 8.88
    assert cfg.sparse(0) is False and cfg.sparse(1) is True  # first_k_dense_replace


@pytest.mark.parametrize("kv_format", ["auto", "int8", "fp8_e4m3"])
def test_gather_and_scatter_tokens_round_trip_a_latent_pool(kv_format):
    """PD transfer rows: a latent row (and its scale) per layer, landing at other slots of another pool."""
    torch.manual_seed(1)
    src = KVPool(64, 2, 1, SPEC.row_dim, torch.float32, kv_format=kv_format, latent_dim=SPEC.kv_lora_rank)
    dst = KVPool(64, 2, 1, SPEC.row_dim, torch.float32, kv_format=kv_format, latent_dim=SPEC.kv_lora_rank)
    slots, there = torch.tensor([3, 9, 10, 40]), torch.tensor([50, 7, 8, 21])
    for layer in range(2):
        src.write(layer, slots, torch.randn(4, 1, SPEC.row_dim), None)
    data = src.gather_tokens(slots)
    assert data.dtype == torch.uint8 and data.shape == (4, src.token_bytes())
    dst.scatter_tokens(there, data)
    for layer in range(2):
        k_src, v_src = src.read(layer, slots, torch.float32)
        k_dst, v_dst = dst.read(layer, there, torch.float32)
        assert torch.equal(k_src, k_dst) and torch.equal(v_src, v_dst)
        assert torch.equal(v_dst, k_dst[..., : SPEC.kv_lora_rank])
    assert torch.equal(dst.gather_tokens(there), data)


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory) -> dict:
    """The family tests' tiny DeepSeek checkpoints, a V3 with a nonzero correction bias, and a V3 whose RoPE is not interleaved."""
    root = tmp_path_factory.mktemp("mla")
    dirs = {arch: make_tiny_model(arch, root / arch) for arch in ("deepseek_v2", "deepseek_v3")}
    dirs["v3_plain_rope"] = make_tiny_model("deepseek_v3", root / "v3_plain_rope", seed=2, rope_interleave=False)
    biased = make_tiny_model("deepseek_v3", root / "v3_biased", seed=3)
    hf = load_hf_model(biased)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:  # large enough to change which experts win
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
    hf.save_pretrained(biased)
    dirs["v3_biased"] = biased
    dirs["root"] = root
    return dirs


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [40, 41, 42], list(range(60, 130)), list(range(60, 100)) + [7, 8, 9]]
NEAR_TIE = 0.02  # top-2 logprob gap under which batching's float noise, rounded to 8 bits, may flip greedy


def _greedy(path: str, arrival: str = "all_at_once", **options) -> tuple[list[list[int]], list[int], object]:
    """Greedy tokens of PROMPTS (run ``one_by_one``, or ``all_at_once`` and then again for cache hits),
    and for each how many come before its first near tie."""
    rt = build_parts(ServerArgs(model_path=path, max_total_tokens=2048, **options))
    d = Driver(rt)
    params = {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True, "return_logprob": True, "top_logprobs_num": 2}
    if arrival == "one_by_one":
        rids = []
        for p in PROMPTS:
            rids.append(d.add(p, **params))
            d.run()
    else:
        for _ in range(2):  # the second round hits the radix cache
            rids = [d.add(p, **params) for p in PROMPTS]
            d.run()
    rt.scheduler.check_accounting()
    outs, sure = [], []
    for rid in rids:
        tops = d.results[rid].meta_info["output_top_logprobs"]
        outs.append(d.results[rid].output_ids)
        sure.append(next((j for j, t in enumerate(tops) if t[0][0] - t[1][0] < NEAR_TIE), len(tops)))
    return outs, sure, rt


@pytest.mark.parametrize("which", ["v3_biased", "v3_plain_rope"])
def test_deepseek_v3_settings_beyond_the_family_checkpoint_match_transformers(which, deepseek_dirs):
    outs, _, _ = _greedy(deepseek_dirs[which])
    hf = load_hf_model(deepseek_dirs[which])
    for prompt, ours in zip(PROMPTS, outs):
        assert hf_greedy_divergence(hf, prompt, ours) is None


@pytest.mark.parametrize("kv_format", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_an_8bit_latent_pool_reports_its_bytes_and_moves_its_rows_with_their_scales(arch, kv_format, deepseek_dirs):
    """One row and one scale a token and layer; batched, cached (radix hits), chunked and paged
    runs on the 8-bit latent pool give each prompt's tokens run alone on it, up to its first near
    tie; and the first layer's attention over it stays near fp32's (the tokens themselves may part
    from fp32's early: a tiny random MoE flips an expert choice on a 1 % change)."""
    ref, _, rt = _greedy(deepseek_dirs[arch])
    cfg = rt.runner.config
    assert rt.runner.kv_pool.latent and rt.runner.kv_bytes_per_token == cfg.num_layers * cfg.mla.row_dim * 4
    alone, sure, rt8 = _greedy(deepseek_dirs[arch], "one_by_one", kv_cache_dtype=kv_format)
    assert rt8.runner.kv_bytes_per_token == cfg.num_layers * (cfg.mla.row_dim + 2)
    assert rt8.runner.kv_pool.format.name == kv_format and rt8.runner.kv_pool.k_scale[0].shape == (rt8.runner.kv_pool.num_slots, 1)
    assert sum(sure) >= len(PROMPTS) * 10, "too many near ties: the comparison says little"
    for options in ({}, {"chunked_prefill_size": 16, "page_size": 16}):
        outs, _, _ = _greedy(deepseek_dirs[arch], kv_cache_dtype=kv_format, **options)
        for i, (ours, want, n) in enumerate(zip(outs, alone, sure)):
            assert ours[:n] == want[:n], f"prompt {i} diverged on the {kv_format} latent pool under {options}"
    exact, rounded = _first_attention(deepseek_dirs[arch], "auto"), _first_attention(deepseek_dirs[arch], kv_format)
    assert (rounded - exact).abs().max() <= {"int8": 0.02, "fp8_e4m3": 0.08}[kv_format] * exact.abs().max()


def _first_attention(path: str, kv_format: str) -> torch.Tensor:
    """Layer 0's attention output over the longest prompt's prefill, on a ``kv_format`` pool."""
    rt = build_parts(ServerArgs(model_path=path, max_total_tokens=512, kv_cache_dtype=kv_format))
    seen = []
    rt.runner.model.layers[0].self_attn.register_forward_hook(lambda module, args, out: seen.append(out.clone()))
    d = Driver(rt)
    d.add(PROMPTS[2], max_new_tokens=1, temperature=0.0)
    d.run()
    return seen[0]


def test_tensor_parallel_splits_heads_and_refuses_more_ranks_than_heads_naming_the_option():
    cfg = ModelConfig.from_hf_dict({**V2_LITE, "num_attention_heads": 2, "num_key_value_heads": 2})
    with pytest.raises(ValueError, match="--tp-size"):
        plan_shard(cfg, 0, 4)
    shard = plan_shard(ModelConfig.from_hf_dict(V2_LITE), 1, 2)
    assert shard.heads == (8, 16)


def test_the_multi_token_prediction_layer_of_a_v3_checkpoint_is_skipped(deepseek_dirs, tmp_path):
    """V3 checkpoints carry their MTP layer as ``model.layers.{num_hidden_layers}``: loaded past, not into the model."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "v3_mtp"
    shutil.copytree(deepseek_dirs["deepseek_v3"], folder)
    tensors = load_file(folder / "model.safetensors")
    extra = {name.replace("model.layers.1.", "model.layers.2."): t.clone() for name, t in tensors.items() if name.startswith("model.layers.1.")}
    extra["model.layers.2.eh_proj.weight"] = torch.randn(64, 128)
    save_file({**tensors, **extra}, folder / "model.safetensors", metadata={"format": "pt"})
    assert _greedy(str(folder))[0] == _greedy(deepseek_dirs["deepseek_v3"])[0]


@pytest.mark.parametrize("kv_format", ["auto", "int8"])
def test_pd_transfer_moves_latent_rows_and_gives_a_single_engines_tokens(kv_format, deepseek_dirs):
    """A prefill engine hands a prompt's latent rows (and their scales) to a decode engine: one row a token and layer travel."""
    from test_disaggregation import GREEDY, assert_clean, paired, run_pair

    from radixlm.runtime.engine import Engine

    path, prompt = deepseek_dirs["deepseek_v2"], list(range(3, 40))
    with Engine(model_path=path, max_total_tokens=1024, page_size=4, kv_cache_dtype=kv_format) as single:
        ref = single.generate(input_ids=prompt, sampling_params=GREEDY)
    with paired(path, page_size=4, kv_cache_dtype=kv_format) as (prefill, decode):
        _, out = run_pair(prefill, decode, prompt, room=7)
        stats = decode.get_stats()
        assert_clean(prefill, decode)
    assert out["output_ids"] == ref["output_ids"]
    sent = out["meta_info"]["pd"]["received_tokens"]
    assert sent == len(prompt) - 1 and stats["pd_transfer_bytes"] == sent * stats["kv_bytes_per_token"]


def test_a_backend_without_latent_pools_gives_way_to_the_torch_backend(deepseek_dirs, monkeypatch):
    """As Triton's does on a GPU: an MLA model runs on the PyTorch backend, a dense model keeps the chosen one."""
    import radixlm.runtime.executor.model_runner as runner_module

    class DenseOnly(TorchAttentionBackend):
        latent_kv = False

    real = runner_module.select_attention_backend
    monkeypatch.setattr(runner_module, "select_attention_backend", lambda name, device: DenseOnly() if name == "auto" else real(name, device))
    rt = build_parts(ServerArgs(model_path=deepseek_dirs["deepseek_v2"], max_total_tokens=512))
    assert type(rt.runner.attn_backend) is TorchAttentionBackend and rt.runner.decode_graphs is None
    dense = make_tiny_model("llama", deepseek_dirs["root"] / "llama")
    assert type(build_parts(ServerArgs(model_path=dense, max_total_tokens=512)).runner.attn_backend) is DenseOnly
