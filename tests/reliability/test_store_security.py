"""The rendezvous stores of tensor parallelism and of prefill/decode pairs, under hostile input.

What listens is read from /proc (every listening TCP socket of this process and its children);
a hostile writer is a plain TCPStore client of the bootstrap port, without the pair's secret.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing
import os
import socket
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers import wait_until
from radixlm.runtime.disaggregation import shared_secret
from radixlm.runtime.disaggregation.link import GENERATION_KEY, HELLO_KEY, KVLink
from radixlm.runtime.disaggregation.receiver import DecodeReceiver
from radixlm.runtime.disaggregation.records import BadRecord, KVLayout, Sent, parse_have
from radixlm.runtime.disaggregation.shared_secret import SECRET_ENV, SECRET_FILE_ENV, link_secret
from radixlm.runtime.distributed.group import TPGroup, join_store, open_store
from radixlm.runtime.distributed.store import (
    ForgedRecord,
    SignedStore,
    listening_store,
    read_secret_file,
    shared_secret_file,
)
from radixlm.runtime.engine import Engine

SECRET = b"s" * 32
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, kv_format="fp32", page_size=1, token_bytes=64, vocab_size=100)
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


# ------------------------------------------------------------------ what listens
def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))


def listening(pids: list[int] | None = None) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN held by ``pids`` (this process and its children)."""
    pids = pids or [os.getpid()] + [p.pid for p in multiprocessing.active_children()]
    inodes = set()
    for pid in pids:
        fds = f"/proc/{pid}/fd"
        for fd in os.listdir(fds):
            with contextlib.suppress(OSError):
                link = os.readlink(f"{fds}/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    addr, port = cols[1].split(":")
                    found.add((_address(addr), int(port, 16)))
    return found


def assert_loopback(sockets: set[tuple[str, int]]) -> None:
    assert sockets, "nothing listens: the probe sees nothing"
    beyond = [(a, p) for a, p in sockets if a not in ("127.0.0.1", "::1")]
    assert not beyond, f"listening beyond loopback: {beyond}"


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def intruder(link: KVLink) -> dist.TCPStore:
    """A client of ``link``'s store that does not know the secret."""
    return dist.TCPStore(link.host, link.port, 2, is_master=False, timeout=datetime.timedelta(seconds=10))


@pytest.fixture(autouse=True)
def _no_ambient_secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """No secret from the developer's environment; the default secret file goes to a fresh folder
    (only that file: the rest of the cache, compiled kernels included, stays where it is)."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setattr(shared_secret, "cache_dir", lambda: tmp_path / "cache")


# ------------------------------------------------------------------ the store itself
def test_listening_store_binds_only_the_address_asked_for():
    store = listening_store("127.0.0.1", 0, 2, 10)
    assert listening() & {("127.0.0.1", store.port)}
    assert not [s for s in listening() if s[1] == store.port and s[0] != "127.0.0.1"], "also on another address"
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_signed_store_refuses_forged_and_replayed_records_and_keeps_valid_ones():
    server = listening_store("127.0.0.1", 0, 2, 10)
    ours = SignedStore(server, SECRET)
    raw = dist.TCPStore("127.0.0.1", server.port, 2, is_master=False, timeout=datetime.timedelta(seconds=10))
    ours.set("pd/a/1/seq/0", b'{"room": 1}')
    assert ours.get("pd/a/1/seq/0") == b'{"room": 1}' and ours.lookup("pd/a/1/seq/0") == b'{"room": 1}'
    assert ours.lookup("pd/a/1/seq/9") is None  # absent: no wait
    raw.set("pd/a/1/seq/1", b'{"room": 2}')  # forged: no tag
    with pytest.raises(ForgedRecord, match="seq/1"):
        ours.lookup("pd/a/1/seq/1")
    raw.set("pd/a/2/seq/0", raw.get("pd/a/1/seq/0"))  # replayed under another generation's key
    with pytest.raises(ForgedRecord):
        ours.get("pd/a/2/seq/0")
    with pytest.raises(ForgedRecord):  # a peer with another secret
        SignedStore(raw, b"t" * 32).get("pd/a/1/seq/0")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        SignedStore(raw, b"short")


def test_secret_files_must_be_private_and_long_enough(tmp_path: Path):
    path = tmp_path / "secret"
    path.write_text("x" * 40)
    path.chmod(0o644)
    with pytest.raises(ValueError, match="open to other users.*600"):
        read_secret_file(path, "disaggregation_secret_file")
    path.chmod(0o600)
    assert read_secret_file(path, "disaggregation_secret_file") == b"x" * 40
    path.write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        read_secret_file(path, "disaggregation_secret_file")
    with pytest.raises(ValueError, match="disaggregation_secret_file.*cannot open"):
        read_secret_file(tmp_path / "missing", "disaggregation_secret_file")


def test_default_pd_secret_is_created_private_and_read_back_alike(tmp_path: Path):
    first = link_secret("127.0.0.1:31000")
    again = link_secret("localhost:31000")  # the decode side, started later
    assert first == again and len(first) >= 32
    (file,) = (tmp_path / "cache").glob("pd-secret")
    assert stat.S_IMODE(file.stat().st_mode) == 0o600
    assert not list((tmp_path / "cache").glob(".pd-secret.*")), "the temporary file is left behind"
    path = tmp_path / "shared"
    assert shared_secret_file(path, "x") == shared_secret_file(path, "x")


def test_pd_bootstrap_beyond_loopback_needs_a_secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    with pytest.raises(ValueError, match=f"192.0.2.7 is not a loopback address.*{SECRET_ENV}.*disaggregation-secret-file"):
        link_secret("192.0.2.7:31000")
    monkeypatch.setenv(SECRET_ENV, "a-secret-of-enough-length")
    assert link_secret("192.0.2.7:31000") == b"a-secret-of-enough-length"
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match=SECRET_ENV):
        link_secret("192.0.2.7:31000")
    monkeypatch.delenv(SECRET_ENV)
    file = tmp_path / "kv.secret"
    file.write_text("f" * 32)
    file.chmod(0o640)
    with pytest.raises(ValueError, match="open to other users"):
        link_secret("192.0.2.7:31000", str(file))
    file.chmod(0o600)
    assert link_secret("192.0.2.7:31000", str(file)) == b"f" * 32
    monkeypatch.setenv(SECRET_FILE_ENV, str(file))
    assert link_secret("192.0.2.7:31000") == b"f" * 32


# ------------------------------------------------------------------ tensor parallelism
def test_tp_rendezvous_refuses_a_peer_without_the_secret():
    store = open_store(2, 10)
    stranger = join_store(store.port, 2, 10, b"w" * 32)  # right port, wrong secret
    errors: list[BaseException] = []

    def join(rank: int, client: SignedStore) -> None:
        try:
            TPGroup(client, rank, 2, torch.device("cpu"), 10).close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(0, store)), threading.Thread(target=join, args=(1, stranger))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(errors) == 2 and all("valid tag" in str(e) for e in errors), errors


def test_tp_engine_listens_only_on_loopback_and_keeps_its_secret_off_the_command_line(tiny_llama: str):
    before = listening()
    engine = Engine(model_path=tiny_llama, tp_size=2, max_total_tokens=512)
    try:
        assert engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["output_ids"]
        driver = engine.runner.driver
        workers = [p.pid for p in driver.workers]
        opened = listening([os.getpid(), *workers]) - before
        assert ("127.0.0.1", driver.store.port) in opened
        assert_loopback(opened)
        secret = driver.store.secret
        for pid in workers:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert secret not in cmdline and secret.hex().encode() not in cmdline
    finally:
        engine.shutdown()


# ------------------------------------------------------------------ a prefill/decode link
@contextlib.contextmanager
def link_pair(decode_secret: bytes = SECRET, max_tokens: int = 64, host: str = "127.0.0.1"):
    """A prefill KVLink driven by the test and a DecodeReceiver whose callbacks are recorded."""
    with socket.socket() as s:
        s.bind((host, 0))
        boot = f"{host}:{s.getsockname()[1]}"
    prefill = KVLink("prefill", boot, LAYOUT, 10, SECRET, max_tokens)
    receiver = DecodeReceiver(KVLink("decode", boot, LAYOUT, 10, decode_secret, max_tokens))
    got: dict[str, list] = {"kv": [], "failed": []}
    receiver.post = lambda fn: fn()
    receiver.on_kv = lambda room, start, end, data, states, s: got["kv"].append((room, start, end, data))
    receiver.on_failed = lambda room, msg, status: got["failed"].append((room, msg, status))
    try:
        yield prefill, receiver, got
    finally:
        receiver.close()
        prefill.close()


def connect(prefill: KVLink, receiver: DecodeReceiver) -> None:
    wait_until(prefill.connect, 60, "the decode side to join")
    wait_until(lambda: receiver.link.up, 60, "the decode side's end of the link")


def kv(rows: int, fill: int) -> torch.Tensor:
    return torch.full((rows, LAYOUT.token_bytes), fill, dtype=torch.uint8)


def test_pd_forged_replayed_and_oversized_records_are_refused_and_pending_hand_overs_complete():
    with link_pair() as (prefill, receiver, got):
        connect(prefill, receiver)
        gen = prefill.generation
        receiver.expect(1, 0, 4, 5, "digest-1")
        receiver.expect(2, 0, 3, 4, "digest-2")
        bad = intruder(prefill)
        # the old attack: bump the generation counter; and a forged hello of a newer decode worker
        for _ in range(3):
            bad.add(GENERATION_KEY, 1)
        bad.set(HELLO_KEY, json.dumps({"session": prefill.session, "generation": 99}))
        assert not prefill.newer_peer() and prefill.generation == gen and prefill.up
        # forged, oversized: it would size a terabyte allocation if it were believed
        bad.set(prefill.prefix + "seq/0", json.dumps({"room": 1, "start": 0, "end": 10**12, "token_bytes": 10**6}))
        wait_until(lambda: prefill.stats.refused + receiver.stats.refused >= 2, 60, "the forged records to be refused")
        # replayed: a valid record of the decode side, copied under the key the decode side reads next
        bad.set(prefill.prefix + "seq/0", bad.get(prefill.prefix + "room/1/have"))
        wait_until(lambda: receiver.stats.refused >= 2, 60, "the replayed record to be refused")
        assert got == {"kv": [], "failed": []}, "a refused record failed a pending request"
        # the real records come after all that, and both hand-overs complete
        for tag, (room, rows) in enumerate([(1, 4), (2, 3)]):
            prefill.set(f"seq/{tag}", {"room": room, "start": 0, "end": rows, "token_bytes": LAYOUT.token_bytes})
            prefill.send(kv(rows, room), tag)
        wait_until(lambda: len(got["kv"]) == 2, 60, "both hand-overs")
        assert [(r, s, e, bool((d == r).all())) for r, s, e, d in got["kv"]] == [(1, 0, 4, True), (2, 0, 3, True)]
        assert got["failed"] == [] and prefill.generation == gen


def test_pd_signed_records_out_of_bounds_fail_only_their_request_and_allocate_nothing(monkeypatch: pytest.MonkeyPatch):
    with link_pair(max_tokens=64) as (prefill, receiver, got):
        connect(prefill, receiver)
        shapes: list[tuple[int, int]] = []
        real_recv = receiver.link.recv
        monkeypatch.setattr(receiver.link, "recv", lambda shape, tag: shapes.append(shape) or real_recv(shape, tag))
        for room, n in ((1, 5), (2, 4), (3, 4), (4, 6)):
            receiver.expect(room, 0, n - 1, n, f"digest-{room}")
        prefill.set("seq/0", {"room": 1, "start": 0, "end": 10**9, "token_bytes": LAYOUT.token_bytes})  # beyond the pool
        prefill.set("seq/1", {"room": 2, "start": 0, "end": 3, "token_bytes": 10**9})  # not the layout's row size
        prefill.set("seq/2", {"room": "3", "start": 0, "end": 3})  # not even a room number
        prefill.set("seq/3", {"room": 4, "start": 0, "end": 5, "token_bytes": LAYOUT.token_bytes})
        prefill.send(kv(5, 4), 3)
        wait_until(lambda: got["kv"], 60, "the in-bounds hand-over")
        assert [r for r, *_ in got["kv"]] == [4] and shapes == [(5, LAYOUT.token_bytes)], "something out of bounds was allocated"
        failed = {room: (msg, status) for room, msg, status in got["failed"]}
        assert set(failed) == {1, 2}, got["failed"]  # room 3 stays pending: its record named no room
        assert "'end' must be an integer in [0, 64]" in failed[1][0] and failed[1][1] == 502
        assert "'token_bytes'" in failed[2][0]
        assert receiver.link.up and receiver.stats.refused == 3


def test_pd_link_on_another_address_listens_there_only_and_hands_over():
    # 127.0.0.2: an address of its own that is not 127.0.0.1, with no traffic beyond this machine
    host = "127.0.0.2"
    before = listening()
    with link_pair(host=host) as (prefill, receiver, got):
        connect(prefill, receiver)
        opened = listening() - before
        assert (host, prefill.port) in opened and len(opened) >= 3, opened  # the store and both gloo ends
        assert {a for a, _ in opened} == {host}, f"listening beyond {host}: {opened}"
        receiver.expect(1, 0, 2, 3, "digest-1")
        prefill.set("seq/0", {"room": 1, "start": 0, "end": 2, "token_bytes": LAYOUT.token_bytes})
        prefill.send(kv(2, 9), 0)
        wait_until(lambda: got["kv"], 60, "the hand-over")
        assert got["failed"] == [] and bool((got["kv"][0][3] == 9).all())


def test_pd_a_hybrid_models_state_size_is_checked_before_anything_is_received():
    """A hybrid model's KV record also sizes the states that follow the KV: only the layout's
    exact size is believed (a signed record with another fails its own request alone)."""
    hybrid = KVLayout(**{**vars(LAYOUT), "state_bytes": 4096, "state_format": "conv torch.float32 (2, 8, 3), state torch.float32 (2, 1, 8, 8)"})
    record = {"room": 1, "start": 0, "end": 3, "token_bytes": LAYOUT.token_bytes, "state_bytes": 4096}
    assert Sent.parse(record, hybrid, 64).state_bytes == 4096
    for bad in (10**12, 0, None):
        with pytest.raises(BadRecord, match="'state_bytes' must be an integer in \\[4096, 4096\\]"):
            Sent.parse({**record, "state_bytes": bad}, hybrid, 64)
    assert Sent.parse(record, LAYOUT, 64).state_bytes == 0  # a layout without states reads none


def test_pd_have_records_are_checked_before_use():
    good = {"start": 2, "end": 4, "n": 5, "digest": "d", "skip": False}
    assert parse_have(good) == good
    for field, value, match in [("start", -1, "'start'"), ("end", 9, "'end'"), ("n", "5", "'n'"), ("skip", "no", "'skip'"), ("digest", 3, "'digest'")]:
        with pytest.raises(BadRecord, match=match):
            parse_have({**good, field: value})


def test_pd_decode_worker_with_another_secret_is_refused_with_the_reason_named():
    with link_pair(decode_secret=b"d" * 32) as (prefill, receiver, got):
        wait_until(lambda: receiver.link.error and "another secret" in receiver.link.error, 60, "the decode side to refuse the store")
        assert SECRET_ENV in receiver.link.error and not prefill.connect() and not prefill.up


# ------------------------------------------------------------------ a prefill/decode pair of engines
def test_pd_pair_listens_only_on_loopback_and_a_forged_record_fails_nothing(tiny_llama: str):
    before = listening()
    boot = free_address()
    common = dict(model_path=tiny_llama, max_total_tokens=512, disaggregation_bootstrap=boot, disaggregation_timeout=60)
    prefill = Engine(disaggregation_mode="prefill", **common)
    decode = Engine(disaggregation_mode="decode", **common)
    try:
        opened = listening() - before
        assert ("127.0.0.1", int(boot.rsplit(":", 1)[1])) in opened
        assert_loopback(opened)
        link = prefill.pd.side.link
        ids = list(range(10, 40))
        with ThreadPoolExecutor(1) as pool:
            d = pool.submit(decode.generate, input_ids=ids, sampling_params=GREEDY, bootstrap_room=7)
            wait_until(lambda: decode.get_stats()["pd_receiving"] == 1, 60, "the decode half to wait")
            bad = intruder(link)
            bad.add(GENERATION_KEY, 1)
            bad.set(link.prefix + "seq/0", json.dumps({"room": 7, "start": 0, "end": 29, "token_bytes": 8}))
            wait_until(lambda: decode.get_stats()["pd_refused_records"] >= 1, 60, "the forged record to be refused")
            p_out = prefill.generate(input_ids=ids, sampling_params=GREEDY, bootstrap_room=7)
            d_out = d.result(timeout=120)
        assert p_out["meta_info"]["finish_reason"]["type"] == "length", p_out["meta_info"]
        assert d_out["meta_info"]["finish_reason"]["type"] == "length", d_out["meta_info"]
        assert d_out["meta_info"]["pd"]["received_tokens"] == len(ids) - 1
        assert prefill.get_stats()["pd_link_up"] and decode.get_stats()["pd_transfer_failures"] == 0
    finally:
        decode.shutdown()
        prefill.shutdown()
