"""Priority classes: the waiting queue's order by class, aging, and preemption of less urgent requests.

Under ``--schedule-policy priority`` every request carries an integer class, smaller being more
urgent (vLLM's and SGLang's convention). Waiting requests are admitted class by class, longest
cached prefix first within a class. A waiting request moves up one class for every
``--priority-aging-s`` seconds since it last joined the queue, so a steady stream of urgent
requests cannot starve the others.

When the most urgent waiting request would not be admitted because the batch
(``--max-running-requests``), the KV pool or the batch's adapters (``--max-loras-per-batch``) are full, running requests of a less urgent class
make room: the least urgent first, the newest first within a class, and only as many as it
takes. "Less urgent" holds twice: by the class each was sent with (so requests of one class
never preempt each other, however long they waited) and by the class each runs at (what aging
made it when admitted, so a request that aged past a busy class is not thrown out again by it). A preempted request hands its computed KV to the radix tree
and queues again with its output so far; when admitted again it reuses whatever of that KV is
still cached and recomputes the rest, so its tokens are the ones it would have produced alone.
A request never preempts one of its own class or a more urgent one, and nothing is preempted
when even all candidates together would not make room. Preemption is off on a prefill/decode
(disaggregated) server, whose decode side takes prompts' KV by hand-over.
"""

from __future__ import annotations

import logging
import time

from radixlm.runtime.request import Req
from radixlm.runtime.scheduler.finish import Finishing

logger = logging.getLogger(__name__)


def clock() -> float:
    """The clock queue times are read from (monotonic seconds; one place, so tests can replace it)."""
    return time.monotonic()


def effective_class(req: Req, now: float, aging_s: float) -> int:
    """The class a waiting request is admitted by: its own, one more urgent per ``aging_s`` waited."""
    if aging_s <= 0:
        return req.priority
    return req.priority - int(max(now - req.queued_at, 0.0) / aging_s)


def order_by_class(reqs: list[Req], lengths: dict[int, int] | None, aging_s: float) -> list[Req]:
    """``reqs`` by effective class, then (with ``lengths``: cached prefix per ``id(req)``) longest
    prefix first; ties keep queue order."""
    now = clock()
    classes = {id(r): effective_class(r, now, aging_s) for r in reqs}
    if lengths is None:
        return sorted(reqs, key=lambda r: classes[id(r)])
    return sorted(reqs, key=lambda r: (classes[id(r)], -lengths[id(r)]))


def victim_order(req: Req) -> tuple[int, float]:
    """Sort key of running requests to give way, largest first: least urgent class, then newest."""
    return (req.priority, req.arrival)


def run_class(req: Req) -> int:
    """The class a running request runs at: the effective class it was admitted with."""
    return req.priority if req.run_class is None else req.run_class


class Preemption(Finishing):
    """Running requests of a less urgent class give way to a waiting one when the batch or pool is full.

    A part of ``Scheduler``: it uses admission's estimates (``_chunk_len``, ``_admission_need``)
    and retraction's ``_requeue``."""

    def _preempt_for_waiting(self) -> None:
        """Preempt as few less urgent running requests as make room for the most urgent waiting one."""
        if self.args.schedule_policy != "priority" or self.pd is not None or not self.waiting or not self.running:
            return
        now = clock()
        aging = self.args.priority_aging_s
        head = min(self.waiting, key=lambda r: (effective_class(r, now, aging), r.queued_at))
        head_class = effective_class(head, now, aging)
        candidates = [r for r in self.running if r.priority > head.priority and run_class(r) > head_class and r.kv is not None]
        candidates.sort(key=victim_order, reverse=True)
        if not candidates:
            return
        prefix_slots, _ = self.kv.match(head.cache_ids, head.max_cacheable_prefix())
        cached = len(prefix_slots)
        new_len = cached + self._chunk_len(head, cached, self.args.chunked_prefill_size)
        chosen: list[Req] = []
        while not self._fits_after(head, cached, new_len, chosen):
            if len(chosen) == len(candidates):
                return  # even every candidate together would not make room: preempt nobody
            chosen.append(candidates[len(chosen)])
        for victim in chosen:
            self._preempt(victim, head)

    def _fits_after(self, head: Req, cached: int, new_len: int, gone: list[Req]) -> bool:
        """True when ``head``'s first chunk would be admitted once the requests ``gone`` left."""
        if len(self.running) - len(gone) >= self.args.max_running_requests or not self._lora_fits(head, gone):
            return False
        freed = sum(r.kv.owned for r in gone)  # their slots go to the tree, unlocked: evictable
        return self._admission_need(head, cached, new_len, exclude=gone) <= self.kv.available() + freed

    def _lora_fits(self, head: Req, gone: list[Req]) -> bool:
        """True when ``head``'s adapter fits ``--max-loras-per-batch`` beside the running requests but ``gone``."""
        lora = getattr(self.runner, "lora", None)
        if lora is None or head.lora is None:
            return True
        active = {r.lora for r in self.running if r.lora is not None and r not in gone}
        return head.lora in active or len(active) < lora.pool.max_per_batch

    def _preempt(self, req: Req, by: Req) -> None:
        """Take a running request out of the batch for ``by``; it queues again with its output so far."""
        self._requeue(req)
        req.preemptions += 1
        self.stats.num_preempted += 1
        self.total_preempted += 1
        logger.info("preempted request %s (class %d, %d tokens) for request %s (class %d)", req.rid, req.priority, req.seq_len, by.rid, by.priority)
