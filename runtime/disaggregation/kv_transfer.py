"""The KV link between a prefill instance and a decode instance (prefill/decode disaggregation).

Control goes through a ``TCPStore`` that the prefill instance hosts on its bootstrap address
(bound there only), every record signed with a secret both sides share (``link_secret``);
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
Records from the peer are checked before they are used: every size is bounded by the prompt and
the layout before anything is allocated.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from radixlm.kernels.paths import cache_dir
from radixlm.runtime.distributed.store import (
    ForgedRecord,
    SignedStore,
    listening_store,
    read_secret_file,
    shared_secret_file,
)
from radixlm.runtime.server_args import parse_bootstrap

logger = logging.getLogger(__name__)

POLL_S = 0.002  # how often pending hand-overs look at the store
IDLE_S = 0.2  # how often an idle link checks for a (re)connecting peer
GENERATION_KEY = "pd/generation"  # an unsigned counter: it hands out generation numbers, nothing more
SESSION_KEY = "pd/session"  # the prefill instance's random session id (signed)
HELLO_KEY = "pd/hello"  # the newest decode worker's announcement: session and generation (signed)
WAIT_POLL_S = 0.01
SECRET_ENV = "RADIXLM_KV_SECRET"  # the pair's shared secret itself
SECRET_FILE_ENV = "RADIXLM_KV_SECRET_FILE"  # or a file holding it (like --disaggregation-secret-file)
DEFAULT_SECRET_FILE = "pd-secret"  # under the cache folder: loopback pairs of one user share it
MAX_REMEMBERED_FAILURES = 1024
CONNECT_TRY_S = 1.0  # one try of the decode side to reach the prefill side's store


def prompt_digest(input_ids: list[int]) -> str:
    """A short digest of a prompt's token ids (both sides must have tokenized it alike)."""
    return hashlib.blake2b(torch.tensor(input_ids, dtype=torch.int64).numpy().tobytes(), digest_size=12).hexdigest()


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback one."""
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (where the decode side's gloo listens)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # a UDP connect sends nothing: it only picks the route
        return s.getsockname()[0]


def link_secret(bootstrap: str, secret_file: str | None = None) -> bytes:
    """The secret that signs a pair's records: ``$RADIXLM_KV_SECRET``, else the file named by
    ``secret_file`` (or ``$RADIXLM_KV_SECRET_FILE``; mode 600), else, for a loopback bootstrap only,
    a random one in ``<cache>/pd-secret`` created by whichever side starts first (readable by this
    user only, so a pair on one machine under one user just works). A bootstrap beyond loopback
    without a secret is refused: its store would take records from anyone who reaches it."""
    host, _ = parse_bootstrap(bootstrap)
    value = os.environ.get(SECRET_ENV)
    if value:
        if len(value.encode()) < 16:
            raise ValueError(f"{SECRET_ENV} must hold at least 16 bytes, got {len(value.encode())}")
        return value.encode()
    secret_file = secret_file or os.environ.get(SECRET_FILE_ENV)
    if secret_file:
        return read_secret_file(secret_file, "disaggregation_secret_file")
    if is_loopback(host):
        return shared_secret_file(cache_dir() / DEFAULT_SECRET_FILE, "the default KV link secret")
    raise ValueError(
        f"disaggregation_bootstrap {host} is not a loopback address: the KV link then needs a secret shared by both workers; "
        f"set {SECRET_ENV} in both workers' environment, or give both --disaggregation-secret-file (a file of mode 600)"
    )


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
    refused: int = 0  # store records refused: forged, replayed or malformed

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
            "pd_refused_records": self.refused,
        }


class LinkDown(RuntimeError):
    """The peer is not connected (or went away)."""


class BadRecord(ValueError):
    """A signed control record that does not make sense (wrong types, sizes out of bounds)."""


def _int(rec: dict[str, Any], name: str, low: int = 0, high: int | None = None) -> int:
    value = rec.get(name)
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
        raise BadRecord(f"field {name!r} must be {bound}, got {value!r}")
    return value


@dataclass(frozen=True)
class Sent:
    """A prefill-side record ``seq/k``: the KV of ``[start, end)`` of room's prompt follows, or an error."""

    room: int
    start: int = 0
    end: int = 0
    token_bytes: int = 0
    error: str | None = None

    @classmethod
    def parse(cls, rec: dict[str, Any], layout: KVLayout, max_tokens: int) -> Sent:
        """The record, every size bounded before anything is allocated (BadRecord otherwise)."""
        room = _int(rec, "room")
        if rec.get("error") is not None:
            if not isinstance(rec["error"], str):
                raise BadRecord(f"field 'error' must be a string, got {type(rec['error']).__name__}")
            return cls(room, error=rec["error"][:2000])
        start = _int(rec, "start")
        end = _int(rec, "end", start, start + max_tokens)
        token_bytes = _int(rec, "token_bytes", layout.token_bytes, layout.token_bytes) if end > start else 0
        return cls(room, start, end, token_bytes)


def parse_have(rec: dict[str, Any]) -> dict[str, Any]:
    """A decode-side record ``room/R/have``, its fields checked (BadRecord otherwise)."""
    n = _int(rec, "n")
    start = _int(rec, "start", 0, n)
    end = _int(rec, "end", start, n)
    if not isinstance(rec.get("digest"), str) or not isinstance(rec.get("skip", False), bool):
        raise BadRecord("fields 'digest' (a string) and 'skip' (a boolean) are malformed")
    return {"start": start, "end": end, "n": n, "digest": rec["digest"], "skip": rec.get("skip", False)}


class KVLink:
    """The store and the process group of one prefill/decode pair, (re)connected by a thread.

    Every record is signed with the pair's shared secret (``SignedStore``) under a key that names
    the prefill instance's session and the decode connection's generation
    (``pd/<session>/<generation>/...``): a record written without the secret, or replayed from
    another key, session or generation, is refused (logged, counted in ``stats.refused``, ignored).
    A decode worker announces itself by a signed ``hello``; the unsigned generation counter only
    hands out numbers, so bumping it disturbs nobody."""

    def __init__(self, role: str, bootstrap: str, layout: KVLayout, timeout_s: float, secret: bytes, max_tokens: int) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"disaggregation_mode must be prefill or decode, got {role!r}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.role, self.layout, self.timeout_s = role, layout, timeout_s
        self.secret, self.max_tokens = secret, max_tokens
        self.host, self.port = parse_bootstrap(bootstrap)
        self.rank = 0 if role == "prefill" else 1
        self._lock = threading.Lock()  # one store client, used by the loop thread and the link thread
        self._store: SignedStore | None = None
        self._keep: list[Any] = []  # stores the process groups call back into (see SignedStore)
        self.session = ""
        self.prefix = ""
        self.generation = 0
        self.pg: Any = None
        self.error: str | None = None  # why the link is down, when it is
        self.closed = False
        self.connected = threading.Event()  # set once the first peer has joined
        self.stats = TransferStats()  # the side's counters (``refused`` is counted here)
        self._refused_seen: set[tuple[str, bytes]] = set()  # what was logged already
        if role == "prefill":  # bind now: a taken port fails start-up, not the first request
            self._store = SignedStore(listening_store(self.host, self.port, 2, timeout_s), secret)
            self.session = secrets.token_hex(8)
            self._store.set(SESSION_KEY, self.session)

    def _td(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    @property
    def up(self) -> bool:
        """True while a peer is connected."""
        return self.pg is not None

    # ------------------------------------------------------------ store ops
    def set(self, key: str, value: dict[str, Any]) -> None:
        """Write one signed control record of the current generation."""
        with self._lock:
            self._require().set(self.prefix + key, json.dumps(value))

    def take(self, key: str, keep: bool = False) -> dict[str, Any] | None:
        """Read (and unless ``keep``, delete) a record of the current generation; None when absent
        or refused (a forged or malformed record stays where it is until the real one replaces it)."""
        with self._lock:
            store = self._require()
            value = self._read(store, self.prefix + key)
            if value is not None and not keep:
                store.delete_key(self.prefix + key)
            return value

    def _read(self, store: SignedStore, key: str) -> dict[str, Any] | None:
        """The verified JSON object under ``key``; None when absent or refused."""
        raw = b""
        try:
            raw = store.lookup(key)
            if raw is None:
                return None
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError(f"a JSON {type(value).__name__}, not an object")
            return value
        except ForgedRecord as exc:
            self.refuse(key, str(exc), exc.data)
        except ValueError as exc:
            self.refuse(key, f"not a JSON object: {exc}", raw)
        return None

    def refuse(self, key: str, reason: str, data: bytes = b"") -> None:
        """Count and log a refused record once per distinct (key, reason, data): one still in
        place when it is read again is not counted again, so a flood logs little."""
        mark = (key, hashlib.blake2b(reason.encode() + b"\0" + data, digest_size=8).digest())
        if mark not in self._refused_seen:
            if len(self._refused_seen) > MAX_REMEMBERED_FAILURES:
                self._refused_seen.clear()
            self._refused_seen.add(mark)
            self.stats.refused += 1
            logger.warning("KV link: refused the store record %r: %s", key, reason)

    def delete(self, key: str) -> None:
        """Remove a record of the current generation, if the link is up and it is there."""
        with self._lock:
            if self._store is not None and self.pg is not None:
                self._store.delete_key(self.prefix + key)

    def _require(self) -> SignedStore:
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

    def _hello(self) -> int:
        """The generation a decode worker announced in a valid ``hello`` of this session; 0 if none."""
        hello = self._read(self._store, HELLO_KEY)
        if hello is None or hello.get("session") != self.session:
            return 0
        gen = hello.get("generation")
        return gen if type(gen) is int and gen > 0 else 0

    def _accept(self) -> bool:
        gen = self._hello()
        if gen <= self.generation:
            return False
        self._start_generation(self._store, gen)
        return True

    def _join(self) -> bool:
        # a short connect timeout per try: the link thread retries, and a closing engine need not wait
        raw = dist.TCPStore(self.host, self.port, 2, is_master=False, timeout=datetime.timedelta(seconds=min(self.timeout_s, CONNECT_TRY_S)))
        store = SignedStore(raw, self.secret)
        try:
            session = store.lookup(SESSION_KEY)
        except ForgedRecord:
            self._drop(f"the prefill worker at {self.host}:{self.port} signs its records with another secret: give both workers the same {SECRET_ENV} or --disaggregation-secret-file")
            raise LinkDown(self.error) from None
        if session is None:
            raise LinkDown(f"the store at {self.host}:{self.port} holds no prefill session yet")
        gen = raw.add(GENERATION_KEY, 1)
        self.session = session.decode()
        store.set(HELLO_KEY, json.dumps({"session": self.session, "generation": gen}))
        self._start_generation(store, gen)
        return True

    def _wait_record(self, store: SignedStore, key: str) -> dict[str, Any]:
        """The first valid record under ``key`` within the timeout (forged ones are refused meanwhile)."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline and not self.closed:
            value = self._read(store, key)
            if value is not None:
                return value
            time.sleep(WAIT_POLL_S)
        raise LinkDown(f"the {self._peer} worker did not answer within {self.timeout_s:g} s")

    def _start_generation(self, store: SignedStore, gen: int) -> None:
        prefix = f"pd/{self.session}/{gen}/"
        store.set(prefix + f"meta/{self.role}", json.dumps(vars(self.layout)))
        try:
            theirs = self._wait_record(store, prefix + f"meta/{self._peer}")
        except LinkDown as exc:
            self._drop(str(exc))
            raise
        diff = self.layout.differences(theirs)
        if diff:
            self._drop(f"the prefill and decode workers' KV layouts differ ({'; '.join(diff)})")
            raise LinkDown(self.error)
        opts = dist.ProcessGroupGloo._Options()
        # gloo listens too: on the bootstrap host (prefill), or on the address that reaches it (decode)
        here = self.host if self.role == "prefill" or is_loopback(self.host) else local_address_towards(self.host, self.port)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=here)]
        opts._timeout = self._td()
        pg_store = dist.PrefixStore(prefix + "pg/", store)
        pg = dist.ProcessGroupGloo(pg_store, self.rank, 2, opts)
        with self._lock:
            self._keep = [store, pg_store]
            self._store, self.prefix, self.generation, self.pg, self.error = store, prefix, gen, pg, None
        self.connected.set()
        logger.info("KV link up with the %s worker (%s:%d, generation %d)", self._peer, self.host, self.port, gen)

    def newer_peer(self) -> bool:
        """True when a decode worker has announced itself after the connected one (prefill side)."""
        with self._lock:
            return self.role == "prefill" and self._store is not None and self._hello() > self.generation

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
            self._store, self._keep = None, []  # the last references: a prefill side's server closes here


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
        self.stats = link.stats
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
            have = parse_have(have) if have is not None else None
        except (LinkDown, BadRecord):
            return 0
        return have["start"] if have is not None and not have["skip"] else 0

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
            if have is not None:
                try:
                    have = parse_have(have)
                except BadRecord as exc:
                    self.link.refuse(f"room/{job.room}/have", str(exc))
                    msg = f"the decode worker's request for this prompt's KV is malformed: {exc}"
                    self._record(job.room, error=msg)
                    self._done(job, msg, 500)
                    continue
            if have is None:
                if now - job.created > self.link.timeout_s:
                    self._record(job.room, error="the prefill side gave up waiting for the decode side")
                    self._done(job, f"the decode worker did not ask for this prompt's KV within {self.link.timeout_s:g} s", 504)
                continue
            self._hand_over(job, have)

    def _hand_over(self, job: SendJob, have: dict[str, Any]) -> None:
        start, end = have["start"], have["end"]
        if have["n"] != job.n or have["digest"] != job.digest:
            msg = "the prefill and decode workers tokenized this prompt differently"
            self._record(job.room, error=msg)
            self._done(job, msg, 500)
            return
        if have["skip"] or start >= end:
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
        self.stats = link.stats
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
        key = f"seq/{self._seq}"
        rec = self.link.take(key)  # None too when forged: the real record replaces it, and comes
        if rec is None:
            return False
        tag, self._seq = self._seq, self._seq + 1
        try:
            sent = Sent.parse(rec, self.link.layout, self.link.max_tokens)
        except BadRecord as exc:  # signed, yet nothing can be received by it: only its request fails
            self.link.refuse(key, str(exc))
            self._fail_room(rec.get("room"), f"the prefill worker sent a malformed record for this request: {exc}")
            return True
        room = sent.room
        with self._lock:
            expected = self._expected.pop(room, None)
            if sent.error is not None and expected is None:  # its request may not have been admitted yet
                self._failed[room] = sent.error
                while len(self._failed) > MAX_REMEMBERED_FAILURES:
                    self._failed.pop(next(iter(self._failed)))
        if sent.error is not None:
            if expected is not None:
                self.stats.failures += 1
                self._post_failure(room, f"the prefill worker failed this request: {sent.error}", 502)
            return True
        start, end = sent.start, sent.end
        t0 = time.perf_counter()
        if end > start:  # always received (its size is bounded), even for an ended request: the stream stays in step
            data = self.link.recv((end - start, sent.token_bytes), tag)
        else:  # the decode side held the whole prompt already
            data = torch.empty((0, self.link.layout.token_bytes), dtype=torch.uint8)
        seconds = time.perf_counter() - t0
        if expected is None:
            return True  # its request ended meanwhile
        if (start, end) != (expected.start, expected.end):
            self.link.refuse(key, f"it carries positions [{start}, {end}) of room {room}, which asked for [{expected.start}, {expected.end})")
            self.stats.failures += 1
            self._post_failure(room, f"the prefill worker sent positions [{start}, {end}) of this prompt, not the [{expected.start}, {expected.end}) asked for", 502)
            return True
        self.stats.transfers += 1
        self.stats.tokens += end - start
        self.stats.skipped_tokens += start
        self.stats.bytes += data.numel()
        self.stats.seconds += seconds
        self.post(lambda: self.on_kv(room, start, end, data, seconds))
        return True

    def _fail_room(self, room: Any, message: str) -> None:
        """Fail the request waiting for ``room`` (when one does) with ``message``."""
        if type(room) is not int:
            return
        with self._lock:
            expected = self._expected.pop(room, None)
        if expected is not None:
            self.stats.failures += 1
            self._post_failure(room, message, 502)

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
