"""The KV link between a prefill instance and a decode instance (prefill/decode disaggregation).

Control goes through a ``TCPStore`` that the prefill instance hosts on its bootstrap address;
KV goes over a two-rank gloo process group (prefill = rank 0, decode = rank 1) with
point-to-point ``send``/``recv``. One request's hand-over, keyed by its ``bootstrap_room``::

    decode (rank 1)                         store                         prefill (rank 0)
    admit: match own tree (m cached),
    reserve slots for [m, n-1)  ---- room/R/have {start m, end n-1, n, digest} ---->
                                                                     prompt computed: gather
                                                                     the KV of [m, n-1)
        <---------- seq/k {room R, start, end, token_bytes | error} ----------
        <========== gloo send/recv, tag k: uint8 [n-1-m, token_bytes] ==========
    scatter into the reserved slots, insert into the radix tree, decode from position n-1

Records are numbered (``seq/k``) by the prefill side and consumed in that order, so both sides
post their send and receive in the same order and no pair of transfers can deadlock. Only the
pages the decode side does not hold travel; the decode side computes the last prompt token
itself, which gives it the logits of the first output token. Each (re)connection of a decode
instance is a new *generation* (a fresh key prefix and process group), so either side may restart.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from radixlm.runtime.server_args import parse_bootstrap

logger = logging.getLogger(__name__)

POLL_S = 0.002  # how often pending hand-overs look at the store
IDLE_S = 0.2  # how often an idle link checks for a (re)connecting peer
GENERATION_KEY = "pd/generation"
MAX_REMEMBERED_FAILURES = 1024
CONNECT_TRY_S = 1.0  # one try of the decode side to reach the prefill side's store


def prompt_digest(input_ids: list[int]) -> str:
    """A short digest of a prompt's token ids (both sides must have tokenized it alike)."""
    return hashlib.blake2b(torch.tensor(input_ids, dtype=torch.int64).numpy().tobytes(), digest_size=12).hexdigest()


@dataclass(frozen=True)
class KVLayout:
    """What must match between the two pools for their slots to be interchangeable."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_format: str
    page_size: int
    token_bytes: int
    vocab_size: int

    def differences(self, other: dict[str, Any]) -> list[str]:
        """``name: ours vs theirs`` for every field that differs."""
        return [f"{k}: {v} here vs {other.get(k)} there" for k, v in vars(self).items() if other.get(k) != v]


@dataclass
class TransferStats:
    """Counters of one side's hand-overs (``pd_*`` in the engine's stats)."""

    transfers: int = 0
    failures: int = 0
    tokens: int = 0  # KV tokens sent or received
    skipped_tokens: int = 0  # prompt tokens the decode side already held (never sent)
    bytes: int = 0
    seconds: float = 0.0  # in send/recv

    def as_dict(self, role: str) -> dict[str, Any]:
        """The ``pd_`` entries of the engine's stats."""
        return {
            "pd_role": role,
            "pd_transfers": self.transfers,
            "pd_transfer_failures": self.failures,
            "pd_transfer_tokens": self.tokens,
            "pd_skipped_tokens": self.skipped_tokens,
            "pd_transfer_bytes": self.bytes,
            "pd_transfer_seconds": round(self.seconds, 6),
        }


class LinkDown(RuntimeError):
    """The peer is not connected (or went away)."""


class KVLink:
    """The store and the process group of one prefill/decode pair, (re)connected by a thread."""

    def __init__(self, role: str, bootstrap: str, layout: KVLayout, timeout_s: float) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"disaggregation_mode must be prefill or decode, got {role!r}")
        self.role, self.layout, self.timeout_s = role, layout, timeout_s
        self.host, self.port = parse_bootstrap(bootstrap)
        self.rank = 0 if role == "prefill" else 1
        self._lock = threading.Lock()  # one store client, used by the loop thread and the link thread
        self._store: dist.TCPStore | None = None
        self.prefix = ""
        self.generation = 0
        self.pg: Any = None
        self.error: str | None = None  # why the link is down, when it is
        self.closed = False
        self.connected = threading.Event()  # set once the first peer has joined
        if role == "prefill":  # bind now: a taken port fails start-up, not the first request
            self._store = dist.TCPStore(self.host, self.port, 2, is_master=True, timeout=self._td(), wait_for_workers=False)

    def _td(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    @property
    def up(self) -> bool:
        """True while a peer is connected."""
        return self.pg is not None

    # ------------------------------------------------------------ store ops
    def set(self, key: str, value: dict[str, Any]) -> None:
        """Write one control record of the current generation."""
        with self._lock:
            self._require().set(self.prefix + key, json.dumps(value))

    def take(self, key: str, keep: bool = False) -> dict[str, Any] | None:
        """Read (and unless ``keep``, delete) a record of the current generation; None when absent."""
        with self._lock:
            store = self._require()
            if not store.check([self.prefix + key]):
                return None
            value = json.loads(store.get(self.prefix + key))
            if not keep:
                store.delete_key(self.prefix + key)
            return value

    def delete(self, key: str) -> None:
        """Remove a record of the current generation, if the link is up and it is there."""
        with self._lock:
            if self._store is not None and self.pg is not None:
                self._store.delete_key(self.prefix + key)

    def _require(self) -> dist.TCPStore:
        if self._store is None or self.pg is None:
            raise LinkDown(self.error or f"the {self._peer} worker is not connected")
        return self._store

    @property
    def _peer(self) -> str:
        return "decode" if self.role == "prefill" else "prefill"

    # ---------------------------------------------------------- connecting
    def connect(self) -> bool:
        """Try once to join the peer (blocking up to the timeout); True when connected."""
        try:
            if self.role == "prefill":
                return self._accept()
            return self._join()
        except LinkDown:  # reached, but refused (the reason is set)
            return False
        except Exception as exc:
            self._drop(f"the {self._peer} worker at {self.host}:{self.port} is not reachable: {exc}")
            return False

    def _accept(self) -> bool:
        store = self._store
        gen = store.add(GENERATION_KEY, 0)
        if gen <= self.generation:
            return False
        self._start_generation(store, gen)
        return True

    def _join(self) -> bool:
        # a short connect timeout per try: the link thread retries, and a closing engine need not wait
        store = dist.TCPStore(self.host, self.port, 2, is_master=False, timeout=datetime.timedelta(seconds=min(self.timeout_s, CONNECT_TRY_S)))
        gen = store.add(GENERATION_KEY, 1)
        self._start_generation(store, gen)
        return True

    def _start_generation(self, store: dist.TCPStore, gen: int) -> None:
        prefix = f"pd/{gen}/"
        store.set(prefix + f"meta/{self.role}", json.dumps(vars(self.layout)))
        store.wait([prefix + f"meta/{self._peer}"], self._td())
        theirs = json.loads(store.get(prefix + f"meta/{self._peer}"))
        diff = self.layout.differences(theirs)
        if diff:
            self._drop(f"the prefill and decode workers' KV layouts differ ({'; '.join(diff)})")
            raise LinkDown(self.error)
        opts = dist.ProcessGroupGloo._Options()
        loopback = self.host in ("127.0.0.1", "localhost", "::1")
        # the prefill side listens on the bootstrap host; a remote decode side uses its default interface
        local = loopback or self.role == "prefill"
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host) if local else dist.ProcessGroupGloo.create_default_device()]
        opts._timeout = self._td()
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix + "pg/", store), self.rank, 2, opts)
        with self._lock:
            self._store, self.prefix, self.generation, self.pg, self.error = store, prefix, gen, pg, None
        self.connected.set()
        logger.info("KV link up with the %s worker (%s:%d, generation %d)", self._peer, self.host, self.port, gen)

    def newer_peer(self) -> bool:
        """True when a decode worker has joined after the connected one (prefill side)."""
        with self._lock:
            return self.role == "prefill" and self._store is not None and self._store.add(GENERATION_KEY, 0) > self.generation

    def _drop(self, reason: str) -> None:
        pg, self.pg, self.error = self.pg, None, reason
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:
                pass

    def drop(self, reason: str) -> None:
        """Mark the link down (the peer is gone); it reconnects when the peer comes back."""
        logger.warning("KV link down: %s", reason)
        with self._lock:
            self._drop(reason)

    # ---------------------------------------------------------------- KV
    def send(self, data: torch.Tensor, tag: int) -> None:
        """Send ``data`` to the decode side (blocks until it is received)."""
        self.pg.send([data.contiguous()], 1, tag).wait()

    def recv(self, shape: tuple[int, int], tag: int) -> torch.Tensor:
        """Receive a uint8 tensor of ``shape`` from the prefill side."""
        buf = torch.empty(shape, dtype=torch.uint8)
        self.pg.recv([buf], 0, tag).wait()
        return buf

    def close(self) -> None:
        """Release the connections."""
        self.closed = True
        with self._lock:
            self._drop("the link is closed")
            self._store = None


# ----------------------------------------------------------------- prefill
@dataclass
class SendJob:
    """A computed prompt waiting for its decode side's request (prefill side)."""

    room: int
    rid: str
    n: int
    digest: str
    start: int  # position of data's first row
    data: torch.Tensor  # uint8 [end - start, token_bytes] for positions [start, n - 1)
    deliver: Callable[[str | None, int, dict[str, Any]], None] = lambda *_: None  # (error or None, status, pd info)
    created: float = field(default_factory=time.monotonic)
    cancelled: str | None = None


class PrefillSender:
    """Prefill side: hands computed prompts' KV to the decode worker, in the order it asks."""

    role = "prefill"

    def __init__(self, link: KVLink) -> None:
        self.link = link
        self.stats = TransferStats()
        self._jobs: queue.SimpleQueue[SendJob] = queue.SimpleQueue()
        self._pending: list[SendJob] = []  # the link thread's
        self._active: set[str] = set()  # rids of queued hand-overs
        self._cancel: dict[str, str] = {}  # rid -> reason, for jobs the link thread has
        self._cancel_lock = threading.Lock()
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="radixlm-kv-send", daemon=True)
        self._thread.start()

    def wanted_start(self, room: int) -> int:
        """Where the decode side's missing KV begins, if it has said so already; else 0."""
        try:
            have = self.link.take(f"room/{room}/have", keep=True)
        except LinkDown:
            return 0
        return int(have["start"]) if have is not None and not have.get("skip") else 0

    def submit(self, job: SendJob) -> None:
        """Queue a computed prompt's KV; ``job.deliver`` is called once it is sent or failed."""
        with self._cancel_lock:
            self._active.add(job.rid)
        self._jobs.put(job)

    def cancel(self, rid: str, reason: str) -> bool:
        """Give up a queued hand-over (its request was aborted); False when there is none."""
        with self._cancel_lock:
            if rid not in self._active:
                return False
            self._cancel[rid] = reason
            return True

    def fail_room(self, room: int, reason: str) -> None:
        """Tell the decode side that room's prompt will not come (an error before it was computed)."""
        self._jobs.put(SendJob(room, "", 0, "", 0, torch.empty(0, 0, dtype=torch.uint8), cancelled=reason))

    def close(self) -> None:
        """Stop the link thread and fail what is still queued."""
        self.link.close()
        self._thread.join(timeout=5)

    # ---------------------------------------------------------------- thread
    def _run(self) -> None:
        checked = time.monotonic()  # when the store was last asked for a newer decode worker
        while not self.link.closed:
            try:
                if not self.link.up:
                    if not self.link.connect():
                        self._expire(time.monotonic())
                        self._take_new(IDLE_S)
                        continue
                    self._seq = 0
                self._take_new(POLL_S if self._pending else IDLE_S)
                self._progress()
                if time.monotonic() - checked > IDLE_S:
                    checked = time.monotonic()
                    if self.link.newer_peer():
                        raise LinkDown("a new decode worker connected")
            except Exception as exc:
                if self.link.closed:
                    break
                self.link.drop(f"the decode worker is gone ({exc})")
                for job in self._pending:
                    self._finish(job, f"the KV transfer failed: {self.link.error}", 503)
                self._pending = []
        for job in self._pending:
            self._finish(job, "the engine is shutting down", 503)

    def _take_new(self, wait_s: float) -> None:
        try:
            self._pending.append(self._jobs.get(timeout=wait_s))
            while True:
                self._pending.append(self._jobs.get_nowait())
        except queue.Empty:
            pass

    def _expire(self, now: float) -> None:
        for job in list(self._pending):
            if job.cancelled is not None or now - job.created > self.link.timeout_s:
                self._pending.remove(job)
                self._finish(job, job.cancelled or f"the decode worker is not connected ({self.link.error})", 503)

    def _progress(self) -> None:
        with self._cancel_lock:
            cancels, self._cancel = self._cancel, {}
        now = time.monotonic()
        for job in list(self._pending):
            if job.rid in cancels:
                job.cancelled = cancels[job.rid]
            if job.cancelled is not None:
                self._record(job.room, error=job.cancelled)
                self._done(job, job.cancelled, 499)
                continue
            have = self.link.take(f"room/{job.room}/have")
            if have is None:
                if now - job.created > self.link.timeout_s:
                    self._record(job.room, error="the prefill side gave up waiting for the decode side")
                    self._done(job, f"the decode worker did not ask for this prompt's KV within {self.link.timeout_s:g} s", 504)
                continue
            self._hand_over(job, have)

    def _hand_over(self, job: SendJob, have: dict[str, Any]) -> None:
        start, end = int(have["start"]), int(have["end"])
        if have.get("n") != job.n or have.get("digest") != job.digest:
            msg = "the prefill and decode workers tokenized this prompt differently"
            self._record(job.room, error=msg)
            self._done(job, msg, 500)
            return
        if have.get("skip") or start >= end:
            self._record(job.room, start=end, end=end)
            self.stats.skipped_tokens += max(end - start, 0)
            self._done(job, None, 0, {"sent_tokens": 0, "sent_bytes": 0})
            return
        if start < job.start or end > job.start + len(job.data):
            msg = f"the decode side asked for positions [{start}, {end}), not all computed here"
            self._record(job.room, error=msg)
            self._done(job, msg, 500)
            return
        data = job.data[start - job.start : end - job.start]
        tag = self._record(job.room, start=start, end=end, token_bytes=data.shape[1])
        t0 = time.perf_counter()
        self.link.send(data, tag)
        seconds = time.perf_counter() - t0
        self.stats.transfers += 1
        self.stats.tokens += end - start
        self.stats.skipped_tokens += start
        self.stats.bytes += data.numel()
        self.stats.seconds += seconds
        self._done(job, None, 0, {"sent_tokens": end - start, "sent_bytes": data.numel(), "transfer_s": round(seconds, 6)})

    def _record(self, room: int, **fields: Any) -> int:
        tag = self._seq
        self.link.set(f"seq/{tag}", {"room": room, **fields})
        self._seq += 1
        return tag

    def _done(self, job: SendJob, error: str | None, status: int, info: dict[str, Any] | None = None) -> None:
        self._pending.remove(job)
        self._finish(job, error, status, info or {})

    def _finish(self, job: SendJob, error: str | None, status: int, info: dict[str, Any] | None = None) -> None:
        with self._cancel_lock:
            self._active.discard(job.rid)
            self._cancel.pop(job.rid, None)
        if error is not None and job.rid:
            self.stats.failures += 1
        try:
            job.deliver(error, status, info or {})
        except Exception:
            logger.exception("delivering the hand-over result of request %s failed", job.rid)


# ------------------------------------------------------------------ decode
@dataclass
class Expected:
    """A decode-side request waiting for its prompt's KV."""

    room: int
    start: int
    end: int
    deadline: float


class DecodeReceiver:
    """Decode side: asks for the KV its requests lack and hands what arrives to the engine loop.

    ``post(fn)`` runs ``fn`` on the engine loop thread; ``on_kv(room, start, end, data, s)``
    and ``on_failed(room, message, status)`` are the scheduler's, called there.
    """

    role = "decode"

    def __init__(self, link: KVLink) -> None:
        self.link = link
        self.stats = TransferStats()
        self.post: Callable[[Callable[[], None]], None] = lambda fn: None
        self.on_kv: Callable[[int, int, int, torch.Tensor, float], None] = lambda *a: None
        self.on_failed: Callable[[int, str, int], None] = lambda *a: None
        self._expected: dict[int, Expected] = {}
        self._failed: dict[int, str] = {}  # rooms the prefill side failed before they were expected (bounded)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="radixlm-kv-recv", daemon=True)
        self._thread.start()

    def expect(self, room: int, start: int, end: int, n: int, digest: str, skip: bool = False) -> None:
        """Ask the prefill side for positions ``[start, end)`` of room's prompt (raises LinkDown).

        ``skip``: this request computes its prompt itself; the prefill side only confirms."""
        self.link.set(f"room/{room}/have", {"start": start, "end": end, "n": n, "digest": digest, "skip": skip})
        if skip:
            return
        with self._lock:
            failed = self._failed.pop(room, None)
            if failed is None:
                self._expected[room] = Expected(room, start, end, time.monotonic() + self.link.timeout_s)
        if failed is not None:
            self._post_failure(room, f"the prefill worker failed this request: {failed}", 502)
        self._wake.set()

    def forget(self, room: int) -> None:
        """Stop waiting for a room (its request ended); KV that still comes is dropped."""
        with self._lock:
            self._expected.pop(room, None)
        try:  # a prefill half that comes later then waits for a request that is gone, and times out
            self.link.delete(f"room/{room}/have")
        except Exception:
            pass

    def close(self) -> None:
        """Stop the link thread."""
        self.link.close()
        self._wake.set()
        self._thread.join(timeout=5)

    # ---------------------------------------------------------------- thread
    def _run(self) -> None:
        while not self.link.closed:
            try:
                if not self.link.up:
                    if not self.link.connect():
                        self._fail_all(f"the KV link is down: {self.link.error}", 503)
                        self._wake.wait(1.0)
                        self._wake.clear()
                        continue
                    self._seq = 0
                if not self._receive_one():
                    self._expire()
                    with self._lock:
                        idle = not self._expected
                    self._wake.wait(IDLE_S if idle else POLL_S)
                    self._wake.clear()
            except Exception as exc:
                if self.link.closed:
                    break
                self.link.drop(f"the prefill worker is gone ({exc})")
                self._fail_all(f"the KV transfer failed: {self.link.error}", 503)

    def _receive_one(self) -> bool:
        rec = self.link.take(f"seq/{self._seq}")
        if rec is None:
            return False
        tag, self._seq = self._seq, self._seq + 1
        room = int(rec["room"])
        with self._lock:
            expected = self._expected.pop(room, None)
            if rec.get("error") and expected is None:  # its request may not have been admitted yet
                self._failed[room] = rec["error"]
                while len(self._failed) > MAX_REMEMBERED_FAILURES:
                    self._failed.pop(next(iter(self._failed)))
        if rec.get("error"):
            if expected is not None:
                self.stats.failures += 1
                self._post_failure(room, f"the prefill worker failed this request: {rec['error']}", 502)
            return True
        start, end = int(rec["start"]), int(rec["end"])
        t0 = time.perf_counter()
        if end > start:  # always received, even for an ended request: the stream stays in step
            data = self.link.recv((end - start, int(rec["token_bytes"])), tag)
        else:  # the decode side held the whole prompt already
            data = torch.empty((0, self.link.layout.token_bytes), dtype=torch.uint8)
        seconds = time.perf_counter() - t0
        if expected is None:
            return True  # its request ended meanwhile
        self.stats.transfers += 1
        self.stats.tokens += end - start
        self.stats.skipped_tokens += start
        self.stats.bytes += data.numel()
        self.stats.seconds += seconds
        self.post(lambda: self.on_kv(room, start, end, data, seconds))
        return True

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [e for e in self._expected.values() if e.deadline < now]
            for e in late:
                del self._expected[e.room]
        for e in late:
            self.stats.failures += 1
            self._post_failure(e.room, f"the prompt's KV did not arrive from the prefill worker within {self.link.timeout_s:g} s", 504)

    def _fail_all(self, message: str, status: int) -> None:
        with self._lock:
            rooms, self._expected = list(self._expected), {}
        for room in rooms:
            self.stats.failures += 1
            self._post_failure(room, message, status)

    def _post_failure(self, room: int, message: str, status: int) -> None:
        self.post(lambda: self.on_failed(room, message, status))
