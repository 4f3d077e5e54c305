"""RoPE for every rope_type against transformers: frequencies, cos/sin tables, partial rotary."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply_rotary
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary

from radixlm.runtime.layers import rope

HEAD_DIM, MAX_POS, ORIGINAL = 64, 512, 128
ATOL = 1e-6


def _llama(max_position_embeddings: int = MAX_POS, **rope_parameters) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings, rope_parameters=rope_parameters,
    )


def _phi3(partial: float = 0.75, **rope_parameters) -> Phi3Config:
    pairs = int(HEAD_DIM * partial) // 2
    rope_parameters.setdefault("short_factor", [1.0 + 0.05 * i for i in range(pairs)])
    rope_parameters.setdefault("long_factor", [1.0 + 1.5 * i for i in range(pairs)])
    return Phi3Config(
        hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=partial,
        max_position_embeddings=8 * MAX_POS, original_max_position_embeddings=MAX_POS,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, **rope_parameters},
    )


CONFIGS = {
    "default": lambda: _llama(rope_type="default", rope_theta=10000.0),
    "linear": lambda: _llama(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "dynamic": lambda: _llama(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
    "yarn": lambda: _llama(  # Qwen-like: 4 x a 4k pre-training length, so beta_fast/slow bound the ramp
        max_position_embeddings=16384, rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=4096,
    ),
    "yarn_mscale_untruncated": lambda: _llama(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=ORIGINAL,
        mscale=0.707, mscale_all_dim=1.0, truncate=False, beta_fast=16, beta_slow=2,
    ),
    "yarn_attention_factor": lambda: _llama(
        rope_type="yarn", rope_theta=1e6, factor=8.0, original_max_position_embeddings=ORIGINAL, attention_factor=0.8,
    ),
    "yarn_partial": lambda: _llama(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.5,
    ),
    "llama3": lambda: _llama(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=ORIGINAL,
    ),
    "longrope": lambda: _phi3(),
    "longrope_attention_factor": lambda: _phi3(partial=1.0, attention_factor=1.25),
    "proportional": lambda: _llama(rope_type="proportional", rope_theta=10000.0, partial_rotary_factor=0.25, factor=2.0),
}


def _ours(config, max_positions: int | None = None) -> rope.RotaryEmbedding:
    """Our RotaryEmbedding for a transformers config, built as a model would build it."""
    params = dict(config.rope_parameters)
    kind = params["rope_type"]
    rotary_dim = HEAD_DIM if kind == "proportional" else int(HEAD_DIM * params.get("partial_rotary_factor", 1.0))
    return rope.RotaryEmbedding(
        HEAD_DIM, max_positions or config.max_position_embeddings, params["rope_theta"], params,
        rotary_dim=rotary_dim, max_position_embeddings=config.max_position_embeddings,
    )


def _reference_frequencies(config, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[kind](config, seq_len=seq_len)


def _reference_table(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin ``[T, rotary_dim/2]`` from a fresh rotary module fed one sequence."""
    module = (Phi3RotaryEmbedding if isinstance(config, Phi3Config) else LlamaRotaryEmbedding)(config)
    cos, sin = module(torch.zeros(1, dtype=torch.float32), positions[None])
    half = cos.shape[-1] // 2
    assert torch.equal(cos[0, :, :half], cos[0, :, half:])  # rotate-half: each angle twice
    return cos[0, :, :half], sin[0, :, :half]


def _assert_table(ours: tuple[torch.Tensor, torch.Tensor], reference: tuple[torch.Tensor, torch.Tensor]) -> None:
    torch.testing.assert_close(ours[0][:, 0], reference[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(ours[1][:, 0], reference[1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_frequencies_and_attention_factor_equal_transformers(case):
    config = CONFIGS[case]()
    rotary = _ours(config)
    ref_inv_freq, ref_factor = _reference_frequencies(config)
    inv_freq, factor = rope.rope_frequencies(
        rotary.rotary_dim, rotary.theta, rotary.scaling, max_position_embeddings=config.max_position_embeddings
    )
    assert torch.equal(inv_freq, ref_inv_freq)
    assert factor == pytest.approx(ref_factor, rel=1e-12)
    assert torch.equal(rotary.inv_freq, ref_inv_freq) and rotary.attention_factor == factor


@pytest.mark.parametrize(("case", "seq_len"), [("dynamic", MAX_POS), ("dynamic", MAX_POS + 1), ("dynamic", 3 * MAX_POS + 7), ("longrope", MAX_POS), ("longrope", MAX_POS + 1)])
def test_length_dependent_frequencies_equal_transformers(case, seq_len):
    config = CONFIGS[case]()
    rotary = _ours(config)
    ref_inv_freq, ref_factor = _reference_frequencies(config, seq_len)
    inv_freq, factor = rope.rope_frequencies(
        rotary.rotary_dim, rotary.theta, rotary.scaling, max_position_embeddings=config.max_position_embeddings, seq_len=seq_len
    )
    assert torch.equal(inv_freq, ref_inv_freq)
    assert factor == pytest.approx(ref_factor, rel=1e-12)


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_table_equals_the_transformers_rotary_module_within_the_original_length(case):
    config = CONFIGS[case]()
    rotary = _ours(config)
    length = MAX_POS  # the whole table; for dynamic and longrope exactly their original length
    positions = torch.arange(length)
    _assert_table(rotary.table(positions, torch.float32), _reference_table(config, positions))
    shuffled = torch.randperm(length, generator=torch.Generator().manual_seed(0))  # a batch indexes rows in any order
    _assert_table(rotary.table(shuffled, torch.float32), _reference_table(config, shuffled))


@pytest.mark.parametrize("case", ["dynamic", "longrope"])
def test_past_the_original_length_a_token_is_rotated_as_the_last_of_its_prefix(case):
    config = CONFIGS[case]()
    rotary = _ours(config, max_positions=3 * MAX_POS)
    for p in (MAX_POS - 1, MAX_POS, MAX_POS + 1, 2 * MAX_POS + 33, 3 * MAX_POS - 1):
        cos, sin = _reference_table(config, torch.arange(p + 1))  # transformers decoding token p
        _assert_table(rotary.table(torch.tensor([p]), torch.float32), (cos[-1:], sin[-1:]))


@pytest.mark.parametrize("case", ["dynamic", "longrope"])
def test_seq_lens_rotate_each_sequence_of_a_batch_as_transformers_rotates_it_whole(case):
    config = CONFIGS[case]()
    rotary = _ours(config, max_positions=3 * MAX_POS)
    lengths = (300, 2 * MAX_POS + 5, MAX_POS, MAX_POS + 1)
    positions = torch.cat([torch.arange(n) for n in lengths])
    seq_lens = torch.cat([torch.full((n,), n) for n in lengths])
    cos, sin = rotary.table(positions, torch.float32, seq_lens)
    start = 0
    for n in lengths:
        _assert_table((cos[start : start + n], sin[start : start + n]), _reference_table(config, torch.arange(n)))
        start += n
    short = seq_lens <= MAX_POS  # within the original length both rules agree
    _assert_table((cos[short], sin[short]), tuple(t[short, 0] for t in rotary.table(positions, torch.float32)))


def test_frequency_key_separates_the_regimes_seq_lens_selects():
    dynamic, longrope, llama3 = (_ours(CONFIGS[c]()) for c in ("dynamic", "longrope", "llama3"))
    assert [longrope.frequency_key(n) for n in (1, MAX_POS, MAX_POS + 1, 4 * MAX_POS)] == [0, 0, 1, 1]
    assert [dynamic.frequency_key(n) for n in (1, MAX_POS, MAX_POS + 1, 4 * MAX_POS)] == [0, 0, MAX_POS + 1, 4 * MAX_POS]
    assert llama3.frequency_key(10 * MAX_POS) == 0


def _heads(seed: int, tokens: int, heads: int) -> torch.Tensor:
    return torch.randn(tokens, heads, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", ["longrope", "yarn_partial"])
@pytest.mark.parametrize("kernel", ["pytorch", "cpp"])  # the C++ kernel rotates the first dims (the decode stack calls it so)
def test_partial_rotary_equals_transformers_phi3_apply_rotary_pos_emb(case, kernel, request, monkeypatch):
    if kernel == "cpp":
        request.getfixturevalue("cpp_ext")
    else:
        monkeypatch.setattr(rope, "cpu_kernels", lambda: None)
    config = CONFIGS[case]()
    rotary = _ours(config)
    assert rotary.rotary_dim < HEAD_DIM
    positions = torch.tensor([0, 1, 2, 50, 127, 300, 511])
    q, k = _heads(1, len(positions), 4), _heads(2, len(positions), 2)
    out_q, out_k = rope.apply_rotary(q, k, rotary.table(positions, torch.float32))
    cos, sin = (torch.cat((t, t), dim=-1)[None] for t in _reference_table(config, positions))
    ref_q, ref_k = phi3_apply_rotary(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(out_q, ref_q[0].transpose(0, 1), atol=ATOL, rtol=0)
    torch.testing.assert_close(out_k, ref_k[0].transpose(0, 1), atol=ATOL, rtol=0)
    assert torch.equal(out_q[..., rotary.rotary_dim :], q[..., rotary.rotary_dim :])


@pytest.mark.parametrize("kernel", ["pytorch", "cpp"])
def test_whole_head_rotary_equals_transformers_apply_rotary_pos_emb(kernel, request, monkeypatch):
    if kernel == "cpp":
        request.getfixturevalue("cpp_ext")
    else:
        monkeypatch.setattr(rope, "cpu_kernels", lambda: None)
    config = CONFIGS["llama3"]()
    rotary = _ours(config)
    positions = torch.tensor([0, 3, 64, 200, 511])
    q, k = _heads(3, len(positions), 4), _heads(4, len(positions), 2)
    out_q, out_k = rope.apply_rotary(q, k, rotary.table(positions, torch.float32))
    cos, sin = (torch.cat((t, t), dim=-1)[None] for t in _reference_table(config, positions))
    ref_q, ref_k = llama_apply_rotary(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(out_q, ref_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_k, ref_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["dynamic", "longrope", "yarn"])
def test_built_on_the_meta_device_then_rebuilt_equals_built_on_the_cpu(case):
    config = CONFIGS[case]()
    with torch.device("meta"):
        meta = _ours(config, max_positions=2 * MAX_POS)
    assert meta.cos.is_meta
    meta.rebuild("cpu")
    cpu = _ours(config, max_positions=2 * MAX_POS)
    assert torch.equal(meta.cos, cpu.cos) and torch.equal(meta.sin, cpu.sin) and torch.equal(meta.inv_freq, cpu.inv_freq)


def test_unknown_rope_type_is_refused_naming_it_and_the_supported_ones():
    with pytest.raises(ValueError, match=r"'mrope'.*default, linear, dynamic, yarn, longrope, llama3, proportional"):
        rope.RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0, {"rope_type": "mrope"})
    with pytest.raises(ValueError, match="'ntk'"):
        rope.rope_inv_freq(HEAD_DIM, 10000.0, {"type": "ntk"})


def test_the_positional_signature_and_rope_inv_freq_still_serve_plain_and_llama3_rope():
    config = CONFIGS["llama3"]()
    params = dict(config.rope_parameters)
    rotary = rope.RotaryEmbedding(HEAD_DIM, MAX_POS, params["rope_theta"], params)
    assert rotary.rotary_dim == HEAD_DIM and rotary.cos.dtype == torch.float32
    assert torch.equal(rope.rope_inv_freq(HEAD_DIM, params["rope_theta"], params), _reference_frequencies(config)[0])
    plain = rope.RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0, None)
    assert torch.equal(plain.inv_freq, _reference_frequencies(CONFIGS["default"]())[0])
