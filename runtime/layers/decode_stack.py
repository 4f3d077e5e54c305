"""Decode steps of a pre-norm decoder on CPUs in one C++ call (``kernels/csrc/decode_stack.cpp``).

A decode step at batch 1 spends more time launching ~15 PyTorch ops a layer from Python than
in its matmuls. When nothing in a batch needs the Python path, the model hands every decoder
layer to the C++ ``DecodeStack``, which runs the same kernels in the same order (so the outputs
are the same to the bit) without going back to Python in between.

The batches it takes are one query token per row: decode rows and speculative verify rows
(each draft token a query of its own, as the attention backend plans them), with or without
shared prefixes (cascade attention). The Python path stays for everything else: prompts to
prefill, shared prefixes in a KV pool of another dtype than the activations, tensor
parallelism, GPUs, dtypes other than fp32, weight forms the stack does not take (int8, bf16),
and machines without the C++ kernels.

A linear's weight reaches the stack through ``stack_weight``: an fp32 ``nn.Linear``'s matrix, or
what a quantized layer's ``decode_weight(rows)`` returns (Q4_1 tiles as ``(tiles, n, bias)``, or
GGUF blocks as a ``GGUFStackWeight``).

The stack knows no model family: each decoder layer describes itself as a ``StackLayer`` (its
two RMSNorms, fused q/k/v and gate/up projections, output and down projections, head shape),
and the stack runs every layer as norm, q/k/v, RoPE (rotate-half), attention over the pool,
output projection, residual add and norm, gate/up, SiLU-and-mul, down projection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from radixlm.kernels.cpu_ext import cpu_kernels
from radixlm.kernels.torch_decode import DecodePlan, cpu_decode_splits
from radixlm.runtime.layers.attention.torch_backend import TorchAttentionBackend
from radixlm.runtime.layers.norm import RMSNorm

if TYPE_CHECKING:
    from radixlm.runtime.layers.forward_batch import ForwardBatch



@dataclass(frozen=True)
class GGUFStackWeight:
    """A weight kept as GGUF blocks, as a layer's ``decode_weight`` hands it to the stack.

    ``parts[i]`` (``uint8 [n_i, row_bytes_i]``, the rows of GGUF type id ``types[i]``) stacked
    along the rows make the ``[n, K]`` weight. The stack computes ``gguf_linear(x, parts, types,
    n)`` and then adds ``bias`` (float32 ``[n]``, or None), so a layer whose forward computes the
    same gets the same outputs to the bit.
    """

    parts: list[torch.Tensor]
    types: list[int]
    n: int
    bias: torch.Tensor | None = None


StackWeight = tuple[torch.Tensor, int, "torch.Tensor | None"] | GGUFStackWeight  # (Q4_1 tiles or fp32 [n, K], n, bias), or GGUF parts


@dataclass(frozen=True)
class StackLayer:
    """The parts of one pre-norm decoder layer that the stack computes it from."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    input_norm: RMSNorm
    qkv_proj: nn.Module  # q, k, v rows fused (only it may have a bias)
    o_proj: nn.Module
    post_attention_norm: RMSNorm
    gate_up_proj: nn.Module  # gate rows, then up rows
    down_proj: nn.Module


class StackableLayer(Protocol):
    """A decoder layer that the stack can run."""

    def stack_layer(self) -> StackLayer:
        """This layer's current parts (after quantization replaced any, the replacements)."""


def stack_weight(module: nn.Module, rows: int) -> StackWeight | None:
    """What the C++ stack computes ``module`` with for calls of ``rows`` rows, or None where the
    module would not run Q4_1 tiles, an fp32 matrix or GGUF blocks there."""
    if type(module) is nn.Linear:
        if module.weight.dtype != torch.float32:
            return None
        return module.weight, module.out_features, module.bias
    decode_weight = getattr(module, "decode_weight", None)
    return decode_weight(rows) if decode_weight is not None else None


class DecodeStacks:
    """The C++ decoder stacks of one model's ``layers``, one per batch size seen (they hold
    references to the model's weights, not copies); ``run`` takes a batch or declines it.
    A model split by tensor parallelism (``tensor_parallel``) always takes the Python path."""

    def __init__(self, layers: Sequence[StackableLayer], tensor_parallel: bool = False) -> None:
        self.layers = layers
        self.tensor_parallel = tensor_parallel
        self.enabled = True  # False: every batch takes the Python path (--disable-decode-stack)
        self._stacks: dict[int, Any] = {}  # rows -> DecodeStack, or None where a layer has no stack form

    def clear(self) -> None:
        """Forget the stacks (after the model's layers were replaced, e.g. by quantization)."""
        self._stacks.clear()

    def run(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every decoder layer for ``batch``: ``(x, residual)`` after the last, or None when the
        batch needs the Python path."""
        plan = self._decode_plan(x, batch)
        if plan is None:
            return None
        rows = x.shape[0]
        if rows not in self._stacks:
            self._stacks[rows] = self._build(rows)
        stack = self._stacks[rows]
        if stack is None:
            return None
        pool = batch.kv_pool
        cos, sin = rope
        splits = cpu_decode_splits(rows, plan.longest_suffix, torch.get_num_threads())
        groups = plan.groups
        x, residual = stack.forward(
            x, cos.reshape(rows, -1), sin.reshape(rows, -1), pool.k, pool.v, pool.k_scale, pool.v_scale,
            float(pool.format.qmax), batch.out_slots, plan.table, plan.rows, plan.prefix_len, plan.suffix_len, splits,
            [g.rows for g in groups], [g.slots for g in groups], [-1 if g.start is None else g.start for g in groups],
        )  # fmt: skip
        return x, residual

    def _decode_plan(self, x: torch.Tensor, batch: ForwardBatch) -> DecodePlan | None:
        """The batch's decode plan when the stack can run it, else None."""
        if not self.enabled or x.device.type != "cpu" or x.dtype != torch.float32 or self.tensor_parallel:
            return None
        if not isinstance(batch.attn_backend, TorchAttentionBackend):
            return None
        meta = batch.attn_meta
        if meta is None or meta.decode is None or meta.extend_rows:
            return None  # a prompt to prefill; what is left is one query a token, in token order
        if meta.decode.rows.numel() != x.shape[0]:
            return None
        if meta.decode.groups and batch.kv_pool.dtype != x.dtype:
            return None  # the Python path converts a shared prefix of another dtype once per step
        return meta.decode

    def _build(self, rows: int):
        """A stack for calls of ``rows`` rows, or None when some layer has no stack form there."""
        ext = cpu_kernels()
        if ext is None:
            return None
        layers = [layer.stack_layer() for layer in self.layers]
        first = layers[0]
        eps = first.input_norm.eps
        stack = ext.DecodeStack(first.num_heads, first.num_kv_heads, first.head_dim, eps)
        for layer in layers:
            found = [stack_weight(m, rows) for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
            norms = (layer.input_norm, layer.post_attention_norm)
            if any(w is None for w in found):
                return None  # a form the stack has no kernel for
            weights = [_stack_args(w) for w in found]
            if any(w[3] is not None for w in weights[1:]):
                return None  # a bias it does not add (only q/k/v have one)
            if any(n.weight.dtype != torch.float32 or n.eps != eps for n in norms):
                return None
            (qkv, qkv_types, qkv_n, qkv_bias), (o, o_types, o_n, _), (gate_up, gate_up_types, gate_up_n, _), (down, down_types, down_n, _) = weights
            stack.add_layer(
                norms[0].weight.detach(), qkv, qkv_types, qkv_n, None if qkv_bias is None else qkv_bias.detach(),
                o, o_types, o_n, norms[1].weight.detach(), gate_up, gate_up_types, gate_up_n, down, down_types, down_n,
            )  # fmt: skip
        return stack


def _stack_args(weight: StackWeight) -> tuple[list[torch.Tensor], list[int], int, torch.Tensor | None]:
    """A stack weight as ``DecodeStack.add_layer`` takes it: (tensors, GGUF type ids, n, bias);
    no type ids for Q4_1 tiles or an fp32 matrix (one tensor)."""
    if isinstance(weight, GGUFStackWeight):
        return [p.detach() for p in weight.parts], [int(t) for t in weight.types], int(weight.n), weight.bias
    tensor, n, bias = weight
    return [tensor.detach()], [], n, bias
