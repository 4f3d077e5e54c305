"""PyTorch attention over gathered K/V: the extend (prefill) path and a plain-loop reference.

Tensor in, tensor out: the backends in ``radixlm.runtime.layers.attention`` gather a
row's keys from the pool and call these. Grouped-query attention maps query head ``h`` to KV
head ``h // (H / Hkv)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, group: int) -> torch.Tensor:
    """Causal GQA for one row: ``q`` ``[e, H, D]``, ``k``/``v`` ``[L, Hkv, D]``, ``mask`` ``[e, L]``."""
    e, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    # Fold each KV head's query group into the query-length axis: rows are (token, group member).
    qg = q.view(e, num_kv, group, head_dim).permute(1, 0, 2, 3).reshape(num_kv, e * group, head_dim)
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)
    if mask is None:  # no prefix: plain causal over the new tokens
        mask = torch.ones(e, e, dtype=torch.bool, device=q.device).tril()
    if group > 1:
        mask = mask.repeat_interleave(group, dim=0)
    o = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=mask)
    return o.view(num_kv, e, group, head_dim).permute(1, 0, 2, 3).reshape(e, num_heads, head_dim)


def reference_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, prefix_len: int
) -> torch.Tensor:
    """Plain-loop attention for one row, for tests: ``q`` ``[e, H, D]`` over ``slots`` ``[p + e]``."""
    k = k_pool[slots].float()
    v = v_pool[slots].float()
    e, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    out = torch.empty(e, num_heads, head_dim)
    for i in range(e):
        visible = prefix_len + i + 1
        for h in range(num_heads):
            scores = (k[:visible, h // group] @ q[i, h].float()) / head_dim**0.5
            out[i, h] = torch.softmax(scores, 0) @ v[:visible, h // group]
    return out
