"""What the scheduler does differently on either side of a prefill/decode pair.

A request joins a pair by its ``bootstrap_room`` (the router gives the same room to both halves).

- **Prefill side**: the request runs with ``max_new_tokens = 0`` (its prompt is computed, with
  this instance's own radix cache); when it ends, the KV of the positions the decode side lacks
  is copied out of the pool and queued on the link, and the request's final output is delivered
  only once the decode side has received it (or the hand-over failed).
- **Decode side**: at admission the request matches this instance's radix tree, reserves slots
  for the rest of its prompt but the last token, and waits in ``receiving`` (holding those slots,
  computing nothing) until the KV arrives; then the KV is written into the reserved slots,
  inserted into the radix tree, and the request decodes from its last prompt token as if it had
  computed the prompt itself. An abort, a failed or late hand-over frees its slots uncached.

A hybrid linear-attention model's request needs its recurrent states too: the prefill side keeps
the states after all but the last prompt token (a mark at that position, ``marks_for``) and sends
them after the KV; the decode side starts the request's state-pool row from them. Where the decode
side held the whole prefix already, it resumed from its own snapshot there and nothing travels.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from radixlm.radix_cache.pool import KVPool
from radixlm.radix_cache.state_pool import StatePool
from radixlm.runtime.disaggregation.link import KVLink
from radixlm.runtime.disaggregation.receiver import DecodeReceiver
from radixlm.runtime.disaggregation.records import KVLayout, prompt_digest
from radixlm.runtime.disaggregation.sender import PrefillSender, SendJob
from radixlm.runtime.disaggregation.shared_secret import link_secret
from radixlm.runtime.request import ANY_SALT, FinishReason, Req, ReqOutput, same_tenant
from radixlm.runtime.scheduler.hooks import SchedulerOps
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


def open_link_side(args: ServerArgs, runner) -> PrefillSender | DecodeReceiver:
    """The link side for ``args.disaggregation_mode`` over ``runner``'s KV pool (starts its thread)."""
    cfg, pool, states = runner.config, runner.kv_pool, runner.state_pool
    layout = KVLayout(
        cfg.num_layers, pool.num_kv_heads, pool.head_dim, runner.kv_format.name, args.page_size, pool.token_bytes(), cfg.vocab_size,
        0 if states is None else states.row_nbytes, "" if states is None else states.row_format,
    )  # fmt: skip
    secret = link_secret(args.disaggregation_bootstrap, getattr(args, "disaggregation_secret_file", None))
    link = KVLink(args.disaggregation_mode, args.disaggregation_bootstrap, layout, args.disaggregation_timeout, secret, pool.num_slots)
    if args.disaggregation_mode == "prefill":
        return PrefillSender(link)
    side = DecodeReceiver(link)
    # a decode worker is ready once it reaches its prefill worker; without one it still starts
    # (the link keeps trying) and requests fail with 503 until it is up
    if not link.connected.wait(args.disaggregation_timeout):
        logger.warning("no prefill worker at %s after %.0f s: starting without one (%s)", args.disaggregation_bootstrap, args.disaggregation_timeout, link.error)
    return side


class Disaggregation:
    """The scheduler's prefill/decode hand-over (its ``DisaggregationHook``): admission to
    ``receiving``, KV in and out of ``kv_pool`` (and a hybrid model's states in and out of
    ``state_pool``). The scheduler binds itself at ``attach_pd``."""

    def __init__(self, side: PrefillSender | DecodeReceiver, kv_pool: KVPool, state_pool: StatePool | None = None) -> None:
        self.side, self.kv_pool, self.state_pool = side, kv_pool, state_pool
        self.sched: SchedulerOps | None = None  # set by bind
        self.role = side.role
        self.receiving: dict[int, Req] = {}  # decode side: room -> request waiting for its KV
        self.sending_salts: dict[str, str | None] = {}  # prefill side: rid of a queued hand-over -> its tenant
        if isinstance(side, DecodeReceiver):
            side.on_kv, side.on_failed = self.on_kv, self.on_failed

    def bind(self, sched: SchedulerOps) -> None:
        """Attach to the scheduler whose requests this side hands over."""
        self.sched = sched

    def requests(self) -> list[Req]:
        """Requests holding KV outside the running queue (waiting for their hand-over)."""
        return list(self.receiving.values())

    # ----------------------------------------------------------- decode side
    def takes(self, req: Req) -> bool:
        """True when ``req`` gets its prompt's KV from the prefill worker."""
        return self.role == "decode" and req.bootstrap_room is not None

    def on_add(self, req: Req) -> None:
        """A queued decode-side request that must compute its prompt itself says so at once."""
        if not self.takes(req) or not (req.wants_prompt_logprobs or len(req.input_ids) < 2):
            return
        room, req.bootstrap_room = req.bootstrap_room, None  # prompt logprobs need the prompt computed here
        self.side.expect(room, 0, 0, len(req.input_ids), prompt_digest(req.input_ids), skip=True)

    def admit(self, req: Req) -> bool:
        """Admit a decode-side request to ``receiving``; False when the KV budget is short now."""
        sched, kv = self.sched, self.sched.kv
        room, n = req.bootstrap_room, len(req.input_ids)
        if room in self.receiving:
            sched.fail(req, f"bootstrap_room {room} is already in use by another request")
            return True
        end = n - 1  # the last prompt token is computed here: it yields the first token's logits
        prefix_slots, node = kv.match(req.cache_ids, min(req.max_cacheable_prefix(), end))
        cached = len(prefix_slots)
        state = sched.reserve_admission(req, prefix_slots, node, end)
        if state is None:
            return False
        try:
            self.side.expect(room, cached, end, n, prompt_digest(req.input_ids))
        except Exception as exc:
            kv.release(state, None)
            sched.waiting.remove(req)
            sched.finish(req, FinishReason.failure(f"the KV link to the prefill worker is down: {exc}", 503))
            return True
        req.kv = state
        sched.note_admission(req, cached, node)
        sched.waiting.remove(req)
        self.receiving[room] = req
        return True

    def on_kv(self, room: int, start: int, end: int, data: torch.Tensor, states: torch.Tensor, seconds: float) -> None:
        """The prompt KV of ``room`` (and a hybrid model's ``states`` after it) arrived (loop
        thread): store it, cache it, start decoding."""
        req = self.receiving.pop(room, None)
        if req is None or req.finish is not None:
            return
        kv = self.sched.kv
        try:
            if req.abort_requested:
                raise RuntimeError("aborted")
            if start != req.kv.kv_len or end != len(req.input_ids) - 1:
                raise ValueError(f"got positions [{start}, {end}), expected [{req.kv.kv_len}, {len(req.input_ids) - 1})")
            pool = self.kv_pool
            pool.scatter_tokens(kv.slots(req.kv, start, end), data.to(pool.device))
            if self.state_pool is not None and end > start:  # the linear layers resume where the received KV ends
                self.state_pool.unpack(req.kv.row, states, end)
            kv.mark_computed(req.kv, end)
            kv.cache_prefix(req.kv, req.cache_ids)
            if self.state_pool is not None:
                kv.take_snapshots(req.kv, req.cache_ids, [end])  # later prompts sharing it resume here
        except Exception as exc:
            self.sched.finish(req, FinishReason("abort", message="aborted by request") if req.abort_requested else FinishReason.failure(f"storing the received KV failed: {exc}"))
            return
        req.bootstrap_room = None  # a retracted request recomputes its prompt here
        req.pd_info = {"received_tokens": end - start, "received_bytes": data.numel() + states.numel(), "transfer_s": round(seconds, 6)}
        self.sched.running.append(req)

    def on_failed(self, room: int, message: str, status: int) -> None:
        """The hand-over of ``room`` failed (loop thread): end its request, freeing its slots."""
        req = self.receiving.pop(room, None)
        if req is not None and req.finish is None:
            self.sched.finish(req, FinishReason.failure(message, status))

    def drop_aborted(self, message: str, status: int | None) -> None:
        """End the receiving requests marked for abortion."""
        for room, req in list(self.receiving.items()):
            if req.abort_requested:
                del self.receiving[room]
                self.side.forget(room)
                self.sched.finish(req, FinishReason("abort", message=message, status=status))

    def abort(self, rid: str, cache_salt: Any = ANY_SALT) -> bool:
        """Mark a receiving request of tenant ``cache_salt`` (or cancel a prefill hand-over) for abortion; False if unknown."""
        if self.role == "prefill":
            if rid not in self.sending_salts or not same_tenant(self.sending_salts[rid], cache_salt):
                return False  # another tenant's hand-over (or none): not the caller's to cancel
            return self.side.cancel(rid, "aborted by request")
        for req in self.receiving.values():
            if req.rid == rid and req.finish is None and same_tenant(req.cache_salt, cache_salt):
                req.abort_requested = True
                return True
        return False

    # ---------------------------------------------------------- prefill side
    def marks_for(self, req: Req, marks: list[int]) -> list[int]:
        """The prompt positions whose linear-attention states ``req``'s passes must keep: ``marks``
        and, for a hybrid model's prefill-side request, all but its last token (what it hands over)."""
        if self.role != "prefill" or req.bootstrap_room is None or self.state_pool is None or len(req.input_ids) < 2:
            return marks
        return sorted({*marks, len(req.input_ids) - 1})

    def prepare(self, req: Req, reason: FinishReason) -> SendJob | None:
        """Copy out the KV a prefill-side request computed, before its slots are released.

        None when there is nothing to hand over; a request that ended otherwise than by
        computing its prompt tells the decode side at once."""
        if self.role != "prefill" or req.bootstrap_room is None:
            return None
        n = len(req.input_ids)
        if reason.type != "length" or reason.status is not None or req.kv is None or req.kv.kv_len < n - 1:
            self.side.fail_room(req.bootstrap_room, reason.message or f"the prefill request ended ({reason.type})")
            return None
        states = torch.empty(0, dtype=torch.uint8)
        if self.state_pool is not None:
            states = self.state_pool.pack(req.kv.row, n - 1)
            if states is None:  # (never expected: its passes keep them) both halves fail, with the reason
                message = "the prefill side did not keep the linear-attention states of this prompt"
                self.side.fail_room(req.bootstrap_room, message)
                raise RuntimeError(message)
        start = min(self.side.wanted_start(req.bootstrap_room), n - 1)
        data = self.kv_pool.gather_tokens(self.sched.kv.slots(req.kv, start, n - 1)).cpu()
        self.sending_salts[req.rid] = req.cache_salt
        return SendJob(req.bootstrap_room, req.rid, n, prompt_digest(req.input_ids), start, data, states)

    def hand_over(self, job: SendJob, out: ReqOutput, sink) -> None:
        """Queue the hand-over; ``out`` reaches ``sink`` once the decode side has the KV."""

        def deliver(error: str | None, status: int, info: dict) -> None:
            self.sending_salts.pop(job.rid, None)
            if error is None:
                out.meta_info["pd"] = info
                sink(out)
                return
            reason = FinishReason("abort", message=error) if status == 499 else FinishReason.failure(error, status)
            sink(ReqOutput(out.rid, "", [], {**out.meta_info, "finish_reason": reason.to_dict()}, True))

        job.deliver = deliver
        self.side.submit(job)

    def stats(self) -> dict:
        """The ``pd_*`` counters of this side."""
        return {**self.side.stats.as_dict(self.role), "pd_link_up": self.side.link.up, "pd_receiving": len(self.receiving)}

    def close(self) -> None:
        """Stop the link."""
        self.side.close()
