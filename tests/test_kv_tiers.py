"""KV tiers under the radix tree: host memory and disk hold what the pool evicts, and give it back."""

from __future__ import annotations

import errno
import random

import pytest
import torch

import radixlm
from radixlm.radix_cache.pool import KVPool
from radixlm.radix_cache.tiers.codec import KVCodec

GREEDY = {"max_new_tokens": 8, "temperature": 0.0}


def conversations(count: int = 3, length: int = 100, seed: int = 0) -> list[list[int]]:
    """Random prompts of ``length`` token ids, distinct from their first token on."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 200) for _ in range(length)] for _ in range(count)]


def alternate(engine: radixlm.Engine, prompts: list[list[int]], turns: int = 2) -> list[dict]:
    """Each conversation in turn, ``turns`` times round: a turn sends the history so far plus 12 new tokens."""
    histories = [list(p) for p in prompts]
    outs, rng = [], random.Random(1)
    for _ in range(turns):
        for h in histories:
            out = engine.generate(input_ids=list(h), sampling_params=GREEDY)
            outs.append(out)
            h += out["output_ids"] + [rng.randrange(10, 200) for _ in range(12)]
    return outs


def tiered_engine(model: str, **kw) -> radixlm.Engine:
    """An engine whose pool holds about one conversation, with KV tiers of 32-token blocks as ``kw`` says."""
    return radixlm.Engine(model, max_total_tokens=160, num_threads=1, kv_tier_block_tokens=32, **kw)


@pytest.mark.parametrize("kv", [{"kv_cache_dtype": "int8"}, {"kv_tier_format": "exact"}], ids=["int8_pool", "fp32_pool_exact"])
def test_second_visit_of_each_conversation_hits_the_host_tier_with_cold_output(tiny_llama, kv):
    prompts = conversations()
    with tiered_engine(tiny_llama, **kv) as cold:
        want = alternate(cold, prompts)
    with tiered_engine(tiny_llama, kv_host_cache_gb=0.01, **kv) as eng:
        got = alternate(eng, prompts)
        eng.check_accounting()
        stats = eng.get_stats()["kv_tiers"]
        picture = eng.dashboard_state()
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    for first, second in zip(got[:3], got[3:]):
        details = second["meta_info"]["cached_tokens_details"]
        assert first["meta_info"]["cached_tokens_details"]["host"] == 0
        assert details["host"] >= 96, details  # three of the first visit's four 32-token blocks at least
        assert details["device"] + details["host"] + details["disk"] == second["meta_info"]["cached_tokens"]
    for out in want[3:]:
        assert out["meta_info"]["cached_tokens"] == 0  # without tiers the pool forgot each conversation
    assert stats["hit_tokens"]["host"] >= 3 * 96 and stats["demoted_blocks"]["host"] > 0
    assert "host" in {n.get("tier") for n in picture["tree"]["nodes"]}  # the dashboard colours what came back
    assert picture["counters"]["kv_tiers"]["host"]["blocks"] > 0


@pytest.mark.parametrize("latent", [None, 12], ids=["per_head", "latent"])
def test_int8_copy_of_an_fp32_pool_is_a_quarter_of_its_bytes_and_reads_back_within_rounding(latent):
    heads = 1 if latent else 2
    pool = KVPool(80, 2, heads, 16, torch.float32, latent_dim=latent)
    codec = KVCodec(pool, "auto")
    assert codec.name == "int8" and codec.width * 3 < pool.token_bytes()
    slots = torch.arange(1, 33)
    for layer in range(2):
        pool.write(layer, slots, torch.randn(32, heads, 16), torch.randn(32, heads, 16))
    rows = codec.encode(slots)
    before = [t.clone() for t in pool.k + pool.v]
    target = torch.arange(33, 65)
    codec.decode(target, rows)
    for t, b in zip(pool.k + pool.v, before):
        err = (t[target] - b[slots]).abs().max() / b[slots].abs().max()
        assert err < 1 / 127


@pytest.mark.parametrize("bad, named", [
    ({"kv_host_cache_gb": -1}, "kv_host_cache_gb"),
    ({"kv_disk_cache_dir": "/tmp/x", "kv_disk_cache_gb": 0}, "kv_disk_cache_gb"),
    ({"kv_host_cache_gb": 1, "kv_tier_block_tokens": 0}, "kv_tier_block_tokens"),
    ({"kv_host_cache_gb": 1, "kv_tier_format": "fp4"}, "kv_tier_format"),
    ({"kv_host_cache_gb": 1, "tp_size": 2}, "tp_size"),
    ({"kv_host_cache_gb": 1, "disable_radix_cache": True}, "disable_radix_cache"),
    ({"kv_host_cache_gb": 1, "speculative_algorithm": "draft"}, "speculative_algorithm"),
])
def test_kv_tier_options_that_cannot_work_are_refused_by_name(bad, named):
    from radixlm.runtime.server_args import ServerArgs

    with pytest.raises(ValueError, match=named):
        ServerArgs(**bad).validate()


# ------------------------------------------------------------------ the disk tier
BLOCK_BYTES_INT8 = 32 * 144  # one 32-token block of the tiny Llama's int8 pool (2 layers, 2 KV heads of 16 + a 2-byte scale, K and V)
ONE_BLOCK_GB = 1.5 * BLOCK_BYTES_INT8 / (1 << 30)


def disk_engine(model: str, folder, **kw) -> radixlm.Engine:
    """An engine with a host tier of one block over a disk tier in ``folder`` (int8 pool: exact bytes)."""
    kw = {"kv_cache_dtype": "int8", "kv_host_cache_gb": ONE_BLOCK_GB, **kw}
    return tiered_engine(model, kv_disk_cache_dir=str(folder), **kw)


def block_files(folder) -> list:
    return sorted(folder.glob("*.kvb"))


def test_second_visits_hit_the_disk_under_a_one_block_host_tier(tiny_llama, tmp_path):
    prompts = conversations()
    with tiered_engine(tiny_llama, kv_cache_dtype="int8") as cold:
        want = alternate(cold, prompts)
    with disk_engine(tiny_llama, tmp_path) as eng:
        got = alternate(eng, prompts)
        stats = eng.get_stats()["kv_tiers"]
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert all(o["meta_info"]["cached_tokens_details"]["disk"] >= 64 for o in got[3:]), [o["meta_info"]["cached_tokens_details"] for o in got]
    assert stats["host"]["blocks"] <= 1 and stats["promoted_blocks"]["disk"] >= 6


def test_a_restarted_engine_finds_the_prefixes_its_predecessor_left_on_disk(tiny_llama, tmp_path):
    prompts = conversations(count=1, length=130)
    with disk_engine(tiny_llama, tmp_path) as first:  # nothing is evicted: the tree goes to disk at shutdown
        turn = first.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert len(block_files(tmp_path)) == 4
    follow_up = prompts[0] + turn["output_ids"] + [7, 8, 9]
    with tiered_engine(tiny_llama, kv_cache_dtype="int8") as cold:
        want = cold.generate(input_ids=follow_up, sampling_params=GREEDY)
    with disk_engine(tiny_llama, tmp_path) as second:
        got = second.generate(input_ids=follow_up, sampling_params=GREEDY)
    assert got["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "disk": 128}
    assert got["output_ids"] == want["output_ids"]


def _leave_four_blocks(model: str, folder) -> list[int]:
    prompt = conversations(count=1, length=130, seed=5)[0]
    with disk_engine(model, folder) as eng:
        eng.generate(input_ids=prompt, sampling_params=GREEDY)
    assert len(block_files(folder)) == 4
    return prompt


def _disk_hit(model: str, folder, prompt: list[int], **kw) -> tuple[int, int]:
    """Disk tokens a fresh engine's request for ``prompt`` loads, and the files it rejected."""
    with disk_engine(model, folder, **kw) as eng:
        hit = eng.generate(input_ids=prompt, sampling_params=GREEDY)["meta_info"]["cached_tokens_details"]["disk"]
        return hit, eng.get_stats()["kv_tiers"]["disk"]["rejected"]


def _file_of_block(folder, prompt: list[int], index: int):
    """The file holding block ``index`` of ``prompt`` (files carry their tokens in the header)."""
    for f in block_files(folder):
        if f"[{','.join(map(str, prompt[index * 32 : index * 32 + 32]))}]".encode() in f.read_bytes():
            return f
    raise AssertionError(f"no file holds block {index}")


def test_a_block_whose_checksum_fails_is_removed_and_never_loaded(tiny_llama, tmp_path):
    prompt = _leave_four_blocks(tiny_llama, tmp_path)
    bad = _file_of_block(tmp_path, prompt, 2)
    data = bytearray(bad.read_bytes())
    data[-5] ^= 0xFF
    bad.write_bytes(bytes(data))
    assert _disk_hit(tiny_llama, tmp_path, prompt) == (64, 1)  # blocks 0 and 1; block 2 fails, so 3 cannot follow
    assert bad.read_bytes() != bytes(data)  # removed, then written anew from the recomputed KV at shutdown


def test_a_truncated_block_is_removed_at_start_up(tiny_llama, tmp_path):
    prompt = _leave_four_blocks(tiny_llama, tmp_path)
    bad = _file_of_block(tmp_path, prompt, 0)
    bad.write_bytes(bad.read_bytes()[:-100])
    assert _disk_hit(tiny_llama, tmp_path, prompt) == (0, 1)


def test_blocks_of_another_model_are_removed_and_never_loaded(tiny_llama, tiny_model_dirs, tmp_path):
    prompt = _leave_four_blocks(tiny_model_dirs["qwen2"], tmp_path)
    old = set(block_files(tmp_path))
    assert _disk_hit(tiny_llama, tmp_path, prompt) == (0, 4)
    assert not old & set(block_files(tmp_path))


def test_blocks_of_another_kv_dtype_are_removed_and_never_loaded(tiny_llama, tmp_path):
    prompt = _leave_four_blocks(tiny_llama, tmp_path)
    old = set(block_files(tmp_path))
    assert _disk_hit(tiny_llama, tmp_path, prompt, kv_cache_dtype="fp8_e4m3") == (0, 4)
    assert not old & set(block_files(tmp_path))


@pytest.mark.parametrize("failure", [(errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only file system")], ids=["full", "read-only"])
def test_a_failing_disk_stops_the_tier_with_a_log_line_and_serving_goes_on(tiny_llama, tmp_path, monkeypatch, caplog, failure):
    from radixlm.radix_cache.tiers import disk

    def failing(self, block):  # root ignores permission bits, so the disk's own error is raised here
        raise OSError(*failure)

    monkeypatch.setattr(disk.DiskTier, "_write", failing)
    prompts = conversations()
    with disk_engine(tiny_llama, tmp_path, kv_host_cache_gb=0.01) as eng:
        outs = alternate(eng, prompts)
        stats = eng.get_stats()["kv_tiers"]
    assert failure[1] in (stats["disk"]["stopped"] or "")
    assert any("KV disk tier stopped" in r.getMessage() for r in caplog.records)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert all(o["meta_info"]["cached_tokens_details"]["host"] >= 96 for o in outs[3:])  # the host tier still serves
    assert block_files(tmp_path) == []


@pytest.mark.parametrize("where", ["load", "encode", "read"])
def test_a_tier_that_raises_costs_a_recompute_never_a_request(tiny_llama, tmp_path, monkeypatch, where):
    from radixlm.radix_cache.tiers import codec, disk, hierarchy

    def broken(*args, **kwargs):
        raise RuntimeError(f"injected: the tier's {where} failed")

    target = {"load": (hierarchy.KVTiers, "load"), "encode": (codec.KVCodec, "encode"), "read": (disk.DiskTier, "read")}[where]
    prompts = conversations()
    with disk_engine(tiny_llama, tmp_path / "cold") as cold:
        want = alternate(cold, prompts)
    monkeypatch.setattr(*target, broken)
    with disk_engine(tiny_llama, tmp_path / "kv") as eng:  # accounting is checked after every step (conftest)
        got = alternate(eng, prompts)
        eng.check_accounting()
        stats = eng.get_stats()["kv_tiers"]
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in got)
    assert stats["hit_tokens"] == {"host": 0, "disk": 0}  # nothing came back: every prefix was recomputed


def test_a_disk_folder_that_cannot_be_made_leaves_the_host_tier_serving(tiny_llama, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with disk_engine(tiny_llama, blocker / "kv", kv_host_cache_gb=0.01) as eng:
        outs = alternate(eng, conversations())
        assert eng.get_stats()["kv_tiers"]["disk"]["stopped"]
    assert all(o["meta_info"]["cached_tokens_details"]["host"] >= 96 for o in outs[3:])


def test_two_engines_sharing_one_folder_read_each_others_blocks(tiny_llama, tmp_path):
    import threading

    prompts = conversations(count=4, seed=9)
    with disk_engine(tiny_llama, tmp_path) as a, disk_engine(tiny_llama, tmp_path) as b:
        threads = [threading.Thread(target=alternate, args=(e, prompts, 1)) for e in (a, b)]  # both write the same blocks at once
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        a.generate(input_ids=conversations(count=1, seed=10, length=40)[0], sampling_params=GREEDY)  # evict the rest of a's tree
        follow_up = prompts[0] + [5] * 20
        got = a.generate(input_ids=follow_up, sampling_params=GREEDY)
        rejected = a.get_stats()["kv_tiers"]["disk"]["rejected"] + b.get_stats()["kv_tiers"]["disk"]["rejected"]
    assert got["meta_info"]["cached_tokens_details"]["disk"] + got["meta_info"]["cached_tokens_details"]["host"] >= 96
    assert rejected == 0
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_salted_prefix_in_a_tier_is_never_served_to_another_salt(tiny_llama):
    prompts = conversations()
    with tiered_engine(tiny_llama, kv_host_cache_gb=0.01, kv_cache_dtype="int8") as eng:
        for p in prompts:
            eng.generate(input_ids=p, sampling_params=GREEDY, cache_salt="tenant-a")
        other = eng.generate(input_ids=prompts[0], sampling_params=GREEDY, cache_salt="tenant-b")
        plain = eng.generate(input_ids=prompts[0], sampling_params=GREEDY)
        same = eng.generate(input_ids=prompts[0], sampling_params=GREEDY, cache_salt="tenant-a")
    assert other["meta_info"]["cached_tokens"] == 0 and plain["meta_info"]["cached_tokens"] == 0
    assert same["meta_info"]["cached_tokens_details"]["host"] >= 64


def test_a_slow_disk_read_never_holds_up_other_requests(tiny_llama, tmp_path, monkeypatch):
    import threading
    import time

    from radixlm.radix_cache.tiers import disk

    prompt = _leave_four_blocks(tiny_llama, tmp_path)
    released = threading.Event()
    real_read = disk.DiskTier.read

    def slow_read(self, key, tokens, salt):
        released.wait(timeout=60)
        return real_read(self, key, tokens, salt)

    monkeypatch.setattr(disk.DiskTier, "read", slow_read)
    with disk_engine(tiny_llama, tmp_path) as eng:
        waiting = eng.generate(input_ids=prompt, sampling_params=GREEDY, stream=True)
        first = threading.Thread(target=lambda: list(waiting))
        first.start()
        other = eng.generate(input_ids=[3, 4, 5, 6] * 8, sampling_params=GREEDY)  # admitted while the read hangs
        assert first.is_alive() and other["meta_info"]["finish_reason"]["type"] == "length"
        released.set()
        first.join(timeout=60)
        time.sleep(0)
    assert not first.is_alive()


def test_a_disk_folder_others_may_write_to_is_refused_and_files_are_private(tiny_llama, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with disk_engine(tiny_llama, shared) as eng:
        assert "not this user's alone" in eng.get_stats()["kv_tiers"]["disk"]["stopped"]
    own = tmp_path / "own"
    _leave_four_blocks(tiny_llama, own)
    assert own.stat().st_mode & 0o777 == 0o700
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in block_files(own))


def test_host_tier_evicts_least_recently_used_unhinted_blocks_first_and_spills_them():
    import time

    from radixlm.radix_cache.tiers.host import Block, HostTier

    spilled = []
    host = HostTier(3 * 100, spill=spilled.append)
    blocks = [Block(bytes([i]), (i,), torch.zeros(1, 100, dtype=torch.uint8)) for i in range(5)]
    host.put(blocks[0])
    host.put(blocks[1])
    host.touch(blocks[0].key, protect_until=time.monotonic() + 60)  # hinted, and the newest
    host.put(blocks[2])
    host.get(blocks[1].key)  # 1 is now more recent than 2
    host.put(blocks[3])
    host.put(blocks[4])
    assert [b.key for b in spilled] == [blocks[2].key, blocks[1].key]  # 0 kept though older: its hint
    host.check()
    host._used += 1  # what check_accounting (through KVTiers.check) must catch
    with pytest.raises(AssertionError, match="host tier counts"):
        host.check()


def test_disk_tier_removes_least_recently_used_unhinted_files_first(tmp_path):
    import time

    from radixlm.radix_cache.tiers.disk import DiskTier
    from radixlm.radix_cache.tiers.host import Block

    identity = {"model": "m", "format": "exact:int8", "page_size": 1, "block_tokens": 4, "width": 100}
    blocks = [Block(bytes([i]) * 16, (i, i, i, i), torch.full((4, 100), i, dtype=torch.uint8)) for i in range(4)]
    blocks[0].protect_until = time.monotonic() + 60
    probe = DiskTier(tmp_path / "probe", 1 << 20, identity)
    probe.put(blocks[0])
    assert probe.flush()
    size = probe.used
    disk = DiskTier(tmp_path / "kv", 3 * size, identity)
    for b in blocks:
        disk.put(b)
        assert disk.flush()
    disk.check()
    assert [disk.path(b.key).exists() for b in blocks] == [True, False, True, True]  # 1 went, not the hinted 0
    got = disk.read(blocks[2].key, blocks[2].tokens, 0)
    assert got is not None and torch.equal(got.rows, blocks[2].rows) and got.source == "disk"
    assert disk.read(blocks[3].key, (9, 9, 9, 9), 0) is None and not disk.path(blocks[3].key).exists()  # other tokens: removed
    assert disk.read(blocks[0].key, blocks[0].tokens, 7) is None and not disk.path(blocks[0].key).exists()  # another salt's: removed
    disk.close()
    probe.close()
