"""GPT-OSS (20B, 120B): attention with sinks over alternating sliding (128) and full layers,
YaRN RoPE, biases on q/k/v/o; routed experts with biases and a clamped SwiGLU.

The router takes the top k of its (biased) logits and a softmax over those k. Checkpoints keep
each layer's experts as stacked tensors, ``mlp.experts.gate_up_proj`` ``[experts, hidden,
2 * inter]`` with gate and up columns interleaved, and ``down_proj`` ``[experts, inter, hidden]``,
or (the published checkpoints) as MXFP4 blocks and scales (``gate_up_proj_blocks``,
``gate_up_proj_scales``, ...), which a ``quant_method: mxfp4`` folder hands over as GGUF MXFP4
weights per expert (``runtime/checkpoints/mxfp4.py``: run as stored); stacked plain tensors (and
the experts' biases) are cut here into one Hugging Face-style tensor per expert. The
``harmony`` chat format's channels are read by the chat routes (``entrypoints/openai/harmony.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from radixlm.runtime.models.dense import DenseArch, DenseForCausalLM
from radixlm.runtime.models.registry import register_family

_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")


@register_family(GptOssForCausalLM="gpt_oss")
class GptOssForCausalLM(DenseForCausalLM):
    """Grouped-query attention with sinks, and routed experts (clamped SwiGLU, biases)."""

    arch = DenseArch(sinks=True)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with each layer's stacked experts (and their biases) cut into
        per-expert gate, up and down tensors."""
        for name, source in super().checkpoint_tensors(weights):
            m = _STACKED.match(name)
            if m is None:
                yield name, source
            elif m.group(3) == "_bias":
                yield from _per_expert(m.group(1), m.group(2), source[:], bias=True)
            else:
                yield from _per_expert(m.group(1), m.group(2), source[:].float())


def _per_expert(prefix: str, proj: str, stacked: torch.Tensor, bias: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """One expert's tensors of a stacked ``[experts, ...]`` tensor (matrices ``[in, out]``, as
    transformers holds them), named as a per-expert checkpoint names them."""
    kind = "bias" if bias else "weight"
    for e, tensor in enumerate(stacked):
        if not bias:
            tensor = tensor.t()
        if proj == "down_proj":
            yield f"{prefix}.{e}.down_proj.{kind}", tensor.contiguous()
        else:  # gate and up interleaved along the output rows
            yield f"{prefix}.{e}.gate_proj.{kind}", tensor[0::2].contiguous()
            yield f"{prefix}.{e}.up_proj.{kind}", tensor[1::2].contiguous()
