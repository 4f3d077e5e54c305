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
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from radixlm.runtime.disaggregation.addressing import is_loopback, local_address_towards
from radixlm.runtime.disaggregation.records import KVLayout
from radixlm.runtime.disaggregation.shared_secret import SECRET_ENV
from radixlm.runtime.distributed.store import ForgedRecord, SignedStore, listening_store
from radixlm.runtime.server_args import parse_bootstrap

logger = logging.getLogger(__name__)

POLL_S = 0.002  # how often pending hand-overs look at the store
IDLE_S = 0.2  # how often an idle link checks for a (re)connecting peer
GENERATION_KEY = "pd/generation"  # an unsigned counter: it hands out generation numbers, nothing more
SESSION_KEY = "pd/session"  # the prefill instance's random session id (signed)
HELLO_KEY = "pd/hello"  # the newest decode worker's announcement: session and generation (signed)
WAIT_POLL_S = 0.01
MAX_REMEMBERED_FAILURES = 1024
CONNECT_TRY_S = 1.0  # one try of the decode side to reach the prefill side's store


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

    def recv(self, shape: tuple[int, ...], tag: int) -> torch.Tensor:
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

