"""Decode steps of a pre-norm decoder on CPUs in one C++ call (``kernels/csrc/decode_stack.cpp``).

A decode step at batch 1 spends more time launching ~15 PyTorch ops a layer from Python than
in its matmuls. When nothing in a batch needs the Python path, the model hands every decoder
layer to the C++ ``DecodeStack``, which runs the same kernels in the same order (so the outputs
are the same to the bit) without going back to Python in between.

The batches it takes are one query token per row: decode rows and speculative verify rows
(each draft token a query of its own, as the attention backend plans them), with or without
shared prefixes (cascade attention); a hybrid model's decode rows alone (its verify rows carry
several tokens through the recurrent state: the Python path). The Python path stays for
everything else: prompts to prefill, shared prefixes in a KV pool of another dtype than the
activations, tensor parallelism, GPUs, dtypes other than fp32, weight forms the stack does not
take (int8, bf16), layers it would not compute as the Python path does (a norm other than
``RMSNorm``, a bias outside q/k/v, another activation, head shapes that differ between layers,
routed experts, latent attention), and machines without the C++ kernels.

A linear's weight reaches the stack through ``stack_weight``: an fp32 ``nn.Linear``'s matrix, or
what a quantized layer's ``decode_weight(rows)`` returns (Q4_1 tiles as ``(tiles, n, bias)``, or
GGUF blocks as a ``GGUFStackWeight``).

The stack knows no model family: each decoder layer describes itself as a ``StackLayer`` (its
two RMSNorms, fused q/k/v and gate/up projections, output and down projections, head shape, and
what sets it apart from a Llama layer), and the stack runs every layer as::

    norm (+ residual) -> q/k/v -> [q/k head norms] -> [RoPE, table i, over the dims it covers]
    -> attention over the pool (its AttentionSpec: scale, sliding window, soft-cap, sinks)
    -> [* sigmoid(output gate)] -> o_proj -> [attention-output norm]
    -> residual add + norm -> gate/up -> SiLU or tanh-GELU, times up -> down -> [MLP-output norm]

A hybrid model's Gated DeltaNet layer (``StackDeltaLayer``) mixes tokens with the kernels
``GatedDeltaNet``'s decode path calls instead of attention (in_proj -> the convolution over the
conv state, the q/k norms, decay and beta -> the delta rule over the recurrent state -> the
gated output norm -> out_proj). The stack reads each row's committed states where the
``StatePool`` holds them and writes the new recurrent states into the slots the pool hands out
for the pass; after the call each layer's new states are staged in the pool as the Python path
stages them, so the scheduler commits them the same way.

A layer with a sliding window attends through the attention backend's plan for that window
(built once a batch, shared by the layers that have it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import nn

from radixlm.kernels.cpu_ext import cpu_kernels
from radixlm.kernels.torch_decode import DecodePlan, cpu_decode_splits
from radixlm.runtime.layers.activation import gelu_tanh_and_mul, silu_and_mul
from radixlm.runtime.layers.attention.torch_backend import TorchAttentionBackend
from radixlm.runtime.layers.attention_spec import AttentionSpec
from radixlm.runtime.layers.gated_delta import GatedDeltaNet
from radixlm.runtime.layers.gguf_linear import GGUFStackWeight
from radixlm.runtime.layers.moe import MoEBlock
from radixlm.runtime.layers.norm import RMSNorm

if TYPE_CHECKING:
    from radixlm.runtime.layers.forward_batch import ForwardBatch



StackWeight = tuple[torch.Tensor, int, "torch.Tensor | None"] | GGUFStackWeight  # (Q4_1 tiles or fp32 [n, K], n, bias), or GGUF parts


ACTIVATIONS = ("silu", "gelu_tanh")  # act(gate) * up: silu_and_mul, gelu_tanh_and_mul (runtime/layers/activation.py)
_ACTIVATION_NAMES = {silu_and_mul: "silu", gelu_tanh_and_mul: "gelu_tanh"}
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
    gate_up_proj: nn.Module | None  # gate rows, then up rows (None: routed experts instead)
    down_proj: nn.Module | None
    attention: AttentionSpec | None = None  # None: plain causal attention at head_dim ** -0.5
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None
    rope_table: int | None = 0
    attn_out_norm: RMSNorm | None = None
    mlp_out_norm: RMSNorm | None = None
    activation: str = "silu"  # or "gelu_tanh"
    output_gate: bool = False  # Qwen3-Next: q/k/v's query rows are each head's query then its gate; output * sigmoid(gate)
    experts: MoEBlock | None = None  # routed experts in place of the gated MLP


@dataclass(frozen=True)
class StackDeltaLayer:
    """The parts of a hybrid model's linear-attention decoder layer: a Gated DeltaNet between the
    pre-norm and the gated MLP, computed as ``GatedDeltaNet``'s decode path computes it (its
    states read from the batch's ``StatePool`` and the new ones staged there after the call)."""

    input_norm: RMSNorm
    mixer: GatedDeltaNet
    post_attention_norm: RMSNorm
    gate_up_proj: nn.Module | None
    down_proj: nn.Module | None
    activation: str = "silu"
    experts: MoEBlock | None = None  # routed experts in place of the gated MLP


class StackableLayer(Protocol):
    """A decoder layer that the stack can run."""

    def stack_layer(self) -> StackLayer | StackDeltaLayer | None:
        """This layer's current parts (after quantization replaced any, the replacements), or None
        where the stack cannot run it (latent attention)."""


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
    windows: list[int | None]  # each attention layer's sliding window
    mixers: list[GatedDeltaNet]  # the Gated DeltaNet layers' mixers, in order


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
        if any(2 * cos.shape[-1] > built.head_dim for cos, _ in ropes):
            return None  # a table wider than the heads (the stack rotates a head's first dims, or all of it)
        states = _state_args(built.mixers, batch, rows)
        if states is None:
            return None
        threads = torch.get_num_threads()
        out = built.stack.forward(
            x, [cos.reshape(rows, -1) for cos, _ in ropes], [sin.reshape(rows, -1) for _, sin in ropes],
            pool.k, pool.v, pool.k_scale, pool.v_scale, float(pool.format.qmax), batch.out_slots, meta.decode.table, meta.decode.rows,
            [p.prefix_len for p in plans], [p.suffix_len for p in plans], [cpu_decode_splits(rows, p.longest_suffix, threads) for p in plans],
            [[g.rows for g in p.groups] for p in plans], [[g.slots for g in p.groups] for p in plans],
            [[-1 if g.start is None else g.start for g in p.groups] for p in plans], layer_plans, **states.kwargs,
        )  # fmt: skip
        states.stage(out[2:])
        return out[0], out[1]

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
        attention = [layer for layer in layers if isinstance(layer, StackLayer)]
        if not attention:
            return None
        first = attention[0]
        shape = (first.num_heads, first.num_kv_heads, first.head_dim)
        stack = ext.DecodeStack(*shape)
        for layer in layers:
            if isinstance(layer, StackLayer) and (layer.num_heads, layer.num_kv_heads, layer.head_dim) != shape:
                return None  # one head shape for the whole stack
            args = _delta_layer_args(layer, rows) if isinstance(layer, StackDeltaLayer) else _layer_args(layer, rows)
            experts = None if layer.experts is None else _expert_args(layer.experts, rows)
            if args is None or (layer.experts is not None and experts is None):
                return None
            (stack.add_delta_layer if isinstance(layer, StackDeltaLayer) else stack.add_layer)(*args)
            if experts is not None:
                stack.set_experts(*experts)
        windows = [None if layer.attention is None else layer.attention.window for layer in attention]
        return _Built(stack, first.head_dim, windows, [layer.mixer for layer in layers if isinstance(layer, StackDeltaLayer)])


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
    weights = _weight_args((layer.qkv_proj, layer.o_proj), layer, rows)
    if weights is None:
        return None  # a form the stack has no kernel for
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
        layer.output_gate,
    )  # fmt: skip


def _delta_layer_args(layer: StackDeltaLayer, rows: int) -> tuple | None:
    """``DecodeStack.add_delta_layer``'s arguments for ``layer`` at ``rows`` rows, or None where the
    stack cannot compute it as the Python path does."""
    mixer = layer.mixer
    weights = _weight_args((mixer.in_proj, mixer.out_proj), layer, rows)
    if weights is None or any(w[3] is not None for w in weights):
        return None  # none of these has a bias in the Python path's kernels
    norms = (layer.input_norm, layer.post_attention_norm)
    if any(type(n) is not RMSNorm or n.weight.dtype != torch.float32 for n in norms) or layer.activation not in ACTIVATIONS:
        return None
    params = (mixer.conv1d.weight, mixer.A_log, mixer.dt_bias, mixer.norm.weight)
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in params):
        return None  # the C++ decode kernels take float32 only (as GatedDeltaNet's fused path)
    s = mixer.spec
    (in_proj, in_types, in_n, _), (out_proj, out_types, out_n, _), (gate_up, gate_up_types, gate_up_n, _), (down, down_types, down_n, _) = weights
    return (
        [n.weight.detach() for n in norms] + [None, None], [float(n.eps) for n in norms] + [0.0, 0.0],
        in_proj, in_types, in_n, mixer.conv1d.weight.detach()[:, 0, :], mixer.A_log.detach(), mixer.dt_bias.detach(),
        mixer.norm.weight.detach(), float(mixer.norm.eps), s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim,
        out_proj, out_types, out_n, gate_up, gate_up_types, gate_up_n, down, down_types, down_n, layer.activation,
    )  # fmt: skip


@dataclass
class _StateArgs:
    """The state pool's part of one stack call: ``DecodeStack.forward``'s keyword arguments, and
    where each Gated DeltaNet layer's new states are to be staged after it."""

    kwargs: dict[str, Any]
    mixers: list[GatedDeltaNet]
    pool: Any = None  # the batch's StatePool
    targets: list[torch.Tensor] = field(default_factory=list)  # per layer: where the kernel writes the new recurrent states
    slots: torch.Tensor | None = None  # the new states' slots in the targets (None: row i at i)

    def stage(self, tails: Sequence[torch.Tensor]) -> None:
        """Stage each decode row's new conv tail and recurrent state in every layer, as
        ``GatedDeltaNet``'s decode path does."""
        for mixer, tail, target in zip(self.mixers, tails, self.targets):
            mixer.stage_decode(self.pool, tail, target, self.slots)


def _state_args(mixers: list[GatedDeltaNet], batch: ForwardBatch, rows: int) -> _StateArgs | None:
    """The Gated DeltaNet layers' states for a stack call over ``batch`` (no arguments for a model
    without such layers), or None where the Python path must run it: rows other than one decode
    token each, or conv states not in float32."""
    if not mixers:
        return _StateArgs({}, [])
    pool = batch.state_pool
    if pool is None or batch.num_decode != rows or batch.batch_size != rows or pool.conv.dtype != torch.float32:
        return None
    convs, states, targets = [], [], []
    slots = conv_rows = state_rows = None
    for mixer in mixers:
        layer = mixer.state_layer
        conv, conv_rows = pool.in_place_conv(layer, rows)
        state, state_rows = pool.in_place(layer, rows)
        target, slots = pool.decode_targets(layer, rows)
        convs.append(conv)
        states.append(state)
        targets.append(target)
    kwargs = {"conv_pools": convs, "state_pools": states, "conv_rows": conv_rows, "state_rows": state_rows,
              "state_targets": targets, "state_out_rows": slots}  # fmt: skip
    return _StateArgs(kwargs, mixers, pool, targets, slots)


def _weight_args(mixing: tuple[nn.Module, nn.Module], layer: StackLayer | StackDeltaLayer, rows: int) -> list[tuple] | None:
    """``_stack_args`` of the mixer's two projections and of the MLP's (none for routed experts:
    empty), or None where one has a form the stack has no kernel for."""
    mlp = () if layer.experts is not None else (layer.gate_up_proj, layer.down_proj)
    found = [stack_weight(m, rows) for m in (*mixing, *mlp)]
    if any(w is None for w in found):
        return None
    return [_stack_args(w) for w in found] + [([], [], 0, None)] * (2 - len(mlp))


def _expert_args(block: MoEBlock, rows: int) -> tuple | None:
    """``DecodeStack.set_experts``' arguments for the routed experts ``block``, or None where the
    stack would not compute them as ``MoEBlock.forward`` does: a router rule other than the two
    softmax ones (DeepSeek's grouped sigmoid), experts not all GGUF blocks without biases, a shared
    expert in a form the stack has no kernel for, tensor parallelism."""
    router, spec = block.router, block.router.spec
    if spec.scoring not in ("softmax", "topk_softmax") or spec.n_group != 1 or router.correction_bias is not None:
        return None
    if block.group is not None or router.weight.dtype != torch.float32:
        return None
    if router.bias is not None and router.bias.dtype != torch.float32:
        return None
    blocks = [expert.gguf_blocks() for expert in block.experts]
    if any(b is None for b in blocks):
        return None  # the Python path's one-token sum runs in C++ only over GGUF blocks
    up, up_types, down, down_types, gelu = zip(*blocks)
    shared = [([], [], 0, None)] * 3
    shared_activation = "silu"
    if block.shared_experts is not None:
        modules = [block.shared_experts.gate_up_proj, block.shared_experts.down_proj]
        if block.shared_gate is not None:
            modules.append(block.shared_gate)
        found = [stack_weight(m, rows) for m in modules]
        shared_activation = _ACTIVATION_NAMES.get(block.shared_experts.act_fn)
        if any(w is None for w in found) or shared_activation is None:
            return None
        shared[: len(found)] = [_stack_args(w) for w in found]
        if any(w[3] is not None for w in shared):
            return None  # the stack adds no bias here
    (sgu, sgu_types, sgu_n, _), (sd, sd_types, sd_n, _), (sg, sg_types, _, _) = shared
    return (
        router.weight.detach(), None if router.bias is None else router.bias.detach(), spec.top_k, spec.scoring, spec.renormalize,
        float(spec.scaling), [list(p) for p in up], [list(t) for t in up_types], [list(p) for p in down], [list(t) for t in down_types],
        "gelu_tanh" if gelu[0] else "silu", sgu, sgu_types, sgu_n, sd, sd_types, sd_n, sg, sg_types, shared_activation,
    )  # fmt: skip


def _stack_args(weight: StackWeight) -> tuple[list[torch.Tensor], list[int], int, torch.Tensor | None]:
    """A stack weight as ``DecodeStack.add_layer`` takes it: (tensors, GGUF type ids, n, bias);
    no type ids for Q4_1 tiles or an fp32 matrix (one tensor)."""
    if isinstance(weight, GGUFStackWeight):
        return [p.detach() for p in weight.parts], [int(t) for t in weight.types], int(weight.n), weight.bias
    tensor, n, bias = weight
    return [tensor.detach()], [], n, bias
