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
layers it would not compute as the Python path does (a norm other than ``RMSNorm``, a bias
outside q/k/v, another activation, head shapes that differ between layers, RoPE over part of
the head), and machines without the C++ kernels.

A linear's weight reaches the stack through ``stack_weight``: an fp32 ``nn.Linear``'s matrix, or
what a quantized layer's ``decode_weight(rows)`` returns (Q4_1 tiles as ``(tiles, n, bias)``, or
GGUF blocks as a ``GGUFStackWeight``).

The stack knows no model family: each decoder layer describes itself as a ``StackLayer`` (its
two RMSNorms, fused q/k/v and gate/up projections, output and down projections, head shape, and
what sets it apart from a Llama layer), and the stack runs every layer as::

    norm (+ residual) -> q/k/v -> [q/k head norms] -> [RoPE, table i] -> attention over the pool
    (its AttentionSpec: scale, sliding window, soft-cap, sinks) -> o_proj -> [attention-output norm]
    -> residual add + norm -> gate/up -> SiLU or tanh-GELU, times up -> down -> [MLP-output norm]

A layer with a sliding window attends through the attention backend's plan for that window
(built once a batch, shared by the layers that have it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import nn

from radixlm.kernels.cpu_ext import cpu_kernels
from radixlm.kernels.torch_decode import DecodePlan, cpu_decode_splits
from radixlm.runtime.layers.attention.torch_backend import TorchAttentionBackend
from radixlm.runtime.layers.attention_spec import AttentionSpec
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


ACTIVATIONS = ("silu", "gelu_tanh")  # act(gate) * up: silu_and_mul, gelu_tanh_and_mul (runtime/layers/activation.py)
Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) of a RotaryEmbedding.table


@dataclass(frozen=True)
class StackLayer:
    """The parts of one pre-norm decoder layer that the stack computes it from.

    The first nine make a Llama layer; the rest default to it. ``q_norm``/``k_norm`` (RMSNorms
    over ``head_dim``) normalize each head of q and k before RoPE, computed as the Python path
    must compute them to agree to the bit: ``q_norm(q.reshape(-1, head_dim))`` (a 2-D input).
    ``rope_table`` indexes the (cos, sin) tables the model passes to ``DecodeStacks.run`` (None:
    no RoPE, a NoPE layer). ``attn_out_norm`` and ``mlp_out_norm`` (Gemma's sandwich norms)
    normalize the attention and MLP branches' outputs before their residual adds; the residual
    add before the MLP is fused into ``post_attention_norm`` (the pre-MLP norm).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    input_norm: RMSNorm
    qkv_proj: nn.Module  # q, k, v rows fused (only it may have a bias)
    o_proj: nn.Module
    post_attention_norm: RMSNorm
    gate_up_proj: nn.Module  # gate rows, then up rows
    down_proj: nn.Module
    attention: AttentionSpec | None = None  # None: plain causal attention at head_dim ** -0.5
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None
    rope_table: int | None = 0
    attn_out_norm: RMSNorm | None = None
    mlp_out_norm: RMSNorm | None = None
    activation: str = "silu"  # or "gelu_tanh"


class StackableLayer(Protocol):
    """A decoder layer that the stack can run."""

    def stack_layer(self) -> StackLayer | None:
        """This layer's current parts (after quantization replaced any, the replacements), or None
        where the stack cannot run it (a layer of routed experts)."""


def stack_weight(module: nn.Module, rows: int) -> StackWeight | None:
    """What the C++ stack computes ``module`` with for calls of ``rows`` rows, or None where the
    module would not run Q4_1 tiles, an fp32 matrix or GGUF blocks there."""
    if type(module) is nn.Linear:
        if module.weight.dtype != torch.float32:
            return None
        return module.weight, module.out_features, module.bias
    decode_weight = getattr(module, "decode_weight", None)
    return decode_weight(rows) if decode_weight is not None else None


class _Built(NamedTuple):
    stack: Any  # the C++ DecodeStack
    head_dim: int
    windows: list[int | None]  # each layer's sliding window


class DecodeStacks:
    """The C++ decoder stacks of one model's ``layers``, one per batch size seen (they hold
    references to the model's weights, not copies); ``run`` takes a batch or declines it.
    A model split by tensor parallelism (``tensor_parallel``) always takes the Python path."""

    def __init__(self, layers: Sequence[StackableLayer], tensor_parallel: bool = False) -> None:
        self.layers = layers
        self.tensor_parallel = tensor_parallel
        self.enabled = True  # False: every batch takes the Python path (--disable-decode-stack)
        self._stacks: dict[int, _Built | None] = {}  # rows -> its stack, or None where a layer has no stack form

    def clear(self) -> None:
        """Forget the stacks (after the model's layers were replaced, e.g. by quantization)."""
        self._stacks.clear()

    def run(self, x: torch.Tensor, ropes: Sequence[Rope] | Rope, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every decoder layer for ``batch``: ``(x, residual)`` after the last, or None when the
        batch needs the Python path. ``ropes``: the (cos, sin) tables the layers' ``rope_table``
        index (one table alone may be passed as it is)."""
        if batch.lora is not None:
            return None  # LoRA deltas are added by the Python layers' projections
        meta = self._decode_meta(x, batch)
        if meta is None:
            return None
        rows = x.shape[0]
        if rows not in self._stacks:
            self._stacks[rows] = self._build(rows)
        built = self._stacks[rows]
        if built is None:
            return None
        plans: list[DecodePlan] = []
        layer_plans = [_index_of(plans, meta.decode_plan(w)) for w in built.windows]
        pool = batch.kv_pool
        if any(p.groups for p in plans) and pool.dtype != x.dtype:
            return None  # the Python path converts a shared prefix of another dtype once per step
        if len(ropes) == 2 and isinstance(ropes[0], torch.Tensor):
            ropes = [ropes]
        if any(2 * cos.shape[-1] != built.head_dim for cos, _ in ropes):
            return None  # partial rotary: the Python path rotates the first dims with PyTorch ops
        threads = torch.get_num_threads()
        x, residual = built.stack.forward(
            x, [cos.reshape(rows, -1) for cos, _ in ropes], [sin.reshape(rows, -1) for _, sin in ropes],
            pool.k, pool.v, pool.k_scale, pool.v_scale, float(pool.format.qmax), batch.out_slots, meta.decode.table, meta.decode.rows,
            [p.prefix_len for p in plans], [p.suffix_len for p in plans], [cpu_decode_splits(rows, p.longest_suffix, threads) for p in plans],
            [[g.rows for g in p.groups] for p in plans], [[g.slots for g in p.groups] for p in plans],
            [[-1 if g.start is None else g.start for g in p.groups] for p in plans], layer_plans,
        )  # fmt: skip
        return x, residual

    def _decode_meta(self, x: torch.Tensor, batch: ForwardBatch) -> Any:
        """The torch backend's plans of the batch when the stack can run it, else None."""
        if not self.enabled or x.device.type != "cpu" or x.dtype != torch.float32 or self.tensor_parallel:
            return None
        if not isinstance(batch.attn_backend, TorchAttentionBackend):
            return None
        meta = batch.attn_meta
        if meta is None or meta.decode is None or meta.extend_rows:
            return None  # a prompt to prefill; what is left is one query a token, in token order
        if meta.decode.rows.numel() != x.shape[0]:
            return None
        return meta

    def _build(self, rows: int) -> _Built | None:
        """A stack for calls of ``rows`` rows, or None when some layer has no stack form there."""
        ext = cpu_kernels()
        if ext is None:
            return None
        layers = [layer.stack_layer() for layer in self.layers]
        if any(layer is None for layer in layers):
            return None
        first = layers[0]
        shape = (first.num_heads, first.num_kv_heads, first.head_dim)
        stack = ext.DecodeStack(*shape)
        for layer in layers:
            if (layer.num_heads, layer.num_kv_heads, layer.head_dim) != shape:
                return None  # one head shape for the whole stack
            args = _layer_args(layer, rows)
            if args is None:
                return None
            stack.add_layer(*args)
        return _Built(stack, first.head_dim, [None if layer.attention is None else layer.attention.window for layer in layers])


def _index_of(plans: list[DecodePlan], plan: DecodePlan) -> int:
    """The index of ``plan`` in ``plans``, appended if it is not there yet (the same object)."""
    for i, known in enumerate(plans):
        if known is plan:
            return i
    plans.append(plan)
    return len(plans) - 1


def _layer_args(layer: StackLayer, rows: int) -> tuple | None:
    """``DecodeStack.add_layer``'s arguments for ``layer`` at ``rows`` rows, or None where the
    stack cannot compute it as the Python path does."""
    found = [stack_weight(m, rows) for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    if any(w is None for w in found):
        return None  # a form the stack has no kernel for
    weights = [_stack_args(w) for w in found]
    if any(w[3] is not None for w in weights[1:]):
        return None  # a bias it does not add (only q/k/v have one)
    norms = (layer.input_norm, layer.post_attention_norm, layer.q_norm, layer.k_norm, layer.attn_out_norm, layer.mlp_out_norm)
    if any(n is not None and (type(n) is not RMSNorm or n.weight.dtype != torch.float32) for n in norms):
        return None  # a norm computed otherwise (a subclass, another dtype)
    if layer.activation not in ACTIVATIONS or (layer.rope_table is not None and layer.rope_table < 0):
        return None
    spec = layer.attention or AttentionSpec.default(layer.head_dim)
    sinks = None
    if spec.sinks is not None:
        if spec.sinks.numel() != layer.num_heads:
            return None
        sinks = spec.sinks.detach().float().reshape(-1)  # the Python path subtracts them from fp32 lse: the same values
    (qkv, qkv_types, qkv_n, qkv_bias), (o, o_types, o_n, _), (gate_up, gate_up_types, gate_up_n, _), (down, down_types, down_n, _) = weights
    return (
        [None if n is None else n.weight.detach() for n in norms], [0.0 if n is None else float(n.eps) for n in norms],
        qkv, qkv_types, qkv_n, None if qkv_bias is None else qkv_bias.detach(), o, o_types, o_n,
        gate_up, gate_up_types, gate_up_n, down, down_types, down_n,
        -1 if layer.rope_table is None else layer.rope_table, float(spec.scale), float(spec.softcap or 0.0), sinks, layer.activation,
    )  # fmt: skip


def _stack_args(weight: StackWeight) -> tuple[list[torch.Tensor], list[int], int, torch.Tensor | None]:
    """A stack weight as ``DecodeStack.add_layer`` takes it: (tensors, GGUF type ids, n, bias);
    no type ids for Q4_1 tiles or an fp32 matrix (one tensor)."""
    if isinstance(weight, GGUFStackWeight):
        return [p.detach() for p in weight.parts], [int(t) for t in weight.types], int(weight.n), weight.bias
    tensor, n, bias = weight
    return [tensor.detach()], [], n, bias
