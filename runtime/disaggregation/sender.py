"""The prefill side of the KV link: hands computed prompts' KV to the decode worker."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.runtime.disaggregation.link import IDLE_S, POLL_S, KVLink, LinkDown
from radixlm.runtime.disaggregation.records import BadRecord, parse_have

logger = logging.getLogger(__name__)


@dataclass
class SendJob:
    """A computed prompt waiting for its decode side's request (prefill side)."""

    room: int
    rid: str
    n: int
    digest: str
    start: int  # position of data's first row
    data: torch.Tensor  # uint8 [end - start, token_bytes] for positions [start, n - 1)
    states: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))  # hybrid models: the states after n - 1 tokens, as bytes
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
        tag = self._record(job.room, start=start, end=end, token_bytes=data.shape[1], state_bytes=job.states.numel())
        t0 = time.perf_counter()
        self.link.send(torch.cat([data.reshape(-1), job.states]) if job.states.numel() else data, tag)
        seconds = time.perf_counter() - t0
        self.stats.transfers += 1
        self.stats.tokens += end - start
        self.stats.skipped_tokens += start
        self.stats.bytes += data.numel() + job.states.numel()
        self.stats.seconds += seconds
        self._done(job, None, 0, {"sent_tokens": end - start, "sent_bytes": data.numel() + job.states.numel(), "transfer_s": round(seconds, 6)})

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

