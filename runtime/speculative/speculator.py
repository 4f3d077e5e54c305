"""Speculator: after each pass, gives the decoding requests that the gate picks their next drafts.

The scheduler calls ``step`` once per forward pass with the requests that still decode and have
no drafts (a grammar's forced text keeps priority). Drafts come from the first source that has
some for a row: the request's OpenAI prediction, then the configured algorithm (n-gram prompt
lookup, a draft model, or DeepSeek-V3's MTP layer, which ``observe`` hands each pass's rows). A request with a prediction speculates even when no algorithm is
configured (prediction and prompt lookup only). The decoder verifies the drafts in the next
pass and counts what it accepted; the next ``step`` (or ``release``) feeds that to the gate.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

from radixlm.runtime.request import Req
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.speculative.gate import Gate, GateConfig
from radixlm.runtime.speculative.ngram import NgramProposer, PredictionProposer, RecentOutputs
from radixlm.runtime.speculative.pass_cost import PassCost
from radixlm.runtime.speculative.proposal import Proposal

logger = logging.getLogger(__name__)

DRAFT_COST_PRIOR = 0.5  # a draft position's cost in target passes until measured (probes measure it)
TIME_DECAY = 0.9  # weight of the older timings in the running means


def _mean(old: float | None, new: float) -> float:
    return new if old is None else TIME_DECAY * old + (1 - TIME_DECAY) * new


@dataclass
class _Pending:
    """A request's counters when it was last given drafts."""

    passes: int
    drafts: int
    accepted: int


class Speculator:
    """Chooses, proposes and accounts speculative drafts for the running requests."""

    def __init__(self, args: ServerArgs, runner, tokenizer, kv=None, gate: Gate | None = None) -> None:
        self.algorithm = args.speculative_algorithm
        self.num_draft_tokens = args.speculative_num_draft_tokens
        self.context_len = runner.context_len
        self.gate = gate or Gate(GateConfig())
        self.prediction = PredictionProposer()
        self.ngram = NgramProposer()
        self.model = None
        if self.algorithm == "draft":
            from radixlm.runtime.speculative.draft_model import DraftModelProposer

            self.model = DraftModelProposer(args, runner, tokenizer, kv)
        elif self.algorithm == "mtp":
            from radixlm.runtime.speculative.mtp import MtpProposer

            self.model = MtpProposer(args, runner, tokenizer, kv)
        self._pending: dict[Req, _Pending] = {}
        self.pass_s: float | None = None  # running mean of a decode pass of the target (seconds)
        self.pass_cost = PassCost(prior=self.gate.config.position_cost)
        self.drafting_rows = 0  # rows the draft model proposed for at its last step
        self.draft_step_s: float | None = None  # running mean of one draft-model position for a batch
        self.verify_passes = 0  # engine-wide totals of the verified speculative drafts
        self.draft_tokens = 0
        self.accepted_tokens = 0

    # ------------------------------------------------------------------ step
    def observe(self, rows: list) -> None:
        """Hand a proposer that reads the target's hidden states (MTP) the pass just run over
        ``rows`` (the scheduler's, in the batch's order, their drafts verified); nothing otherwise."""
        observe = getattr(self.model, "observe", None)
        if observe is None:
            return
        try:
            observe(rows)
        except Exception:  # speculation is an optimisation: the rows only lose what the pass would have given the draft
            logger.exception("taking the target's hidden states for speculation failed")
            for row in rows:
                self.model.release(row.req)

    def step(self, reqs: list[Req], batch: int) -> None:
        """Settle last step's drafts and give the gated rows of ``reqs`` new drafts.

        ``batch`` is the number of decoding requests (the gate turns off above its threshold).
        """
        for req in reqs:
            if req in self._pending:
                self._settle(req)
        if self.algorithm is None and not any(r.prediction_ids for r in reqs):
            return
        rows, sizes, own = [], [], []
        for req in reqs:
            if self.algorithm is None and not req.prediction_ids:
                continue
            budget = min(self.num_draft_tokens, req.remaining_tokens() - 1, self.context_len - 1 - req.seq_len)
            own_only = req.generator is not None and not req.params.greedy
            cost = None if own_only else functools.partial(self.pass_cost.position_cost, batch)
            k = self.gate.plan(req, budget, batch, own_only, self.draft_cost(batch, own_only), cost)
            if k > 0:
                rows.append(req)
                sizes.append(k)
                own.append(own_only)
        if rows:
            self._propose(rows, sizes, own)

    def _propose(self, rows: list[Req], sizes: list[int], own: list[bool]) -> None:
        left = list(range(len(rows)))
        left = self._apply(rows, left, self.prediction.propose([rows[i] for i in left], [sizes[i] for i in left]), "prediction")
        if not left:
            return
        if self.model is not None:
            t0 = time.perf_counter()
            proposals = self.model.propose([rows[i] for i in left], [sizes[i] for i in left])
            self.draft_step_s = _mean(self.draft_step_s, (time.perf_counter() - t0) / max(sizes[i] for i in left))
            self.drafting_rows = len(left)
            self._apply(rows, left, proposals, self.model.name)
        else:
            proposals = self.ngram.propose([rows[i] for i in left], [sizes[i] for i in left], [own[i] for i in left])
            self._apply(rows, left, proposals, "ngram")

    def _apply(self, rows: list[Req], idx: list[int], proposals: list[Proposal], source: str) -> list[int]:
        """Set the non-empty proposals as drafts; returns the indices still without drafts."""
        left = []
        for i, prop in zip(idx, proposals):
            req = rows[i]
            if not prop.tokens:
                left.append(i)
                continue
            req.draft_ids = list(prop.tokens)
            req.draft_probs = prop.probs
            req.draft_source = source
            self._pending[req] = _Pending(req.spec_verify_passes, req.spec_draft_tokens, req.spec_accepted_tokens)
        return left

    def _settle(self, req: Req) -> None:
        """Feed the request's verify outcome since it was last given drafts to the gate."""
        was = self._pending.pop(req)
        passes = req.spec_verify_passes - was.passes
        drafts = req.spec_draft_tokens - was.drafts
        accepted = req.spec_accepted_tokens - was.accepted
        if passes:
            self.gate.record(req, drafts, accepted)
            self.verify_passes += passes
            self.draft_tokens += drafts
            self.accepted_tokens += accepted

    def note_pass(self, seconds: float, tokens: int) -> None:
        """Record the time of one target pass over decode and verify rows (``tokens`` new tokens)."""
        self.pass_s = _mean(self.pass_s, seconds)
        self.pass_cost.record(tokens, seconds)

    def draft_cost(self, batch: int, own_only: bool = False) -> float:
        """What proposing one draft token costs a request, in its share of a plain pass.

        Zero for n-gram lookup. For a draft model: a draft step (all its rows together) over a
        plain target pass of ``batch`` rows (from the measured pass times: verify passes are
        longer and would make drafts look cheap), times ``batch / m`` where ``m`` is how many rows
        shared the last draft step: a draft pass costs nearly as much for one row as for eight, so
        a few rows drafting in a large batch each pay a lot. ``DRAFT_COST_PRIOR`` before anything
        is measured, and always for ``own_only`` requests, whose decisions must not depend on timing.
        """
        if self.model is None:
            return 0.0
        plain = self.pass_cost.plain_pass_s(batch) or self.pass_s
        if own_only or plain is None or self.draft_step_s is None or plain <= 0:
            return DRAFT_COST_PRIOR
        sharing = min(self.drafting_rows, batch) or batch
        return self.draft_step_s * batch / (sharing * plain)

    # --------------------------------------------------------------- lifecycle
    def drop_drafts(self, req: Req) -> None:
        """Take back a request's unverified speculative drafts (memory pressure, retraction)."""
        if req.speculating:
            req.clear_drafts()

    def release(self, req: Req) -> None:
        """The request ended or was retracted: settle its last drafts and drop its state.

        A retracted request keeps its gate history (it decides as it would have without the
        retraction); its proposers rebuild their indexes from its tokens when it runs again.
        """
        if req in self._pending:
            self._settle(req)
        if req.finish is not None:
            self.gate.forget(req)
        self.prediction.release(req)
        self.ngram.release(req)
        if self.model is not None:
            self.model.release(req)

    def flush(self) -> None:
        """Forget the recent outputs of all requests (with the radix cache's flush)."""
        self.ngram.recent = RecentOutputs(max_n=self.ngram.max_n)

    def stats(self) -> dict[str, object]:
        """Engine-wide speculation counters (verified drafts of settled passes)."""
        return {
            "speculative_algorithm": self.algorithm,
            "spec_verify_passes": self.verify_passes,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_accept_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
            "spec_accept_length": self.accepted_tokens / self.verify_passes if self.verify_passes else None,
        }
