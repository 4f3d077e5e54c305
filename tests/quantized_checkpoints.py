"""Test-side quantizers: a dense checkpoint folder's linear weights rewritten as GPTQ, AWQ or FP8
safetensors (our own packing of each layout), beside a dense folder of the values they stand for."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds output AWQ_ORDER[i] of its 8


@dataclass
class Int4Groups:
    """RTN int4 of a ``[N, K]`` matrix: ``w = (codes - zero[:, g_idx]) * scale[:, g_idx]``."""

    codes: torch.Tensor  # uint8 [N, K]
    scale: torch.Tensor  # fp16 [N, groups]
    zero: torch.Tensor  # uint8 [N, groups], 0..15
    g_idx: torch.Tensor  # int64 [K]

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix."""
        return (self.codes.float() - self.zero[:, self.g_idx].float()) * self.scale[:, self.g_idx].float()


def int4_groups(w: torch.Tensor, group: int, sym: bool, perm: torch.Tensor | None = None, zero_min: int = 0) -> Int4Groups:
    """Round ``w`` to 4 bits per group (``group`` -1: one per row); groups are the inputs
    ``perm[g*G:(g+1)*G]`` (act-order) when ``perm`` is given, else consecutive ones."""
    n, k = w.shape
    group = k if group == -1 else group
    order = torch.arange(k) if perm is None else perm
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[order] = torch.arange(k) // group
    groups = -(-k // group)
    scale = torch.empty(n, groups)
    zero = torch.empty(n, groups)
    for g in range(groups):
        cols = w[:, g_idx == g].float()
        if sym:
            s = cols.abs().amax(1) / 7.5
            z = torch.full((n,), 8.0)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = (hi - lo) / 15
            z = torch.round(-lo / s.clamp(min=1e-8)).clamp(zero_min, 15)
        scale[:, g], zero[:, g] = s.clamp(min=1e-6), z
    scale = scale.half()
    codes = torch.round(w.float() / scale[:, g_idx].float() + zero[:, g_idx]).clamp(0, 15).to(torch.uint8)
    return Int4Groups(codes, scale, zero.to(torch.uint8), g_idx)


def pack_int32(fields: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """4-bit ``fields`` packed 8 to an int32 along ``dim``: bits ``4i`` hold field ``order[i]`` of each 8."""
    f = fields.to(torch.int64).movedim(dim, -1)
    f = f.reshape(*f.shape[:-1], -1, 8)
    packed = sum(f[..., order[i]] << (4 * i) for i in range(8))
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32).movedim(-1, dim).contiguous()


def gptq_tensors(prefix: str, q: Int4Groups, v1: bool) -> dict[str, torch.Tensor]:
    """GPTQ's tensors for ``q``: qweight [K/8, N], qzeros [groups, N/8] (v1: zero - 1), scales, g_idx."""
    zero = (q.zero.to(torch.int64) - 1) & 0x0F if v1 else q.zero
    return {
        f"{prefix}.qweight": pack_int32(q.codes.t(), 0),
        f"{prefix}.qzeros": pack_int32(zero.t(), 1),
        f"{prefix}.scales": q.scale.t().contiguous(),
        f"{prefix}.g_idx": q.g_idx.to(torch.int32),
    }


def awq_tensors(prefix: str, q: Int4Groups) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM's tensors for ``q``: qweight [K, N/8] and qzeros [groups, N/8] in AWQ's order, scales."""
    return {
        f"{prefix}.qweight": pack_int32(q.codes.t(), 1, AWQ_ORDER),
        f"{prefix}.qzeros": pack_int32(q.zero.t(), 1, AWQ_ORDER),
        f"{prefix}.scales": q.scale.t().contiguous(),
    }


def fp8_quantize(w: torch.Tensor, granularity: str, block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn weight, float32 scale)`` with ``w ~ weight * scale``: one scale
    (``tensor``), ``[N, 1]`` (``channel``) or ``[ceil(N/bn), ceil(K/bk)]`` (``block``)."""
    n, k = w.shape
    w = w.float()
    if granularity == "tensor":
        scale = (w.abs().amax() / 448).reshape(())
        expanded = scale
    elif granularity == "channel":
        scale = w.abs().amax(1, keepdim=True) / 448
        expanded = scale
    else:
        bn, bk = block
        pad = torch.nn.functional.pad(w.abs(), (0, -k % bk, 0, -n % bn))
        scale = pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).amax((1, 3)) / 448
        expanded = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    scale = scale.clamp(min=1e-8)
    expanded = expanded.clamp(min=1e-8)
    return (w / expanded).to(torch.float8_e4m3fn), scale.float()


def fp8_value(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """The float32 matrix a float8 weight and its scale stand for."""
    n, k = weight.shape
    if block is not None:
        scale = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return weight.float() * scale


# a quantizer: (dense name, weight) -> (tensors to store in its place, the values they stand for)
Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def write_quantized(src: str, dst: Path, dense_dst: Path, quantize: Quantizer, qconfig: dict, only: Callable[[str], bool] = LINEAR.search) -> dict[str, torch.Tensor]:
    """Copy the folder ``src`` to ``dst`` with every weight ``only`` selects replaced by
    ``quantize``'s tensors and ``quantization_config`` set, and to ``dense_dst`` with those weights
    replaced by the values they stand for; returns those values by dense name."""
    tensors = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    quantized, dense, values = {}, {}, {}
    for name, t in tensors.items():
        if only(name):
            stored, value = quantize(name, t)
            quantized.update(stored)
            values[name] = value
            dense[name] = value.to(t.dtype)
        else:
            quantized[name] = dense[name] = t
    for folder, state, q in ((dst, quantized, qconfig), (dense_dst, dense, None)):
        folder.mkdir(parents=True, exist_ok=True)
        for f in Path(src).iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                shutil.copy(f, folder / f.name)
        cfg = json.loads((folder / "config.json").read_text())
        cfg.pop("quantization_config", None)
        if q is not None:
            cfg["quantization_config"] = q
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return values


def folder_getter(folder: Path) -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """The tensor names of a one-file folder and a ``get(name)`` over them."""
    state = load_file(str(folder / "model.safetensors"))
    return sorted(state), state.__getitem__


def engine_greedy(path: str, prompt: list[int], tokens: int = 16) -> tuple[list[int], list[float]]:
    """The engine's greedy tokens on the checkpoint at ``path`` (float32 on CPU) and their logprobs."""
    import radixlm

    with radixlm.Engine(model_path=path, max_total_tokens=1024) as eng:
        out = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}, return_logprob=True)
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def greedy_gaps(dense_dir: str, prompt: list[int], output: list[int]) -> list[float]:
    """For each output token, how far its logit is below the best one of the dense model (in
    ``dense_dir``, run by transformers) given the same prefix: all zero for its greedy tokens."""
    from helpers import load_hf_model

    model = load_hf_model(dense_dir)
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(output)])).logits[0, len(prompt) - 1 : -1]
    return [float(row.max() - row[t]) for row, t in zip(logits, output)]


def dense_copies(model: torch.nn.Module) -> list[str]:
    """The decoder layers' linear layers holding a dense float copy of their weight: a float tensor
    of at least an eighth of ``out_features * in_features`` elements (int4 scales are 1/32 of it)."""
    found = []
    for name, module in model.named_modules():
        if ".layers." not in f".{name}." or not hasattr(module, "out_features") or not hasattr(module, "in_features"):
            continue
        size = module.out_features * module.in_features
        tensors = [*module.parameters(), *module.buffers()]
        if any(t.is_floating_point() and t.numel() * 8 >= size and t is not getattr(module, "bias", None) for t in tensors):
            found.append(name)
    return found
