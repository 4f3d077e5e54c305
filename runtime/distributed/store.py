"""Rendezvous stores that listen only where they are told, with every record signed.

``torch.distributed.TCPStore`` started as a server binds every interface, whatever host it is
given; ``listening_store`` binds the socket itself on the address asked for and hands it over
(``master_listen_fd``). Anyone who reaches a TCPStore may still read and write any key, so
``SignedStore`` wraps one: each value written carries an HMAC-SHA256 tag over its key and value
under a secret the peers share out of band, and a value without a valid tag is refused
(``ForgedRecord``). A record cannot be forged without the secret, nor replayed under another
key; callers make keys unique per session and generation, so an old record cannot be replayed
into a new one. The gloo and NCCL rendezvous go through the same wrapper.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
import socket
from pathlib import Path

import torch.distributed as dist

TAG_BYTES = hashlib.sha256().digest_size
MIN_SECRET_BYTES = 16
_ABSENT = b"\x00radixlm: no such record\x00"  # compare_set's answer for a missing key (never sealed)
_DOMAIN = b"radixlm-store-v1\x00"


class ForgedRecord(RuntimeError):
    """A store record whose tag does not verify: written without the shared secret."""

    def __init__(self, message: str, data: bytes = b"") -> None:
        super().__init__(message)
        self.data = data  # what was found under the key


def new_secret() -> bytes:
    """A fresh random secret for one launch."""
    return secrets.token_bytes(32)


def _bind_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple]:
    """The (family, sockaddr) to bind for ``host``, IPv4 first (``localhost`` means 127.0.0.1)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve the store host {host!r}: {exc}") from exc
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return infos[0][0], infos[0][4]


def listening_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server listening on ``host:port`` only (port 0: a free one, read ``.port``)."""
    family, addr = _bind_address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        bound = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the descriptor from here on and closes it
    try:
        return dist.TCPStore(host, bound, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def _as_bytes(value: str | bytes | bytearray | memoryview) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SignedStore(dist.Store):
    """A store whose values carry an HMAC over (key, value); unsigned values are refused.

    Keep a Python reference to it for as long as a process group uses it: the C++ side calls
    back into this object. ``add`` counters pass through unsigned (they cannot carry a tag):
    nothing that must be trusted may rest on one."""

    def __init__(self, inner: dist.Store, secret: bytes) -> None:
        super().__init__()
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the store secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self.inner, self.secret = inner, bytes(secret)
        self._clones: list[SignedStore] = []

    @property
    def port(self) -> int:
        """The port of the wrapped TCPStore."""
        return self.inner.port

    def _tag(self, key: str, value: bytes) -> bytes:
        k = key.encode()
        return hmac.new(self.secret, _DOMAIN + len(k).to_bytes(4, "big") + k + value, hashlib.sha256).digest()

    def seal(self, key: str, value: str | bytes) -> bytes:
        """What ``set`` stores for ``value`` under ``key``: its tag, then the value."""
        value = _as_bytes(value)
        return self._tag(key, value) + value

    def unseal(self, key: str, data: bytes) -> bytes:
        """The value in ``data`` read under ``key``; ForgedRecord when its tag does not verify."""
        data = bytes(data)
        if len(data) < TAG_BYTES or not hmac.compare_digest(data[:TAG_BYTES], self._tag(key, data[TAG_BYTES:])):
            raise ForgedRecord(f"the store record {key!r} does not carry a valid tag (written without the shared secret, or replayed from another key)", data)
        return data[TAG_BYTES:]

    def lookup(self, key: str) -> bytes | None:
        """The verified value of ``key`` without waiting; None when absent (ForgedRecord when forged)."""
        data = bytes(self.inner.compare_set(key, _ABSENT, _ABSENT))  # atomic: a delete in between cannot block it
        return None if data == _ABSENT else self.unseal(key, data)

    # the c10d Store interface (what gloo and NCCL call)
    def set(self, key: str, value: str | bytes) -> None:
        """Store ``value`` under ``key``, signed."""
        self.inner.set(key, self.seal(key, value))

    def get(self, key: str) -> bytes:
        """The verified value of ``key`` (waits for it like the wrapped store)."""
        return self.unseal(key, self.inner.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """``get`` of each key."""
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """``set`` of each key."""
        for k, v in zip(keys, values):
            self.set(k, v)

    def add(self, key: str, amount: int) -> int:
        """The wrapped store's counter (unsigned)."""
        return self.inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        """True when every key is present."""
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Wait until every key is present."""
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; True when it was there."""
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        """How many keys the wrapped store holds."""
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """The wrapped store's default wait."""
        self.inner.set_timeout(timeout)

    def clone(self) -> SignedStore:
        """A second client of the same server, signing alike (kept alive by this one)."""
        twin = SignedStore(self.inner.clone(), self.secret)
        self._clones.append(twin)
        return twin


# ------------------------------------------------------------------ secrets on disk
def read_secret_file(path: str | os.PathLike, what: str) -> bytes:
    """The secret in ``path``: a file of this user's, readable by nobody else (ValueError naming ``what``)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ValueError(f"{what}: cannot open the secret file {path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid():
            raise ValueError(f"{what}: the secret file {path} belongs to another user (uid {st.st_uid})")
        if st.st_mode & 0o077:
            raise ValueError(f"{what}: the secret file {path} is open to other users (mode {st.st_mode & 0o777:o}); make it 600")
        data = f.read().strip()
    if len(data) < MIN_SECRET_BYTES:
        raise ValueError(f"{what}: the secret in {path} is {len(data)} bytes; it needs at least {MIN_SECRET_BYTES}")
    return data


def shared_secret_file(path: str | os.PathLike, what: str) -> bytes:
    """The secret in ``path``, which is created first (random, mode 600) when it does not exist."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not os.path.lexists(path):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            try:
                os.link(tmp, path)  # atomic: a second process starting now reads the first one's
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    return read_secret_file(path, what)
