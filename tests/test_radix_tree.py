"""RadixCache: matching, insertion, splitting, locks, LRU eviction and a property test."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.radix_cache import RadixCache, SlotAllocator


def _tree(page_size: int = 1):
    freed: list[int] = []
    tree = RadixCache(lambda slots: freed.extend(slots.tolist()), page_size=page_size)
    return tree, freed


def _slots(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def test_insert_then_match_returns_the_inserted_slots():
    tree, _ = _tree()
    assert tree.insert([1, 2, 3, 4], _slots(10, 4)) == 0
    m = tree.match_prefix([1, 2, 3, 4, 5])
    assert m.slots.tolist() == [10, 11, 12, 13]
    assert tree.match_prefix([9]).length == 0
    tree.check_integrity()


def test_insert_reports_the_length_already_present():
    tree, _ = _tree()
    tree.insert([1, 2, 3], _slots(0, 3))
    assert tree.insert([1, 2, 3, 4, 5], _slots(100, 5)) == 3
    # the tree kept its own slots for the shared part and adopted the new tail
    assert tree.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == [0, 1, 2, 103, 104]
    assert tree.total_size() == 5


def test_match_ending_inside_an_edge_splits_it():
    tree, _ = _tree()
    tree.insert([1, 2, 3, 4, 5, 6], _slots(0, 6))
    m = tree.match_prefix([1, 2, 3, 9])
    assert m.slots.tolist() == [0, 1, 2]
    assert m.last_node.key == (1, 2, 3)
    assert len(tree.root.children) == 1
    tree.check_integrity()
    lines = tree.pretty_print().splitlines()
    assert lines[1].strip() == "[1 2 3] len=3 lock=0"
    assert lines[2].strip() == "[4 5 6] len=3 lock=0"


def test_branching_inserts_share_the_common_prefix():
    tree, _ = _tree()
    tree.insert([1, 2, 3, 4], _slots(0, 4))
    assert tree.insert([1, 2, 7, 8], _slots(10, 4)) == 2
    assert tree.match_prefix([1, 2, 7, 8]).slots.tolist() == [0, 1, 12, 13]
    assert tree.total_size() == 6
    tree.check_integrity()


def test_locked_paths_survive_eviction_and_unlocked_leaves_go_lru_first():
    tree, freed = _tree()
    tree.insert([1, 2, 3], _slots(0, 3))
    tree.insert([1, 2, 4], _slots(10, 3))
    tree.insert([5, 6], _slots(20, 2))
    tree.match_prefix([5, 6])  # touch: [5, 6] becomes most recent
    locked = tree.match_prefix([1, 2, 3]).last_node
    tree.inc_lock_ref(locked)
    assert tree.protected_size() == 3 and tree.evictable_size() == 3
    assert tree.evict(1) == 1
    assert freed == [12]  # the [4] leaf: unlocked and least recently used
    assert tree.evict(100) == 2
    assert sorted(freed) == [12, 20, 21]
    assert tree.match_prefix([1, 2, 3]).length == 3
    tree.dec_lock_ref(locked)
    assert tree.evict(100) == 3
    assert tree.total_size() == 0
    tree.check_integrity()


def test_page_aligned_matching_and_insertion():
    tree, _ = _tree(page_size=4)
    assert tree.insert(list(range(10)), _slots(0, 10)) == 0
    assert tree.total_size() == 8  # only whole pages are kept
    assert tree.match_prefix(list(range(7)) + [99]).length == 4
    assert tree.match_prefix(list(range(9))).length == 8
    assert tree.match_prefix([0, 1, 2]).length == 0
    tree.check_integrity()


def test_disabled_cache_matches_nothing_and_keeps_nothing():
    tree = RadixCache(lambda s: None, disable=True)
    assert tree.insert([1, 2, 3], _slots(0, 3)) == 3
    assert tree.match_prefix([1, 2, 3]).length == 0
    assert tree.total_size() == 0


def test_hit_rate_counts_recorded_queries_only():
    tree, _ = _tree()
    tree.insert([1, 2, 3, 4], _slots(0, 4))
    tree.match_prefix([1, 2, 9, 9])  # a probe: not counted
    tree.record(4, 4)
    tree.record(4, 2)
    assert tree.query_tokens == 8 and tree.hit_tokens == 6
    assert abs(tree.hit_rate() - 0.75) < 1e-9


def test_dec_lock_on_unlocked_node_raises():
    tree, _ = _tree()
    tree.insert([1], _slots(0, 1))
    node = tree.match_prefix([1]).last_node
    try:
        tree.dec_lock_ref(node)
    except RuntimeError:
        return
    raise AssertionError("expected RuntimeError")


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 3), min_size=1, max_size=12)),
        st.tuples(st.just("match"), st.lists(st.integers(0, 3), min_size=1, max_size=12)),
        st.tuples(st.just("lock"), st.lists(st.integers(0, 3), min_size=1, max_size=12)),
        st.tuples(st.just("unlock"), st.integers(0, 20)),
        st.tuples(st.just("evict"), st.integers(1, 10)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=_ops, page_size=st.sampled_from([1, 2]))
def test_tree_agrees_with_a_brute_force_prefix_map(ops, page_size):
    """Random insert/match/lock/evict sequences against a dict of every cached prefix."""
    freed: list[int] = []
    tree = RadixCache(lambda s: freed.extend(s.tolist()), page_size=page_size)
    model: dict[tuple[int, ...], list[int]] = {}  # page-aligned token prefix → its last page's slots
    locks: list = []
    next_slot = 0

    def expected_match(q: list[int]) -> list[int]:
        out: list[int] = []
        for k in range(page_size, len(q) + 1, page_size):
            if tuple(q[:k]) not in model:
                break
            out.extend(model[tuple(q[:k])])
        return out

    for op, arg in ops:
        if op == "insert":
            slots = torch.arange(next_slot, next_slot + len(arg), dtype=torch.int64)
            next_slot += len(arg)
            present = tree.insert(arg, slots)
            assert present == len(expected_match(arg))
            for k in range(present + page_size, len(arg) + 1, page_size):
                model[tuple(arg[:k])] = slots[k - page_size : k].tolist()
        elif op == "match":
            assert tree.match_prefix(arg).slots.tolist() == expected_match(arg)
        elif op == "lock":
            m = tree.match_prefix(arg)
            tree.inc_lock_ref(m.last_node)
            locks.append((m.last_node, m.slots.tolist()))
        elif op == "unlock" and locks:
            node, _ = locks.pop(arg % len(locks))
            tree.dec_lock_ref(node)
        elif op == "evict":
            before = len(freed)
            got = tree.evict(arg)
            gone = set(freed[before:])
            assert got == len(gone)
            assert got >= min(arg, 1) or tree.evictable_size() == 0
            for _, slots in locks:
                assert not gone & set(slots), "evicted a locked slot"
            model = {k: v for k, v in model.items() if not gone & set(v)}
        tree.check_integrity()
        # the tree holds exactly the model's slots
        assert sorted(tree.all_slots().tolist()) == sorted(x for v in model.values() for x in v)


def test_allocator_hands_out_whole_pages_and_takes_them_back():
    alloc = SlotAllocator(16, page_size=4)
    a = alloc.alloc_slots(5)
    assert a.tolist() == list(range(8))
    assert alloc.available_slots() == 8
    assert alloc.alloc_slots(9) is None
    alloc.free_slots(a[:5])  # the two pages the slots touch
    assert alloc.available_slots() == 16
    assert alloc.free_page_ids().tolist() == [0, 1, 2, 3]


def test_allocator_prefers_low_contiguous_slots_after_frees():
    alloc = SlotAllocator(8)
    a = alloc.alloc_slots(8)
    alloc.free_slots(a[[5, 1, 3]])
    assert alloc.alloc_slots(3).tolist() == [1, 3, 5]
