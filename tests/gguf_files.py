"""Test-side GGUF writing: tiny Hugging Face checkpoints converted to GGUF files of chosen types.

The ``gguf`` package quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0; for the K-quants it only
dequantizes, so ``quantize_q4_k`` and ``quantize_q6_k`` below write those blocks from the formats'
published layouts (ggml's ``block_q4_K`` and ``block_q6_K``), with plain min/max scales rather
than llama.cpp's searched ones. The ``gguf`` package's dequantizer is the reference they are
checked against.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """``w`` [rows, K] (K a multiple of 256) as Q4_K blocks: per 256, fp16 d and dmin, 12 bytes of
    6-bit sub-block scales and minimums, 128 bytes of codes; ``w ~ d * sc * q - dmin * m``."""
    rows, k = w.shape
    sub = w.astype(np.float32).reshape(rows, k // 256, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / 15
    d = np.maximum(scale.max(-1), 1e-8) / 63
    dmin = np.maximum((-lo).max(-1), 1e-8) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(scale / d16.astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / dmin16.astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    step = d16.astype(np.float32)[..., None] * sc
    offset = dmin16.astype(np.float32)[..., None] * m
    q = np.clip(np.round((sub + offset[..., None]) / np.where(step > 0, step, 1)[..., None]), 0, 15).astype(np.uint8)
    scales = np.zeros((rows, k // 256, 12), np.uint8)
    scales[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = m[..., 0:4] | ((m[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:8] & 0xF) | ((m[..., 4:8] & 0xF) << 4)
    qs = (q[:, :, 0::2, :] | (q[:, :, 1::2, :] << 4)).reshape(rows, k // 256, 128)  # sub-block 2i low, 2i+1 high
    blocks = np.concatenate([_fp16_bytes(d16), _fp16_bytes(dmin16), scales, qs], axis=-1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """``w`` [rows, K] (K a multiple of 256) as Q6_K blocks: per 256, 128 bytes of low 4 bits, 64 of
    high 2 bits, 16 int8 sub-block scales, fp16 d; ``w ~ d * sc * (q - 32)``, per 16 weights."""
    rows, k = w.shape
    sub = w.astype(np.float32).reshape(rows, k // 256, 16, 16)
    amax = np.abs(sub).max(-1)
    scale = amax / 31
    d = np.maximum(np.abs(scale).max(-1), 1e-8) / 127
    d16 = d.astype(np.float16)
    sc = np.clip(np.round(scale / d16.astype(np.float32)[..., None]), -128, 127).astype(np.int8)
    step = d16.astype(np.float32)[..., None] * sc
    q = np.clip(np.round(sub / np.where(step != 0, step, 1)[..., None]) + 32, 0, 63).astype(np.uint8).reshape(rows, k // 256, 256)
    ql = np.zeros((rows, k // 256, 128), np.uint8)
    qh = np.zeros((rows, k // 256, 64), np.uint8)
    for half in range(2):  # each half of 128 weights: ql 64 bytes, qh 32 bytes
        base = q[..., 128 * half : 128 * (half + 1)]
        a, b, c, e = base[..., 0:32], base[..., 32:64], base[..., 64:96], base[..., 96:128]
        ql[..., 64 * half : 64 * half + 32] = (a & 0xF) | ((c & 0xF) << 4)
        ql[..., 64 * half + 32 : 64 * half + 64] = (b & 0xF) | ((e & 0xF) << 4)
        qh[..., 32 * half : 32 * (half + 1)] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), _fp16_bytes(d16)], axis=-1)
    return blocks.reshape(rows, -1)


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """``w`` [rows, K] as raw blocks of the GGML type named ``qtype`` (uint8 [rows, row_bytes])."""
    if qtype == "Q4_K":
        return quantize_q4_k(w)
    if qtype == "Q6_K":
        return quantize_q6_k(w)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    return gguf_quantize(w.astype(np.float32), GGMLQuantizationType[qtype])


def dequantize(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """The gguf package's dequantization of ``blocks`` (the reference)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(blocks, GGMLQuantizationType[qtype])


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's interleaved-RoPE row order of a q or k projection (what conversion writes)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_folder: str, out: Path, type_of) -> Path:
    """The tiny checkpoint in ``hf_folder`` as a GGUF file: each 2-D weight (GGUF name) in the
    type ``type_of(name)`` returns (a GGML type name, or ``F32``), norms and biases in F32."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from safetensors.torch import load_file

    cfg = json.loads((Path(hf_folder) / "config.json").read_text())
    arch = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}[cfg["architectures"][0]]
    tensors = load_file(str(Path(hf_folder) / "model.safetensors"))
    writer = GGUFWriter(str(out), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    for name, t in tensors.items():
        if name in GGUF_NAMES:
            gname = GGUF_NAMES[name]
        else:
            parts = name.split(".")  # model.layers.N.<module>.<kind>
            module = ".".join(parts[3:-1])
            if module not in LAYER_NAMES:
                continue
            gname = f"blk.{parts[2]}.{LAYER_NAMES[module]}.{parts[-1]}"
        arr = t.float().numpy()
        if arch != "qwen2" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg["num_attention_heads"] if "attn_q" in gname else cfg["num_key_value_heads"]
            arr = _permute(arr, heads)
        qtype = type_of(gname) if arr.ndim == 2 else "F32"
        if qtype == "F32":
            writer.add_tensor(gname, np.ascontiguousarray(arr))
        else:
            writer.add_tensor(gname, quantize(arr, qtype), raw_dtype=GGMLQuantizationType[qtype])
    _finish(writer)
    return out


def torch_blocks(blocks: np.ndarray) -> torch.Tensor:
    """Raw blocks as the uint8 tensor the layers take."""
    return torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.uint8))


FAMILY_ARCHS = {  # HF class -> llama.cpp architecture, for ``write_family_gguf``
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "MixtralForCausalLM": "llama",  # LlamaModel converts Mixtral
    "GptOssForCausalLM": "gpt-oss",
}
_GPT_OSS_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_GPT_OSS_OTHER = re.compile(r"^model\.layers\.(\d+)\.(mlp\.router\.(weight|bias)|self_attn\.sinks)$")
# one expert's projection in a HF checkpoint (transformers 5 saves Mixtral's under its original names)
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight$")
_PROJ = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
EXPERT_LAYOUTS = ("merged", "fused", "per_expert")


def _gguf_tensor(w, name: str, arr: np.ndarray, qtype: str) -> None:
    """Add ``arr`` (2-D or 3-D: quantized along its last dimension) as ``qtype``."""
    from gguf import GGMLQuantizationType

    if qtype == "F32":
        w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
    else:
        blocks = quantize(arr.reshape(-1, arr.shape[-1]), qtype)
        w.add_tensor(name, blocks.reshape(*arr.shape[:-1], blocks.shape[-1]), raw_dtype=GGMLQuantizationType[qtype])


def _add_yarn(w, rope: dict) -> None:
    """YaRN's keys as TextModel.set_gguf_parameters writes them (type, factor, original length, betas)."""
    import gguf

    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast), ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
        if rope.get(key) is not None:
            add(rope[key])


def _add_as(w, name: str, arr: np.ndarray, qtype: str) -> None:
    """Add ``arr`` as ``qtype``, F16 included (the converters' fall-back for tensors a type cannot hold)."""
    if qtype == "F16":
        w.add_tensor(name, arr.astype(np.float16))
    else:
        _gguf_tensor(w, name, arr, qtype)


def _finish(w) -> None:
    """Write the header, the metadata and the tensors, and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _experts_as_written(tensors: dict[str, np.ndarray], layout: str) -> dict[str, np.ndarray]:
    """The checkpoint's per-expert projections as GGUF tensors: ``merged`` as today's converter
    stacks them (``blk.N.ffn_gate_exps.weight``, [experts, rows, columns]); ``fused`` as it does with
    ``--fuse-gate-up-exps`` (``ffn_gate_up_exps``: each expert's gate rows, then its up rows);
    ``per_expert`` as llama.cpp's files before 2024 (``blk.N.ffn_gate.E.weight``). The routers too."""
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    out = {}
    for name in list(tensors):
        if m := _ROUTER.match(name):
            out[f"blk.{m.group(1)}.ffn_gate_inp.weight"] = tensors.pop(name)
        elif m := _EXPERT.match(name):
            experts.setdefault((int(m.group(1)), _PROJ[m.group(3)]), {})[int(m.group(2))] = tensors.pop(name)
    for (layer, proj), by_id in sorted(experts.items()):
        stacked = np.stack([by_id[e] for e in range(len(by_id))])
        if layout == "per_expert":
            out.update({f"blk.{layer}.ffn_{proj}.{e}.weight": stacked[e] for e in range(len(by_id))})
        elif layout == "fused" and proj in ("gate", "up"):
            if proj == "gate":
                up = np.stack([experts[layer, "up"][e] for e in range(len(by_id))])
                out[f"blk.{layer}.ffn_gate_up_exps.weight"] = np.concatenate([stacked, up], axis=1)
        else:
            out[f"blk.{layer}.ffn_{proj}_exps.weight"] = stacked
    return out


def _gpt_oss_as_written(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GPT-OSS's stacked experts, routers and sinks as llama.cpp's converter writes them
    (``GptOssModel``): the interleaved ``gate_up_proj`` [experts, in, 2 * inter] split into
    ``ffn_gate_exps``/``ffn_up_exps`` with each expert as [rows, columns], ``down_proj`` likewise,
    biases split the same way; the router as ``ffn_gate_inp``; the sinks as ``attn_sinks.weight``."""
    out = {}
    for name in list(tensors):
        if m := _GPT_OSS_EXPERTS.match(name):
            layer, proj, bias = m.group(1), m.group(2), m.group(3)
            arr = tensors.pop(name)
            kind = "bias" if bias else "weight"
            if not bias:
                arr = arr.transpose(0, 2, 1)  # [experts, rows, columns]
            if proj == "down_proj":
                out[f"blk.{layer}.ffn_down_exps.{kind}"] = np.ascontiguousarray(arr)
            else:
                out[f"blk.{layer}.ffn_gate_exps.{kind}"] = np.ascontiguousarray(arr[:, 0::2])
                out[f"blk.{layer}.ffn_up_exps.{kind}"] = np.ascontiguousarray(arr[:, 1::2])
        elif m := _GPT_OSS_OTHER.match(name):
            layer, what = m.group(1), m.group(2)
            gname = "attn_sinks.weight" if what == "self_attn.sinks" else f"ffn_gate_inp.{m.group(3)}"
            out[f"blk.{layer}.{gname}"] = tensors.pop(name)
    return out


def write_family_gguf(hf_folder: str, out: Path, type_of=lambda name: "F32", experts: str = "merged") -> Path:
    """The tiny checkpoint in ``hf_folder`` (a ``FAMILY_ARCHS`` model, transformers 5 config) as
    llama.cpp's ``convert_hf_to_gguf.py`` writes it: that converter's metadata keys for the
    architecture, tensor names from gguf's own name map, Gemma norms stored as ``1 + w``,
    SmolLM3's and Mixtral's q/k rows permuted, Gemma 2's head left out (always tied), Phi-3's
    longrope factors as tensors, a mixture's experts in the ``experts`` layout (``EXPERT_LAYOUTS``)
    and its routers in F32. Each 2-D or 3-D weight in ``type_of(GGUF name)`` (a GGML type name),
    1-D ones in F32."""
    import gguf
    from gguf import GGUFWriter
    from safetensors.torch import load_file

    cfg = json.loads((Path(hf_folder) / "config.json").read_text())
    arch = FAMILY_ARCHS[cfg["architectures"][0]]
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    heads, kv_heads, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    w = GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters: its own keys, no key_length
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        w.add_rope_dimension_count(int(full.get("partial_rotary_factor", 1.0) * hidden) // heads)
        w.add_rope_freq_base(full["rope_theta"])
        w.add_sliding_window(cfg.get("sliding_window") or 0)
    elif cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters: no RoPE keys at all
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    elif arch != "phi3":  # TextModel.set_gguf_parameters
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        elif full.get("rope_type") == "yarn":
            _add_yarn(w, full)
        w.add_rope_freq_base(full["rope_theta"])
        if "sliding_attention" in rope:
            w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if arch == "gemma3":
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    if arch in ("smollm3", "llama"):  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg.get("head_dim") or hidden // heads)
    if n_experts := cfg.get("num_local_experts") or cfg.get("num_experts"):  # TextModel.set_gguf_parameters
        w.add_expert_count(n_experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "qwen3moe":  # Qwen2MoeModel.set_gguf_parameters
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "gpt-oss":  # GptOssModel.set_gguf_parameters
        w.add_sliding_window(cfg["sliding_window"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_token_list([f"<t{i}>" for i in range(cfg["vocab_size"])])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id), ("pad_token_id", w.add_pad_token_id)):
        if isinstance(cfg.get(key), int):
            add(cfg[key])

    tensors = {k: t.float().numpy() for k, t in load_file(str(Path(hf_folder) / "model.safetensors")).items()}
    if arch == "phi3" and full.get("long_factor"):  # Phi3MiniModel.generate_extra_tensors
        scale = cfg["max_position_embeddings"] / full["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(full["original_max_position_embeddings"])) if scale > 1 else 1.0)
        tensors = {"rope_factors_long.weight": np.array(full["long_factor"], np.float32),
                   "rope_factors_short.weight": np.array(full["short_factor"], np.float32), **tensors}  # fmt: skip
    if arch == "gpt-oss":
        moe = _gpt_oss_as_written(tensors)
    else:
        moe = _experts_as_written(tensors, experts)  # takes the experts and routers out of ``tensors``
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), cfg["num_hidden_layers"])
    for name, arr in {**tensors, **moe}.items():
        if arch == "gemma2" and name == "lm_head.weight":
            continue
        if name.startswith(("rope_factors", "blk.")):
            gname = name
        else:
            base, kind = name.rsplit(".", 1)
            gname = f"{names.get_name(base)}.{kind}"
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            arr = arr + np.float32(1)
        if arch in ("smollm3", "llama") and name.endswith(("q_proj.weight", "k_proj.weight")):
            arr = _permute(arr, heads if "q_proj" in name else kv_heads)
        qtype = type_of(gname) if arr.ndim >= 2 and not gname.endswith(("ffn_gate_inp.weight", ".bias")) else "F32"
        _gguf_tensor(w, gname, arr, qtype)
    _finish(w)
    return out


def metadata_gguf(path: Path, arch: str, kv: dict, layers: int = 2) -> str:
    """A GGUF file of ``arch`` with only metadata (``kv``: key suffix -> value, over a small
    dense model's; None: the key left out) and a token table."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    base = {"block_count": layers, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4,
            "attention.head_count_kv": 2, "attention.key_length": 16, "attention.layer_norm_rms_epsilon": 1e-6}  # fmt: skip
    for key, value in {**base, **kv}.items():
        name = key if key.startswith("tokenizer.") else f"{arch}.{key}"
        if value is None:
            continue
        if isinstance(value, list):
            w.add_array(name, value)
        elif isinstance(value, str):
            w.add_string(name, value)
        elif isinstance(value, float):
            w.add_float32(name, value)
        else:
            w.add_uint32(name, value)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    _finish(w)
    return str(path)


HYBRID_GGUF_ARCHS = {"Qwen3_5ForCausalLM": "qwen35", "Qwen3NextForCausalLM": "qwen3next", "Qwen3_5MoeForCausalLM": "qwen35moe"}  # HF class -> llama.cpp architecture


def _tiled(w: np.ndarray, heads: int, per: int, width: int, axis: int = 0) -> np.ndarray:
    """``_LinearAttentionVReorderBase._reorder_v_heads``: value heads (``width`` each along ``axis``)
    from grouped by key head (``[k0: v0 v1, k1: v0 v1]``) to tiled (``[k0 v0, k1 v0, k0 v1, k1 v1]``)."""
    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    w = w.reshape(heads, per, width, *rest).swapaxes(0, 1).reshape(heads * per * width, *rest)
    return np.moveaxis(w, 0, axis)


def _hybrid_layout(name: str, arr: np.ndarray, arch: str, cfg: dict, ssm_in: bool) -> list[tuple[str, np.ndarray]]:
    """Where the converter moves one HF tensor's elements (``Qwen3NextModel.modify_tensors``, for
    Qwen3.5 after ``_LinearAttentionVReorderBase``'s): value heads tiled (Qwen3.5), the convolution
    squeezed, ``dt_bias`` renamed, Qwen3-Next's ``in_proj_qkvz`` split into q/k/v and z rows (kept
    whole where ``ssm_in``, as older files). HF names (``dt_proj.bias``, ``in_proj_qkv`` ...) out."""
    heads, values = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    per, dk, dv = values // heads, cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    keys = 2 * heads * dk
    if arch in ("qwen35", "qwen35moe") and per > 1 and ".linear_attn." in name:
        if name.endswith("in_proj_qkv.weight"):
            arr = np.concatenate([arr[:keys], _tiled(arr[keys:], heads, per, dv)])
        elif name.endswith("in_proj_z.weight"):
            arr = _tiled(arr, heads, per, dv)
        elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
            arr = _tiled(arr, heads, per, 1)
        elif name.endswith("conv1d.weight"):
            arr = arr.reshape(arr.shape[0], -1)
            arr = np.concatenate([arr[:keys], _tiled(arr[keys:], heads, per, dv)])
        elif name.endswith("out_proj.weight"):
            arr = _tiled(arr, heads, per, dv, axis=1)
    if name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        arr = arr.reshape(arr.shape[0], -1)
    if name.endswith("in_proj_qkvz.weight") and not ssm_in:
        q, k, v, z = np.split(arr.reshape(heads, -1, arr.shape[-1]), np.cumsum([dk, dk, per * dv]), axis=1)
        prefix = name.removesuffix("in_proj_qkvz.weight")
        qkv = np.concatenate([t.reshape(-1, arr.shape[-1]) for t in (q, k, v)])
        return [(prefix + "in_proj_qkv.weight", qkv), (prefix + "in_proj_z.weight", z.reshape(-1, arr.shape[-1]))]
    return [(name, arr)]


def _fused_qkv(tensors: dict[str, np.ndarray], layer_types: list[str]) -> dict[str, np.ndarray]:
    """``--fuse-qkv``: each full-attention layer's q (with its gates), k and v rows as one ``attn_qkv``."""
    out = dict(tensors)
    for i, kind in enumerate(layer_types):
        if kind == "full_attention":
            parts = [out.pop(f"model.layers.{i}.self_attn.{p}_proj.weight") for p in "qkv"]
            out[f"blk.{i}.attn_qkv.weight"] = np.concatenate(parts)
    return out


def hybrid_gguf_layout(hf_folder: str, tensors: dict[str, np.ndarray], ssm_in: bool = False, fuse_qkv: bool = False) -> dict[str, np.ndarray]:
    """``tensors`` (the checkpoint's, by HF name; values or element indices) as the converter lays
    them out in the GGUF file, by GGUF name: no value changed (``write_hybrid_gguf`` does that)."""
    import gguf

    cfg = json.loads((Path(hf_folder) / "config.json").read_text())
    arch = HYBRID_GGUF_ARCHS[cfg["architectures"][0]]
    tensors = dict(tensors)
    moe = _experts_as_written(tensors, "merged")  # takes the experts and routers out of ``tensors``
    if fuse_qkv:
        tensors = _fused_qkv(tensors, cfg["layer_types"])
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), cfg["num_hidden_layers"])
    out = {}
    for hf, arr in tensors.items():
        for name, part in _hybrid_layout(hf, arr, arch, cfg, ssm_in):
            if name.startswith("blk."):
                out[name] = part
            elif name.endswith((".weight", ".bias")):
                base, kind = name.rsplit(".", 1)
                out[f"{names.get_name(base)}.{kind}"] = part
            else:  # A_log: no suffix
                out[names.get_name(name)] = part
    return {**out, **moe}


def hybrid_type(name: str, arr: np.ndarray, outtype: str) -> str:
    """The GGML type the converter gives a tensor at ``--outtype`` F32 or Q8_0: 1-D ones, norms,
    routers, the convolution and tensors not named ``.weight`` in F32; Q8_0 where rows are whole
    blocks of 32, else F16 (its fall-back)."""
    kinds = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", ".ssm_conv1d.weight")
    if outtype == "F32" or arr.ndim <= 1 or name.endswith(("_norm.weight", *kinds)) or not name.endswith(".weight"):
        return "F32"
    return outtype if arr.shape[-1] % 32 == 0 else "F16"


def _mtp_block(tensors: dict[str, np.ndarray], cfg: dict) -> dict[str, np.ndarray]:
    """An MTP block as the converter writes a checkpoint's ``mtp.*`` (``_QwenMtpMixin``): block
    ``num_hidden_layers``, a full-attention layer (here the last one's tensors, halved) plus its
    ``nextn`` tensors."""
    n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    last = max(i for i, kind in enumerate(cfg["layer_types"]) if kind == "full_attention")
    out = {f"blk.{n}.{name.split('.', 2)[2]}": arr * np.float32(0.5) for name, arr in tensors.items() if name.startswith(f"blk.{last}.")}
    rng = np.random.default_rng(0)
    out[f"blk.{n}.nextn.eh_proj.weight"] = rng.normal(0, 0.2, (hidden, 2 * hidden)).astype(np.float32)
    out.update({f"blk.{n}.nextn.{norm}.weight": rng.normal(1, 0.3, hidden).astype(np.float32) for norm in ("enorm", "hnorm", "shared_head_norm")})
    return out


def write_hybrid_gguf(hf_folder: str, out: Path, outtype: str = "F32", ssm_in: bool = False, fuse_qkv: bool = False, mtp: bool = False) -> Path:
    """The tiny Qwen3.5 or Qwen3-Next checkpoint in ``hf_folder`` as llama.cpp's converter writes it
    (``convert_hf_to_gguf.py --outtype f32|q8_0 --no-mtp``; ``--fuse-qkv`` where ``fuse_qkv``): its
    metadata keys, ``hybrid_gguf_layout``'s tensors with ``A_log`` as ``-exp(A_log)`` and every norm
    but ``linear_attn.norm`` as ``1 + w``, each in ``hybrid_type``'s type. ``ssm_in``: Qwen3-Next's
    ``in_proj_qkvz`` whole, as files from before the converter split it. ``mtp``: with one MTP block
    after the model's layers (``_mtp_block``), as the converter writes a checkpoint that has one."""
    from gguf import GGUFWriter
    from safetensors.torch import load_file

    cfg = json.loads((Path(hf_folder) / "config.json").read_text())
    arch = HYBRID_GGUF_ARCHS[cfg["architectures"][0]]
    w = GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"] + mtp)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    if "intermediate_size" in cfg:  # (Qwen3.5-MoE's config has none, and the converter writes none)
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if arch in ("qwen3next", "qwen35moe"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    if arch in ("qwen3next", "qwen35moe"):  # Qwen2MoeModel.set_gguf_parameters
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    if mtp:
        w.add_nextn_predict_layers(1)
    recurrent = [t == "linear_attention" for t in cfg["layer_types"]] + [False] * mtp
    w.add_array(f"{arch}.attention.recurrent_layers", recurrent)  # gguf 0.19 has no add_recurrent_layers
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(cfg["head_dim"] * cfg["rope_parameters"].get("partial_rotary_factor", 0.25)))
    if arch in ("qwen35", "qwen35moe"):  # _Qwen35MRopeMixin: the default sections where the config has none
        w.add_rope_dimension_sections(cfg["rope_parameters"].get("mrope_section", [11, 11, 10, 0]))
    w.add_token_list([f"<t{i}>" for i in range(cfg["vocab_size"])])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id), ("pad_token_id", w.add_pad_token_id)):
        if isinstance(cfg.get(key), int):
            add(cfg[key])

    tensors = {k: t.float().numpy() for k, t in load_file(str(Path(hf_folder) / "model.safetensors")).items()}
    layout = hybrid_gguf_layout(hf_folder, tensors, ssm_in, fuse_qkv)
    if mtp:
        layout.update(_mtp_block(layout, cfg))
    for name, arr in layout.items():
        if name.endswith(".ssm_a"):  # in torch, as the converter computes it
            arr = (-torch.exp(torch.from_numpy(arr))).numpy()
        elif name.endswith("norm.weight") and not name.endswith(".ssm_norm.weight"):
            arr = arr + np.float32(1)
        _add_as(w, name, arr, hybrid_type(name, arr, outtype))
    _finish(w)
    return out


KV_B_FORMS = ("split", "whole")  # DeepSeek's kv_b_proj: as today's converter writes it, and as it did before


def deepseek_gguf_layout(cfg: dict, tensors: dict[str, np.ndarray], kv_b: str = "split") -> dict[str, np.ndarray]:
    """``tensors`` (a DeepSeek-V2/V3 checkpoint's, by HF name) as ``DeepseekV2Model.modify_tensors``
    lays them out, by GGUF name: experts merged, the correction bias named ``exp_probs_b.bias``, and
    ``kv_b_proj`` split per head into ``attn_k_b`` (nope rows, transposed: ``[heads, rank, nope]``)
    and ``attn_v_b`` (``[heads, v, rank]``), or kept whole (``kv_b="whole"``: files from before the split)."""
    import gguf

    tensors = dict(tensors)
    moe = _experts_as_written(tensors, "merged")  # takes the experts and routers out of ``tensors``
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg["num_hidden_layers"])
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    out = {}
    for name, arr in tensors.items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= cfg["num_hidden_layers"]:
            continue  # the MTP layer (skip_mtp)
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        base, kind = name.rsplit(".", 1)
        gname = f"{names.get_name(base)}.{kind}"
        if name.endswith("kv_b_proj.weight") and kv_b == "split":
            per_head = arr.reshape(heads, nope + v, arr.shape[-1])
            out[gname.replace("attn_kv_b", "attn_k_b")] = np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))
            out[gname.replace("attn_kv_b", "attn_v_b")] = np.ascontiguousarray(per_head[:, nope:])
        else:
            out[gname] = arr
    return {**out, **moe}


def deepseek_type(name: str, arr: np.ndarray, qtype: str) -> str:
    """The GGML type the converter gives a tensor it is asked to make ``qtype``: F32 for 1-D
    tensors, norms, routers and tensors not named ``.weight``; F16 where rows are not whole blocks
    (its fall-back)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if qtype == "F32" or arr.ndim <= 1 or name.endswith(("_norm.weight", ".ffn_gate_inp.weight")) or not name.endswith(".weight"):
        return "F32"
    return qtype if arr.shape[-1] % GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0] == 0 else "F16"


def write_deepseek_gguf(hf_folder: str, out: Path, type_of=lambda name: "F32", kv_b: str = "split") -> Path:
    """The tiny DeepSeek-V2/V3 checkpoint in ``hf_folder`` as llama.cpp's converter writes it
    (``DeepseekV2Model``, ``deepseek2``): ``TextModel``'s keys and its own (the latent attention's
    ranks and widths, the experts' routing, YaRN's ``mscale_all_dim`` as 0.1 times it in
    ``yarn_log_multiplier``), ``deepseek_gguf_layout``'s tensors, each in ``deepseek_type(name,
    type_of(name))``. ``kv_b="split"``: as today (MLA as MQA: one KV head, the latent row's widths in
    ``key_length``/``value_length``, the heads' in the ``_mla`` keys); ``"whole"``: as before the
    split (llama.cpp's legacy form: ``attn_kv_b``, the heads' widths in ``key_length``/``value_length``)."""
    import gguf
    from gguf import GGUFWriter
    from safetensors.torch import load_file

    cfg = json.loads((Path(hf_folder) / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {}
    rank, nope, rot, v = cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    w = GGUFWriter(str(out), "deepseek2")
    w.add_block_count(cfg["num_hidden_layers"])  # (skip_mtp: the MTP layer is not written)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1 if kv_b == "split" else cfg["num_key_value_heads"])
    if rope.get("rope_type") == "yarn":
        _add_yarn(w, rope)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("n_group") is not None:
        w.add_expert_group_count(cfg["n_group"])
    if cfg.get("topk_group") is not None:
        w.add_expert_group_used_count(cfg["topk_group"])
    if cfg.get("scoring_func") in ("softmax", "sigmoid"):
        w.add_expert_gating_func(gguf.ExpertGatingFuncType[cfg["scoring_func"].upper()])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank") is not None:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    if kv_b == "split":
        w.add_key_length(rank + rot)
        w.add_value_length(rank)
        w.add_key_length_mla(nope + rot)
        w.add_value_length_mla(v)
    else:
        w.add_key_length(nope + rot)
        w.add_value_length(v)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    if cfg.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rot)
    if rope.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_token_list([f"<t{i}>" for i in range(cfg["vocab_size"])])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id), ("pad_token_id", w.add_pad_token_id)):
        if isinstance(cfg.get(key), int):
            add(cfg[key])

    tensors = {k: t.float().numpy() for k, t in load_file(str(Path(hf_folder) / "model.safetensors")).items()}
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    for name, arr in deepseek_gguf_layout(cfg, tensors, kv_b).items():
        _add_as(w, name, arr, deepseek_type(name, arr, type_of(name)))
    _finish(w)
    return out
