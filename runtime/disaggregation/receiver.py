"""The decode side of the KV link: asks for the KV its requests lack and receives it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.runtime.disaggregation.link import IDLE_S, MAX_REMEMBERED_FAILURES, POLL_S, KVLink
from radixlm.runtime.disaggregation.records import BadRecord, Sent


@dataclass
class Expected:
    """A decode-side request waiting for its prompt's KV."""

    room: int
    start: int
    end: int
    deadline: float


class DecodeReceiver:
    """Decode side: asks for the KV its requests lack and hands what arrives to the engine loop.

    ``post(fn)`` runs ``fn`` on the engine loop thread; ``on_kv(room, start, end, data, states, s)``
    (``states``: a hybrid model's linear-attention states as bytes, else empty) and
    ``on_failed(room, message, status)`` are the scheduler's, called there.
    """

    role = "decode"

    def __init__(self, link: KVLink) -> None:
        self.link = link
        self.stats = link.stats
        self.post: Callable[[Callable[[], None]], None] = lambda fn: None
        self.on_kv: Callable[[int, int, int, torch.Tensor, torch.Tensor, float], None] = lambda *a: None
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
        states = torch.empty(0, dtype=torch.uint8)
        if end > start and sent.state_bytes:  # a hybrid model's: the KV, then the states, in one message
            kv_bytes = (end - start) * sent.token_bytes
            received = self.link.recv((kv_bytes + sent.state_bytes,), tag)
            data, states = received[:kv_bytes].view(end - start, sent.token_bytes), received[kv_bytes:]
        elif end > start:  # always received (its size is bounded), even for an ended request: the stream stays in step
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
        self.stats.bytes += data.numel() + states.numel()
        self.stats.seconds += seconds
        self.post(lambda: self.on_kv(room, start, end, data, states, seconds))
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
