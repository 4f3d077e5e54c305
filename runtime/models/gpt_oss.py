"""GPT-OSS (20B, 120B): attention with sinks over alternating sliding (128) and full layers,
YaRN RoPE, biases on q/k/v/o; routed experts with biases and a clamped SwiGLU.

The router takes the top k of its (biased) logits and a softmax over those k. Checkpoints keep
each layer's experts as stacked tensors, ``mlp.experts.gate_up_proj`` ``[experts, hidden,
2 * inter]`` with gate and up columns interleaved, and ``down_proj`` ``[experts, inter, hidden]``,
or (the published checkpoints) as MXFP4 blocks and scales (``gate_up_proj_blocks``,
``gate_up_proj_scales``, ...), which a ``quant_method: mxfp4`` folder hands over as GGUF MXFP4
weights per expert (``runtime/checkpoints/mxfp4.py``: run as stored); stacked tensors met here
(plain, or blocks outside such a folder) are cut into one Hugging Face-style tensor per expert. The
``harmony`` chat format's channels are read by the chat routes (``entrypoints/openai/harmony.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from radixlm.runtime.layers.mxfp4 import dequantize_mxfp4
from radixlm.runtime.models.dense import DenseArch, DenseForCausalLM
from radixlm.runtime.models.registry import register_family

_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


@register_family(GptOssForCausalLM="gpt_oss")
class GptOssForCausalLM(DenseForCausalLM):
    """Grouped-query attention with sinks, and routed experts (clamped SwiGLU, biases)."""

    arch = DenseArch(sinks=True)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with each layer's stacked experts cut into per-expert gate, up and down tensors."""
        packed: dict[str, torch.Tensor] = {}  # MXFP4 blocks or scales waiting for their other half
        for name, source in super().checkpoint_tensors(weights):
            m = _STACKED.match(name)
            if m is None:
                yield name, source
                continue
            prefix, proj, kind = m.groups()
            if kind in ("_blocks", "_scales"):
                other = f"{prefix}.{proj}{'_scales' if kind == '_blocks' else '_blocks'}"
                if other not in packed:
                    packed[name] = source[:]
                    continue
                blocks, scales = (source[:], packed.pop(other)) if kind == "_blocks" else (packed.pop(other), source[:])
                yield from _per_expert(prefix, proj, dequantize_mxfp4(blocks, scales), rows_first=True)
            elif kind == "_bias":
                yield from _per_expert(prefix, proj, source[:], bias=True)
            else:
                yield from _per_expert(prefix, proj, source[:].float(), rows_first=False)
        if packed:
            raise ValueError(f"MXFP4 tensors without their blocks or scales: {sorted(packed)[:3]}")


def _per_expert(prefix: str, proj: str, stacked: torch.Tensor, rows_first: bool = True, bias: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """One expert's tensors of a stacked ``[experts, ...]`` tensor, named as a per-expert checkpoint
    names them; ``rows_first``: each expert's matrix is ``[out, in]`` (MXFP4) rather than ``[in, out]``."""
    kind = "bias" if bias else "weight"
    for e, tensor in enumerate(stacked):
        if not bias and not rows_first:
            tensor = tensor.t()
        if proj == "down_proj":
            yield f"{prefix}.{e}.down_proj.{kind}", tensor.contiguous()
        else:  # gate and up interleaved along the output rows
            yield f"{prefix}.{e}.gate_proj.{kind}", tensor[0::2].contiguous()
            yield f"{prefix}.{e}.up_proj.{kind}", tensor[1::2].contiguous()
