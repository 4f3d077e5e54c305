"""PyTorch attention over gathered K/V: the extend (prefill) path and a plain-loop reference.

Tensor in, tensor out: the backends in ``radixlm.runtime.layers.attention`` gather a
row's keys from the pool and call these. Grouped-query attention maps query head ``h`` to KV
head ``h // (H / Hkv)``.

Besides plain causal attention both take what a layer's ``AttentionSpec`` says, as plain values:
``scale`` (default ``D ** -0.5``), a sliding ``window`` (the query at position ``i`` sees ``j``
with ``i - window < j <= i``), a logit ``softcap`` (scores become ``softcap * tanh(s /
softcap)``) and ``sinks`` (one logit per query head ``[H]`` that joins the softmax denominator
and takes no value). Plain attention (and a window alone, which is a mask) runs PyTorch's SDPA;
soft-capping and sinks need the scores or their log-sum-exp, so they run a blocked softmax here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_SCORES = 1 << 24  # scores one block of the manual path holds (fp32: 64 MiB)
MIN_WINDOW_BLOCK = 128  # a long row under a sliding window attends in query blocks of max(window, this)


def causal_mask(e: int, length: int, window: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[e, length]`` bool: which of ``length`` keys each of the last ``e`` of them (the queries) sees."""
    q_pos = torch.arange(length - e, length, device=device)[:, None]
    k_pos = torch.arange(length, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    group: int,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA for one row: ``q`` ``[e, H, D]`` (the last ``e`` positions of the keys), ``k``
    ``[L, Hkv, D]``, ``v`` ``[L, Hkv, Dv]`` (values may be narrower than keys, as MLA's latent ones);
    ``mask`` ``[e, L]`` says which keys each query sees, the window included (None:
    ``causal_mask(e, L, window)``). Returns ``[e, H, Dv]``."""
    e, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    block = max(window or 0, MIN_WINDOW_BLOCK)
    if mask is None and window is not None and e > block:
        # a block of queries sees at most block + window - 1 keys: scores grow with e, not e * L
        offset = k.shape[0] - e  # the first query's position among the keys
        outs = []
        for i0 in range(0, e, block):
            i1 = min(e, i0 + block)
            first = max(0, offset + i0 - window + 1)
            outs.append(extend_attention(q[i0:i1], k[first : offset + i1], v[first : offset + i1], None, group, scale, window, softcap, sinks))
        return torch.cat(outs)
    # Fold each KV head's query group into the query-length axis: rows are (token, group member).
    qg = q.view(e, num_kv, group, head_dim).permute(1, 0, 2, 3).reshape(num_kv, e * group, head_dim)
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)
    if mask is None:
        mask = causal_mask(e, k.shape[0], window, q.device)
    if group > 1:
        mask = mask.repeat_interleave(group, dim=0)
    if softcap is None and sinks is None:
        o = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=mask, scale=scale)
    else:
        head_sinks = None if sinks is None else sinks.float().view(num_kv, 1, group).expand(num_kv, e, group).reshape(num_kv, e * group, 1)
        o = _softmax_blocks(qg, kt, vt, mask, head_dim**-0.5 if scale is None else scale, softcap, head_sinks)
    value_dim = v.shape[-1]
    return o.view(num_kv, e, group, value_dim).permute(1, 0, 2, 3).reshape(e, num_heads, value_dim)


def _softmax_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None, sinks: torch.Tensor | None
) -> torch.Tensor:
    """Masked softmax attention of ``q`` ``[Hkv, Q, D]`` over ``k``/``v`` ``[Hkv, L, D]`` in fp32,
    soft-capped and with per-query ``sinks`` ``[Hkv, Q, 1]`` where given; queries in blocks so the
    scores stay under ``MAX_SCORES``."""
    num_kv, rows, _ = q.shape
    step = max(1, MAX_SCORES // max(1, num_kv * k.shape[1]))
    kf, vf = k.float(), v.float()
    out = torch.empty(q.shape[:2] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        scores = (q[:, r0:r1].float() @ kf.transpose(-1, -2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask[r0:r1], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        o = torch.exp(scores - lse) @ vf
        if sinks is not None:  # the sink's share of the denominator: exp(sink) / (exp(lse) + exp(sink))
            o = o * torch.sigmoid(lse - sinks[:, r0:r1])
        out[:, r0:r1] = o.to(q.dtype)
    return out


def reference_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    prefix_len: int,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-loop attention for one row, for tests: ``q`` ``[e, H, D]`` over ``slots`` ``[p + e]``."""
    k = k_pool[slots].float()
    v = v_pool[slots].float()
    e, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.empty(e, num_heads, v.shape[-1])
    for i in range(e):
        visible = prefix_len + i + 1
        first = 0 if window is None else max(0, visible - window)
        for h in range(num_heads):
            scores = (k[first:visible, h // group] @ q[i, h].float()) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is not None:  # a logit with no value: it only adds to the denominator
                scores = torch.cat([scores, sinks[h].float().view(1)])
            weights = torch.softmax(scores, 0)[: visible - first]
            out[i, h] = weights @ v[first:visible, h // group]
    return out
