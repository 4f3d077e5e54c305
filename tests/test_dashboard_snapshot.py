"""The dashboard's tree snapshot: consistent with the tree's own counters, bounded on huge trees."""

from __future__ import annotations

import json
import random

import pytest
import torch

from radixlm.radix_cache.snapshot import snapshot_tree
from radixlm.radix_cache.tree import RadixCache, TreeNode
from radixlm.runtime.entrypoints.dashboard.history import CounterHistory


def _small_tree() -> tuple[RadixCache, list]:
    tree = RadixCache(lambda slots: None)
    rng = random.Random(0)
    next_slot = 0
    handles = []
    for _ in range(40):
        base = rng.choice([[1, 2, 3, 4], [1, 2, 9], [7, 7, 7, 7, 7], [5]])
        tokens = base + [rng.randrange(10, 60) for _ in range(rng.randrange(1, 6))]
        slots = torch.arange(next_slot, next_slot + len(tokens))
        kept = tree.insert(tokens, slots)
        next_slot += len(tokens)
        handles.append(tokens)
        assert kept >= 0
    for tokens in handles[:5]:  # a few running requests lock their paths
        tree.inc_lock_ref(tree.match_prefix(tokens).last_node)
    tree.check_integrity()
    return tree, handles


def _described(snap: dict) -> list[dict]:
    return [n for n in snap["nodes"] if "len" in n and n["id"] != 0]


def _tree_nodes(tree: RadixCache) -> list[TreeNode]:
    stack, out = list(tree.root.children.values()), []
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def test_snapshot_of_a_small_tree_matches_the_trees_integrity_counters():
    tree, _ = _small_tree()
    before = tree.pretty_print()
    snap = snapshot_tree(tree, max_nodes=1000)
    assert tree.pretty_print() == before, "the snapshot changed the tree"
    tree.check_integrity()
    nodes = _tree_nodes(tree)
    described = _described(snap)
    assert snap["complete"] and len(described) == len(nodes)
    root = snap["nodes"][0]
    assert root["size"] == tree.total_size() == sum(n["len"] for n in described)
    assert sum(n["len"] for n in described if n["lock"]) == tree.protected_size() > 0
    assert snap["evictable"] == tree.evictable_size() and snap["protected"] == tree.protected_size()
    # Each described node's lock count is the tree's, matched by (edge length, lock) multisets
    # and, per node, by the subtree sizes adding up.
    assert sorted((n["len"], n["lock"]) for n in described) == sorted((len(n.key), n.lock_ref) for n in nodes)
    by_id = {n["id"]: n for n in snap["nodes"]}
    for n in described:
        kids = [c for c in snap["nodes"] if c["parent"] == n["id"]]
        assert n["size"] == n["len"] + sum(c["size"] for c in kids)
        assert by_id[n["parent"]]["size"] >= n["size"]


def _big_tree(num_nodes: int, seed: int = 0) -> RadixCache:
    """A tree of ``num_nodes`` nodes built directly (each edge 1-4 tokens), counters set to match."""
    tree = RadixCache(lambda slots: None)
    rng = random.Random(seed)
    nodes = [tree.root]
    slot = 0
    for i in range(num_nodes):
        parent = nodes[rng.randrange(len(nodes))] if rng.random() < 0.7 else nodes[-1]  # some deep chains
        length = rng.randrange(1, 5)
        key = (100_000 + i,) + tuple(rng.randrange(1000) for _ in range(length - 1))
        node = TreeNode(key=key, value=torch.arange(slot, slot + length), parent=parent, last_access=i)
        parent.children[key[0]] = node
        nodes.append(node)
        slot += length
        tree._evictable += length
    return tree


def test_snapshot_of_a_100k_node_tree_stays_small_and_sums_to_the_total():
    tree = _big_tree(100_000)
    deep = max(_tree_nodes(tree), key=lambda n: n.last_access)  # lock the newest leaf's path
    while deep.children:
        deep = next(iter(deep.children.values()))
    tree.inc_lock_ref(deep)
    tree.check_integrity()
    snap = snapshot_tree(tree, max_nodes=400, walk_budget=20_000)
    body = json.dumps(snap)
    assert len(_described(snap)) <= 400
    assert len(snap["nodes"]) <= 2 * 400 + 2  # described + one fold per parent + the unwalked rest
    assert len(body) < 80_000, len(body)
    assert not snap["complete"]
    assert snap["nodes"][0]["size"] == tree.total_size()
    assert sum(n["size"] for n in snap["nodes"] if n["parent"] == 0) == tree.total_size()
    # Locked paths are described first, with the tree's lock counts.
    locked = [n for n in _described(snap) if n["lock"]]
    assert sum(n["len"] for n in locked) == tree.protected_size() > 0
    assert all(n["lock"] == 1 for n in locked)
    assert any(n.get("more") for n in snap["nodes"]), "cold branches are folded"


def test_snapshot_of_a_node_with_100k_children_reads_a_bounded_number_of_them():
    tree = RadixCache(lambda slots: None)
    for i in range(100_000):
        tree.root.children[i] = TreeNode(key=(i,), value=torch.tensor([i]), parent=tree.root, last_access=i)
    tree._evictable = 100_000
    snap = snapshot_tree(tree, max_nodes=200, walk_budget=1_000)
    assert len(snap["nodes"]) <= 200 + 3
    assert snap["nodes"][0]["size"] == 100_000 and not snap["complete"]
    ticks = [n["tick"] for n in _described(snap)]
    assert len(ticks) == 200 and ticks == sorted(ticks, reverse=True), "hottest first among those read"
    assert max(ticks) < 200 + 1_000, "no more children read than the budgets allow"


def test_complete_walk_counts_folded_branches_exactly():
    tree = _big_tree(3_000, seed=1)
    snap = snapshot_tree(tree, max_nodes=50, walk_budget=10_000)
    assert snap["complete"]
    folded = [n for n in snap["nodes"] if "more" in n]
    assert sum(n["more"] for n in folded) + len(_described(snap)) == 3_000
    assert sum(n["size"] for n in folded) + sum(n["len"] for n in _described(snap)) == tree.total_size()


@pytest.mark.parametrize(("kwargs", "name"), [({"max_nodes": 0}, "max_nodes"), ({"walk_budget": -1}, "walk_budget"), ({"max_nodes": "9"}, "max_nodes")])
def test_snapshot_rejects_bad_budgets_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        snapshot_tree(RadixCache(lambda slots: None), **kwargs)


def test_history_turns_counters_into_rates_and_ticks_into_ages():
    h = CounterHistory(max_samples=5)
    base = {"tree_slots": 10, "evictable_slots": 6, "running_slots": 3, "free_slots": 87, "num_running": 1, "num_waiting": 0,
            "query_tokens": 100, "hit_tokens": 40, "output_tokens": 50, "prefill_tokens": 60, "clock": 10}
    assert h.record(base, now=1000.0)
    assert not h.record({**base, "clock": 11}, now=1000.5), "samples closer than the interval are skipped"
    assert h.record({**base, "query_tokens": 200, "hit_tokens": 115, "output_tokens": 70, "clock": 20}, now=1001.0)
    last = h.since(1000.0)
    assert len(last) == 1 and last[0]["hit_rate"] == 0.75 and last[0]["tok_s"] == 20.0 and last[0]["locked"] == 4
    assert h.ages([5, 10, 15, 20, 25], now=1003.0) == [None, 3.0, 2.0, 2.0, 0.0]
    for i in range(10):
        h.record({**base, "clock": 30 + i}, now=1002.0 + i)
    assert len(h.since(0)) == 5, "the history is bounded"
