"""Per-request cache explanations: where a prompt's cached prefix came from and why it stopped.

Built once per request, at its first admission, from the radix-tree path it matched (one entry
per tree node, never per token). The explanation lists the matched prefix as segments (token
ranges) with the request that first computed each, when, and how often it has been reused; how
many prompt tokens were computed fresh; and why the match stopped where it did:

- ``evicted``: the next tokens were cached once and evicted (the eviction log names when);
- ``tokenization_boundary``: a cached sibling spells the same text with different tokens;
- ``cache_salt``: the prefix is cached under another ``cache_salt`` (or without one): named only
  in the operator's listing (``Engine.cache_explanations`` without a tenant, or the admin key
  over HTTP); the request itself, which must learn nothing of other tenants, reads ``new_text``;
- ``new_text``: nothing cached continues this prompt; ``full``: only the prompt's last token,
  which is always computed, was left; ``cache_disabled``: the radix cache is off;
- ``no_snapshot`` (hybrid linear-attention models): the KV is cached further (``cached_kv_tokens``),
  but no node past the match holds the linear layers' state snapshot to resume from.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

from radixlm.radix_cache.origin import path_key
from radixlm.radix_cache.tree import RadixCache, TreeNode
from radixlm.runtime.request import ANY_SALT, Req, same_tenant

_TOKEN_MASK = (1 << 32) - 1  # a salted first token keeps its id in the low 32 bits
_MAX_SIBLINGS = 64  # children of the stop node compared for a tokenization boundary
_TEXT_TOKENS = 8  # tokens decoded on each side to compare texts


class CacheExplainer:
    """Builds explanations and keeps the last ``capacity`` of them for ``explain-cache``."""

    def __init__(self, tokenizer, capacity: int = 256) -> None:
        self.tokenizer = tokenizer
        # (tenant's cache_salt, the request's explanation, what only the operator may read)
        self.recent: deque[tuple[str | None, dict[str, Any], dict[str, Any]]] = deque(maxlen=capacity)

    def last(self, n: int, cache_salt: Any = ANY_SALT) -> list[dict[str, Any]]:
        """The newest ``n`` explanations of tenant ``cache_salt``, oldest first (``ANY_SALT``: every
        tenant's, with what only the operator may read)."""
        if n <= 0:
            return []
        if cache_salt is ANY_SALT:
            return [_merged(info, private) for _, info, private in list(self.recent)[-n:]]
        return [info for salt, info, _ in self.recent if same_tenant(salt, cache_salt)][-n:]

    def explain(self, tree: RadixCache, req: Req, last_node: TreeNode, limit: int) -> dict[str, Any]:
        """The explanation of ``req`` matched up to ``last_node`` (its cacheable limit ``limit``)."""
        path = _path(tree, last_node)
        ids = req.cache_ids
        matched = sum(len(n.key) for n in path)
        info: dict[str, Any] = {
            "rid": req.rid,
            "program": req.program,
            "prompt_cache_key": req.prompt_cache_key,
            "time": time.time(),
            "prompt_tokens": len(req.input_ids),
            "cached_tokens": matched,
            "fresh_tokens": len(req.input_ids) - matched,
            "segments": _segments(path),
            "recomputed_after_eviction": None,
        }
        info["miss"] = self._miss(tree, req, ids, path, matched, limit, info)
        private: dict[str, Any] = {}
        if info["miss"]["reason"] == "cache_salt":  # another tenant's prompt: not the request's to know
            info["miss"]["reason"] = "new_text"
            private["miss_reason"] = "cache_salt"
        self.recent.append((req.cache_salt, info, private))
        return info

    def _miss(self, tree: RadixCache, req: Req, ids: list[int], path: list[TreeNode], matched: int, limit: int, info: dict) -> dict[str, Any]:
        miss: dict[str, Any] = {"stopped_at": matched, "reason": "new_text"}
        if tree.disable:
            miss["reason"] = "cache_disabled"
            return miss
        if matched >= limit - limit % tree.page_size:
            miss["reason"] = "full"
            return miss
        if tree.snapshots is not None:  # a hybrid model: the KV may go on past the last state snapshot
            kv = tree.match_prefix(ids[:limit], whole_kv=True).length
            if kv > matched:
                miss.update(reason="no_snapshot", cached_kv_tokens=kv)
                return miss
        evicted = _evicted(tree, ids, path, matched)
        if evicted is not None:
            when, end = evicted
            miss.update(reason="evicted", evicted_at=when)
            info["recomputed_after_eviction"] = {"evicted_at": when, "tokens": min(end, len(req.input_ids)) - matched}
            return miss
        if matched == 0 and _other_salt(tree, ids):
            miss["reason"] = "cache_salt"
            return miss
        boundary = self._boundary(path[-1] if path else tree.root, req.fill_ids, matched, ids[0] >> 32)
        if boundary is not None:
            miss.update(reason="tokenization_boundary", **boundary)
        return miss

    def _boundary(self, node: TreeNode, ids: list[int], matched: int, salt_bits: int) -> dict[str, Any] | None:
        """A cached child spelling the same text as ``ids[matched:]`` with other tokens, if any
        (at the root, only the request's own tenant's edges: ``salt_bits`` of the first key)."""
        rest = ids[matched:]
        children = [c for c in node.children.values() if node.parent is not None or c.key[0] >> 32 == salt_bits]
        for child in children[:_MAX_SIBLINGS]:
            key = [t & _TOKEN_MASK for t in child.key[:_TEXT_TOKENS]]
            j = 0
            while j < min(len(key), len(rest)) and key[j] == rest[j]:
                j += 1
            if j >= min(len(key), len(rest)):
                continue
            ours, theirs = self._text(rest[j : j + _TEXT_TOKENS]), self._text(key[j:])
            first = min(len(self._text(rest[j : j + 1])), len(self._text(key[j : j + 1])))
            if first and len(os.path.commonprefix([ours, theirs])) >= first:
                return {"diverged_at": matched + j, "text": ours, "cached_text": theirs}
        return None

    def _text(self, ids: list[int]) -> str:
        try:
            return self.tokenizer.decode(ids)
        except Exception:  # an id the tokenizer cannot decode: no text to compare
            return ""


def _merged(info: dict[str, Any], private: dict[str, Any]) -> dict[str, Any]:
    """The operator's view of an explanation: the request's, with the cross-tenant reason restored."""
    if "miss_reason" not in private:
        return info
    return {**info, "miss": {**info["miss"], "reason": private["miss_reason"]}}


def _path(tree: RadixCache, node: TreeNode) -> list[TreeNode]:
    nodes = []
    while node is not tree.root:
        nodes.append(node)
        node = node.parent
    nodes.reverse()
    return nodes


def _segments(path: list[TreeNode]) -> list[dict[str, Any]]:
    """Consecutive nodes with the same origin, reuse count and tier, as token ranges (``tier``: where
    the segment's KV was last loaded from: host or disk, or device when it was computed in the pool)."""
    segments: list[dict[str, Any]] = []
    pos = 0
    for node in path:
        end = pos + len(node.key)
        last = segments[-1] if segments else None
        tier = node.tier or "device"
        if last is not None and last["_origin"] is node.origin and last["reuse_count"] == node.reuse and last["tier"] == tier:
            last["end"] = end
        else:
            seg = {"start": pos, "end": end, "_origin": node.origin, "reuse_count": node.reuse, "tier": tier}
            segments.append(seg)
        pos = end
    out = []
    for seg in segments:
        origin = seg.pop("_origin")
        fields = origin.to_dict() if origin is not None else {"rid": None, "program": None, "prompt_cache_key": None, "created": None}
        out.append({"start": seg["start"], "end": seg["end"], "origin_rid": fields["rid"], "program": fields["program"], "prompt_cache_key": fields["prompt_cache_key"], "created": fields["created"], "reuse_count": seg["reuse_count"], "tier": seg["tier"]})
    return out


def _evicted(tree: RadixCache, ids: list[int], path: list[TreeNode], matched: int) -> tuple[float, int] | None:
    """(when, end) of an evicted edge covering ``ids[matched]``: starting at the stop, or at an
    edge start on the path whose evicted extent reached past it (re-cached in part since)."""
    page = tree.page_size
    hit = tree.evictions.lookup(path_key(ids, matched + page))
    if hit is not None:
        return hit
    starts, pos = [], 0
    for node in path:
        starts.append(pos)
        pos += len(node.key)
    for start in reversed(starts):
        hit = tree.evictions.lookup(path_key(ids, start + page))
        if hit is not None and hit[1] > matched:
            return hit
    return None


def _other_salt(tree: RadixCache, ids: list[int]) -> bool:
    """True when a root edge holds the same first token under another salt (or none)."""
    first = ids[0] & _TOKEN_MASK
    for child in tree.root.children.values():
        t = child.key[0]
        if t != ids[0] and t & _TOKEN_MASK == first and child.key[1:2] == tuple(ids[1:2]):
            return True
    return False
