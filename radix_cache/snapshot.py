"""A bounded, read-only picture of a RadixCache for the dashboard.

A tree can hold 100k nodes; a picture of it must stay small and cheap. The snapshot describes
at most ``max_nodes`` nodes, chosen hottest first (locked paths, then most recently used), so
the parts a person cares about are shown and deep or cold branches are folded::

    root ── [A] 120 tok ── [B] 40 tok
             │          └─ (37 more nodes, 900 tokens)     children of A not described
             └─ ...
    (unwalked: ? nodes, 5000 tokens)                       left when the walk budget ran out

Folded branches are counted (nodes, tokens, locked tokens) by a second walk that touches at
most ``walk_budget`` nodes in all; whatever that walk cannot reach is one root-level entry whose
tokens are the tree's own total minus everything counted, so the sizes always sum to
``tree.total_size()`` and the locked tokens to ``tree.protected_size()`` when the walk is
complete. Call it where the tree cannot change meanwhile (the engine's loop thread). It never
modifies the tree: no split, no LRU touch.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from radixlm.radix_cache.tree import RadixCache, TreeNode

HEAD_TOKENS = 12  # leading token ids kept per described edge (for a text preview)


def _fold_count(node: TreeNode, budget: int) -> tuple[int, int, int, int, bool]:
    """Nodes, tokens, locked tokens and newest access of ``node``'s subtree within ``budget`` visits.

    The last item is True when the whole subtree was counted.
    """
    nodes = tokens = locked = newest = 0
    stack = [node]
    while stack:
        if nodes >= budget:
            return nodes, tokens, locked, newest, False
        n = stack.pop()
        nodes += 1
        size = len(n.key)
        tokens += size
        if n.lock_ref:
            locked += size
        if n.last_access > newest:
            newest = n.last_access
        stack.extend(n.children.values())
    return nodes, tokens, locked, newest, True


def snapshot_tree(tree: RadixCache, max_nodes: int = 400, walk_budget: int = 20_000) -> dict[str, Any]:
    """A JSON-ready, bounded description of ``tree`` (see the module docstring).

    Returns ``{"nodes": [...], "total_tokens", "evictable", "protected", "clock", "complete"}``.
    Each node entry is ``{"id", "parent", "len", "size", "lock", "tick", "head", "tier"}`` (``size``:
    tokens of its subtree as described and folded; ``tick``: the tree's LRU clock at its last
    access); a folded entry is ``{"id", "parent", "more", "size", "locked", "tick"}`` where
    ``more`` is its node count (None when unknown). The root has id 0 and parent None.
    """
    if not isinstance(max_nodes, int) or isinstance(max_nodes, bool) or max_nodes < 1:
        raise ValueError(f"max_nodes must be an integer >= 1, got {max_nodes!r}")
    if not isinstance(walk_budget, int) or isinstance(walk_budget, bool) or walk_budget < 0:
        raise ValueError(f"walk_budget must be an integer >= 0, got {walk_budget!r}")
    root = tree.root
    ids = itertools.count(1)
    entries: list[dict[str, Any]] = [{"id": 0, "parent": None, "len": 0, "size": 0, "lock": 0, "tick": root.last_access, "head": []}]
    clock = root.last_access
    # Hottest first: locked before unlocked, then the most recent access. A parent is never
    # colder than its children, so the described part is always a connected top of the tree.
    order = itertools.count()
    heap: list[tuple[int, int, int, int, TreeNode]] = []
    max_pushed = max_nodes + walk_budget  # a node with 100k children must not be read whole
    skipped = False  # children never looked at (only the tree's total accounts for them)

    def push_children(node: TreeNode, node_id: int) -> None:
        nonlocal skipped
        for child in node.children.values():
            if len(heap) >= max_pushed:
                skipped = True
                return
            heapq.heappush(heap, (-(child.lock_ref > 0), -child.last_access, next(order), node_id, child))

    push_children(root, 0)
    while heap and len(entries) <= max_nodes:
        *_, parent_id, node = heapq.heappop(heap)
        node_id = next(ids)
        entries.append(
            {
                "id": node_id,
                "parent": parent_id,
                "len": len(node.key),
                "size": len(node.key),
                "lock": node.lock_ref,
                "tick": node.last_access,
                "head": [t & 0xFFFFFFFF for t in node.key[:HEAD_TOKENS]],  # salted keys back to token ids
                "tier": node.tier,  # host or disk: the KV tier it was loaded back from (None: computed in the pool)
            }
        )
        clock = max(clock, node.last_access)
        push_children(node, node_id)
    # Fold what was not described, one entry per parent, counting within the walk budget.
    folded: dict[int, dict[str, Any]] = {}
    budget, unwalked_tick = walk_budget, 0
    for *_, parent_id, node in sorted(heap, key=lambda item: item[:3]):
        whole = False
        if budget > 0:
            nodes, tokens, locked, newest, whole = _fold_count(node, budget)
            budget -= nodes
        if not whole:  # a partly counted branch is reported as unwalked, not as a wrong count
            skipped = True
            unwalked_tick = max(unwalked_tick, node.last_access)
            continue
        entry = folded.get(parent_id)
        if entry is None:
            entry = folded[parent_id] = {"id": next(ids), "parent": parent_id, "more": 0, "size": 0, "locked": 0, "tick": 0}
        entry["more"] += nodes
        entry["size"] += tokens
        entry["locked"] += locked
        entry["tick"] = max(entry["tick"], newest)
    entries.extend(folded.values())
    described = sum(e["len"] for e in entries if "len" in e) + sum(e["size"] for e in folded.values())
    if skipped:
        entries.append({"id": next(ids), "parent": 0, "more": None, "size": tree.total_size() - described, "locked": None, "tick": unwalked_tick})
    # Subtree sizes: children come after their parents in ``entries``, so one reverse pass sums them.
    index = {e["id"]: e for e in entries}
    for e in reversed(entries):
        if e["parent"] is not None:
            index[e["parent"]]["size"] += e["size"]
    return {
        "nodes": entries,
        "total_tokens": tree.total_size(),
        "evictable": tree.evictable_size(),
        "protected": tree.protected_size(),
        "clock": clock,
        "complete": not skipped,
    }
