"""The PyTorch attention backend: batched decode over the pool, and extend rows one by one.

The reference the other backends are tested against, and the CPU path (its decode kernel runs
the C++ kernels where they built; see ``radixlm.kernels.torch_decode``). It is also the one
backend that serves a latent KV pool (DeepSeek's MLA): values narrower than keys, read as the
first columns of the keys' rows; such layers run the PyTorch kernels, not the C++ ones.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from radixlm.kernels.attention import causal_mask, extend_attention
from radixlm.kernels.torch_decode import DecodePlan, decode_attention, plan_decode
from radixlm.runtime.layers.attention.base import AttentionBackend, register_attention_backend
from radixlm.runtime.layers.attention_spec import AttentionSpec
from radixlm.runtime.layers.forward_batch import ForwardBatch

VERIFY_AS_DECODE_MAX = 16  # extend rows this short over a cached prefix attend as decode queries

ExtendEntry = tuple[int, int, "torch.Tensor | None", "torch.Tensor | None"]
# (token start, extend len, slots of the positions it attends or None for just its new tokens, mask or None)


@dataclass
class _ExtendRow:
    start: int  # its first token in the batch
    prefix: int  # cached positions
    length: int  # new tokens
    table_row: int  # its row of the request -> slot table


@dataclass
class _TorchMeta:
    """A batch's attention plans: built for plain layers at once, for each sliding window on first use."""

    decode: DecodePlan | None  # the decode queries' plan for layers without a window
    extend_rows: list[ExtendEntry]  # the extend rows' entries for layers without a window
    decode_tokens: torch.Tensor | None = None  # token indices of the decode queries, when not 0 .. nd-1
    req_to_token: torch.Tensor | None = None
    query_rows: torch.Tensor | None = None  # the decode queries' table rows and sequence lengths
    query_lens: list[int] = field(default_factory=list)
    extends: list[_ExtendRow] = field(default_factory=list)
    _windowed: dict[int, tuple[DecodePlan | None, list[ExtendEntry]]] = field(default_factory=dict)

    @functools.cached_property
    def longest_query(self) -> int:
        """The most positions a decode query attends to without a window."""
        return max(self.query_lens, default=0)

    @functools.cached_property
    def longest_extend(self) -> int:
        """The most positions an extend row's last token attends to without a window."""
        return max((r.prefix + r.length for r in self.extends), default=0)

    def decode_plan(self, window: int | None) -> DecodePlan | None:
        """The decode queries' plan for layers with this sliding window (None: no window)."""
        if window is None or self.decode is None or window >= self.longest_query:
            return self.decode  # the window hides nothing from any query
        return self._plans(window)[0]

    def extend_plan(self, window: int | None) -> list[ExtendEntry]:
        """The extend rows' entries for layers with this sliding window (None: no window)."""
        if window is None or window >= self.longest_extend:
            return self.extend_rows
        return self._plans(window)[1]

    def _plans(self, window: int) -> tuple[DecodePlan | None, list[ExtendEntry]]:
        if window not in self._windowed:
            decode = None if self.decode is None else plan_decode(self.req_to_token, self.query_rows, self.query_lens, window=window)
            self._windowed[window] = (decode, [_extend_entry(self.req_to_token, r, window) for r in self.extends])
        return self._windowed[window]


def _extend_entry(req_to_token: torch.Tensor, row: _ExtendRow, window: int | None) -> ExtendEntry:
    """What an extend row attends to: the positions its window can see (from ``p - window + 1``),
    gathered through the slot table when some are cached, and the mask over them (None: causal
    within the window, which ``extend_attention`` builds in blocks of queries)."""
    p, e = row.prefix, row.length
    first = 0 if window is None else max(0, p - window + 1)
    slots = req_to_token[row.table_row, first : p + e] if p else None
    if not p or (window is not None and p + e > window):
        return row.start, e, slots, None
    return row.start, e, slots, causal_mask(e, p + e, None, req_to_token.device)


@register_attention_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """Scaled-dot-product attention in PyTorch: batched for decode rows, per row for extends."""

    latent_kv = True

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build the decode plan and the per-row extend slot lists once per batch (a sliding
        window's are built by the first layer that has it).

        A short extend row over a cached prefix (the token before some drafts, and the drafts:
        a verify row) becomes one decode query per token, query ``i`` seeing ``p + i + 1``
        positions (the last ``window`` of them in a windowed layer): the decode kernel reads the
        pool in place and shares the row's prefix among its queries, where the extend path would
        gather the whole prefix for one small block.
        """
        nd = batch.num_decode
        rows, lens, tokens = [], list(batch.seq_lens[:nd]), []  # rows and tokens: of verify queries
        extends = []
        start = nd
        for i in range(nd, batch.batch_size):
            p, e = batch.prefix_lens[i], batch.extend_lens[i]
            row = int(batch.req_rows[i])
            if p and e <= VERIFY_AS_DECODE_MAX:
                rows += [row] * e
                lens += range(p + 1, p + e + 1)
                tokens += range(start, start + e)
            else:
                extends.append(_ExtendRow(start, p, e, row))
            start += e
        decode = decode_tokens = query_rows = None
        if lens:
            query_rows = batch.req_rows[:nd]
            if rows:
                device = batch.req_to_token.device
                query_rows = torch.cat([query_rows, torch.tensor(rows, dtype=torch.int64, device=device)])
                decode_tokens = torch.cat([torch.arange(nd, device=device), torch.tensor(tokens, dtype=torch.int64, device=device)])
            decode = plan_decode(batch.req_to_token, query_rows, lens)
        extend_rows = [_extend_entry(batch.req_to_token, r, None) for r in extends]
        batch.attn_meta = _TorchMeta(decode, extend_rows, decode_tokens, batch.req_to_token, query_rows, lens, extends)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, spec: AttentionSpec | None = None
    ) -> torch.Tensor:
        """Write the new KV, then attend decode rows together and extend rows one by one, as
        ``spec`` says (None: plain causal attention at ``D ** -0.5``).

        Every row attends to the KV as the pool stores it: a row without a cached prefix reads its
        own new tokens back through the pool when the pool converts them (bf16, int8, fp8), so a
        prompt sees the same keys whether or not its prefix was cached, and later decode steps
        see what it saw.
        """
        pool, meta = batch.kv_pool, batch.attn_meta
        pool.write(layer, batch.out_slots, k, v)
        num_tokens, num_heads, _ = q.shape
        num_kv, value_dim = k.shape[1], v.shape[-1]
        group = num_heads // num_kv
        out = q.new_empty(num_tokens, num_heads, value_dim)
        window = None if spec is None else spec.window
        how = {} if spec is None else {"scale": spec.scale, "softcap": spec.softcap, "sinks": spec.sinks}
        scales = {"k_scale": pool.k_scale[layer], "v_scale": pool.v_scale[layer]}
        decode = meta.decode_plan(window)
        if meta.decode_tokens is not None:
            qd = q.index_select(0, meta.decode_tokens)
            out.index_copy_(0, meta.decode_tokens, decode_attention(qd, pool.k[layer], pool.v[layer], decode, **scales, **how))
        elif decode is not None:
            nd = batch.num_decode
            out[:nd] = decode_attention(q[:nd], pool.k[layer], pool.v[layer], decode, **scales, **how)
        converts = pool.dtype != q.dtype
        for start, e, slots, mask in meta.extend_plan(window):
            qe = q[start : start + e]
            if slots is None and not converts:
                ke, ve = k[start : start + e], v[start : start + e]
            else:
                ke, ve = pool.read(layer, batch.out_slots[start : start + e] if slots is None else slots, q.dtype)
            out[start : start + e] = extend_attention(qe, ke, ve, mask, group, window=window, **how)
        return out.view(num_tokens, num_heads * value_dim)
