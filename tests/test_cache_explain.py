"""Per-request cache explanations and retention hints: the tree's per-node bookkeeping and the
Engine's explanations for a scripted sequence on the tiny Llama."""

from __future__ import annotations

import pytest
import torch

from radixlm.radix_cache import Origin, RadixCache

PREFIX = list(range(10, 50))  # 40 tokens every scripted request shares
GREEDY = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}


def _tree() -> tuple[RadixCache, list]:
    freed: list = []
    return RadixCache(freed.append, track_origins=True), freed


def _slots(n: int, base: int = 0) -> torch.Tensor:
    return torch.arange(base, base + n, dtype=torch.int64)


# ------------------------------------------------------------------ the tree
def test_split_keeps_origin_and_reuse_count_on_both_halves():
    tree, _ = _tree()
    a = Origin("A", program="few_shot")
    tree.insert(PREFIX, _slots(40), a)
    tree.note_reuse(tree.match_prefix(PREFIX).last_node)
    upper = tree.match_prefix(PREFIX[:15]).last_node  # splits the edge after 15 tokens
    lower = next(iter(upper.children.values()))
    assert len(upper.key) == 15 and len(lower.key) == 25
    assert upper.origin is a and lower.origin is a
    assert upper.reuse == lower.reuse == 1
    tree.check_integrity()


def test_new_edge_records_its_own_origin_below_a_shared_one():
    tree, _ = _tree()
    tree.insert(PREFIX, _slots(40), Origin("A"))
    tree.insert(PREFIX + [1, 2, 3], _slots(43, 100), Origin("B"))
    node = tree.match_prefix(PREFIX + [1, 2, 3]).last_node
    assert node.origin.rid == "B" and node.parent.origin.rid == "A"
    tree.check_integrity()


def test_eviction_is_logged_under_the_path_hash_and_survives_clear():
    tree, freed = _tree()
    tree.insert(PREFIX, _slots(40), Origin("A"))
    tree.clear()
    assert freed and tree.total_size() == 0
    from radixlm.radix_cache.origin import path_key

    when, end = tree.evictions.lookup(path_key(PREFIX, 1))
    assert end == 40 and when > 0


def test_retention_hint_spares_a_leaf_while_others_can_go_and_yields_under_pressure():
    tree, freed = _tree()
    tree.insert([1, 2, 3, 4], _slots(4), Origin("kept"))  # older: LRU would take it first
    tree.insert([7, 8, 9, 10], _slots(4, 10), Origin("plain"))
    tree.protect([1, 2, 3, 4], ttl=600)
    tree.match_prefix([7, 8, 9, 10])  # touch the unhinted one last
    assert tree.evict(4) == 4
    assert torch.equal(freed[-1], _slots(4, 10)), "the unhinted leaf goes first"
    assert tree.evicted_despite_hint == 0
    assert tree.note_reuse(tree.match_prefix([1, 2, 3, 4]).last_node) is True
    assert tree.retention_hits == 1
    assert tree.evict(4) == 4, "under pressure the hint yields"
    assert tree.evicted_despite_hint == 1 and tree.total_size() == 0
    tree.check_integrity()


def test_protect_refuses_a_nonpositive_ttl():
    tree, _ = _tree()
    with pytest.raises(ValueError, match="ttl"):
        tree.protect([1, 2], ttl=0)


# --------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def engine(tiny_llama):
    import radixlm

    eng = radixlm.Engine(tiny_llama, max_total_tokens=512)
    yield eng
    eng.shutdown()


def _info(engine, ids, **kw) -> dict:
    out = engine.generate(input_ids=ids, sampling_params=GREEDY, return_cache_info=True, **kw)
    return out["meta_info"]["cache_info"]


def test_scripted_sequence_names_who_computed_the_prefix_and_says_evicted_after_flush(engine):
    assert engine.flush_cache()
    a = _info(engine, PREFIX + [60, 61, 62], program="few_shot", prompt_cache_key="session-1")
    assert a["cached_tokens"] == 0 and a["fresh_tokens"] == 43 and a["segments"] == []
    assert a["miss"] == {"stopped_at": 0, "reason": "new_text"}
    b = _info(engine, PREFIX + [70, 71])
    c = _info(engine, PREFIX + [80, 81, 82, 83])
    for info, reuses in ((b, 1), (c, 2)):
        assert info["cached_tokens"] == 40 and info["fresh_tokens"] == len(PREFIX) + (2 if reuses == 1 else 4) - 40
        (seg,) = info["segments"]
        assert (seg["start"], seg["end"]) == (0, 40)
        assert seg["origin_rid"] == a["rid"] and seg["program"] == "few_shot" and seg["prompt_cache_key"] == "session-1"
        assert seg["reuse_count"] == reuses
        assert info["miss"]["stopped_at"] == 40 and info["recomputed_after_eviction"] is None
    assert engine.flush_cache()
    d = _info(engine, PREFIX + [90, 91])
    assert d["cached_tokens"] == 0
    assert d["miss"]["reason"] == "evicted" and d["miss"]["evicted_at"] >= a["time"]
    assert d["recomputed_after_eviction"]["tokens"] == 40
    recent = engine.cache_explanations(4)
    assert [e["rid"] for e in recent] == [a["rid"], b["rid"], c["rid"], d["rid"]]
    engine.check_accounting()


def test_full_prompt_hit_reports_full_and_two_origins_as_two_segments(engine):
    assert engine.flush_cache()
    first = _info(engine, PREFIX)
    second = _info(engine, PREFIX + [5, 6, 7, 8])
    third = _info(engine, PREFIX + [5, 6, 7, 8, 9])
    assert second["miss"]["stopped_at"] == 40 and first["cached_tokens"] == 0
    segments = [(s["start"], s["end"], s["origin_rid"], s["reuse_count"]) for s in third["segments"]]
    assert segments == [(0, 40, first["rid"], 2), (40, 44, second["rid"], 1)]
    again = _info(engine, PREFIX + [5, 6, 7, 8, 9])
    assert again["miss"]["reason"] == "full"


def test_another_salt_is_named_to_the_operator_but_never_to_the_request(engine):
    assert engine.flush_cache()
    fresh_prefix = list(range(200, 240))  # never cached unsalted, so never evicted either
    _info(engine, fresh_prefix + [1], cache_salt="tenant-a")
    other = _info(engine, fresh_prefix + [2], cache_salt="tenant-b")
    plain = _info(engine, fresh_prefix + [3])
    # the requests learn nothing of tenant a's prompt
    assert other["cached_tokens"] == 0 and other["miss"]["reason"] == "new_text"
    assert plain["miss"]["reason"] == "new_text"
    # the operator's listing says why
    listed = engine.cache_explanations(2)
    assert [item["miss"]["reason"] for item in listed] == ["cache_salt", "cache_salt"]
    # a tenant's own listing holds only its requests
    assert [item["rid"] for item in engine.cache_explanations(10, cache_salt="tenant-b")] == [other["rid"]]


def _prefix_pair(tok) -> tuple[int, int, int]:
    """Token ids t1, t2 with text(t2) starting with text(t1) (longer), and t3 sharing no prefix."""
    texts = {i: tok.decode([i]) for i in range(min(len(tok), 2000))}
    by_text = {t: i for i, t in texts.items() if len(t.strip()) >= 2}
    for t2_text, t2 in sorted(by_text.items(), key=lambda kv: -len(kv[0])):
        for k in range(len(t2_text) - 1, 1, -1):
            t1 = by_text.get(t2_text[:k])
            if t1 is not None:
                t3 = next(i for i, t in texts.items() if t and t[0] != t2_text[0] and t.strip())
                return t1, t2, t3
    raise AssertionError("no token whose text begins another's in the tiny vocabulary")


def test_tokenization_boundary_is_told_apart_from_new_text(engine):
    t1, t2, t3 = _prefix_pair(engine.tokenizer)
    assert engine.flush_cache()
    _info(engine, PREFIX + [t2, 20, 21])
    boundary = _info(engine, PREFIX + [t1, 22, 23])
    fresh = _info(engine, PREFIX + [t3, 24, 25])
    assert boundary["miss"]["stopped_at"] == 40
    assert boundary["miss"]["reason"] == "tokenization_boundary" and boundary["miss"]["diverged_at"] == 40
    assert fresh["miss"]["reason"] == "new_text"


def test_cache_ttl_counts_a_retention_hit_when_reused(engine):
    assert engine.flush_cache()
    before = engine.get_stats()["retention_hits"]
    engine.generate(input_ids=PREFIX + [3, 4], sampling_params=GREEDY, cache_ttl=600)
    engine.generate(input_ids=PREFIX + [3, 4, 5], sampling_params=GREEDY)
    assert engine.get_stats()["retention_hits"] == before + 1
    engine.check_accounting()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"return_cache_info": "yes"}, "return_cache_info"),
        ({"cache_ttl": -1}, "cache_ttl"),
        ({"cache_ttl": True}, "cache_ttl"),
        ({"program": ""}, "program"),
        ({"prompt_cache_key": 5}, "prompt_cache_key"),
    ],
)
def test_bad_cache_options_raise_naming_the_argument(engine, kwargs, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(input_ids=PREFIX, sampling_params=GREEDY, **kwargs)
    assert engine.get_stats()["num_waiting"] == 0
