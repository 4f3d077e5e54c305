"""Req: one generation request's state as it moves through the scheduler."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.radix_cache.manager import KVState
from radixlm.runtime.pooling import PoolingTask
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.tokenizer import IncrementalDetokenizer


class _AnySalt:
    """Stands for every tenant where a ``cache_salt`` is expected (the operator's abort, listing)."""

    def __repr__(self) -> str:
        return "ANY_SALT"


ANY_SALT: Any = _AnySalt()


def same_tenant(req_salt: str | None, salt: Any) -> bool:
    """True when a request with ``req_salt`` belongs to the tenant ``salt`` (``ANY_SALT``: every tenant)."""
    return salt is ANY_SALT or req_salt == salt


def salt_offset(salt: str) -> int:
    """A key offset for ``salt``: past every token id (< 2**32), the same for the same salt."""
    digest = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return (int.from_bytes(digest, "little") + 1) << 32


@dataclass
class ReqOutput:
    """What the engine reports about a request after a step.

    ``text`` and ``output_ids`` are cumulative. The logprob lists of ``meta_info`` are
    cumulative for a non-streamed request; a streamed request's outputs carry only the entries
    new since its previous output (prompt entries once), starting at the offsets below.
    """

    rid: str
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    finished: bool
    input_logprob_offset: int = 0  # index (from logprob_start_len) of the first prompt entry carried
    output_logprob_offset: int = 0  # index of the output token whose entry comes first
    pooled: list[float] | None = None  # a pooling request's answer: its embedding, or [P(yes)] for a score


@dataclass
class FinishReason:
    """Why a request ended: ``stop`` (EOS, stop token or string), ``length`` or ``abort``.

    A request that failed (rather than being aborted by its client) carries the HTTP ``status``
    its error maps to: 500 for a fault inside that request, 503 when the engine stopped.
    """

    type: str
    matched: int | str | None = None
    message: str | None = None
    status: int | None = None
    closed_within_budget: bool = False  # a length whose JSON is whole: the budget closer shortened it

    def to_dict(self) -> dict[str, Any]:
        """The ``finish_reason`` dict of SGLang's meta_info."""
        d: dict[str, Any] = {"type": self.type, "matched": self.matched}
        if self.closed_within_budget:
            d["closed_within_budget"] = True
        if self.message:
            d["message"] = self.message
        if self.status is not None:
            d["status"] = self.status
        return d

    @classmethod
    def failure(cls, message: str, status: int = 500) -> FinishReason:
        """An abort caused by an error (not by the client)."""
        return cls("abort", message=message, status=status)


@dataclass(eq=False)
class Req:
    """A request: its tokens, settings, KV placement, output so far and where results go."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    sink: Callable[[ReqOutput], None]
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    output_ids: list[int] = field(default_factory=list)
    kv: KVState | None = None
    finish: FinishReason | None = None
    cached_tokens: int = -1  # prefix hit at first admission; -1 until admitted
    generator: torch.Generator | None = None
    detok: IncrementalDetokenizer | None = None
    text: str = ""  # output text after stop-string trimming
    sent_len: int = 0  # characters of ``text`` already streamed
    streamed_tokens: int = 0  # output tokens when the last non-final output was streamed (stream_interval)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    admitted_at: float | None = None  # when it was first admitted (its queue time ends)
    abort_requested: bool = False
    grammar: Any = None  # the constraint's Matcher, if any
    constraint_warnings: tuple[str, ...] = ()  # what the constraint does not enforce (an unknown format, ...)
    draft_ids: list[int] = field(default_factory=list)  # proposed tokens (forced text or speculation), unverified
    draft_probs: torch.Tensor | None = None  # float32 [len(draft_ids), V]: a draft model's q; None = deterministic
    draft_source: str = ""  # who proposed draft_ids: "", "jump_forward", "ngram", "prediction", "draft" or "mtp"
    accepted_draft_tokens: int = 0  # output tokens that came from verified jump-forward drafts
    prediction_ids: list[int] = field(default_factory=list)  # tokens of the client's predicted output (OpenAI prediction)
    spec_verify_passes: int = 0  # passes that verified speculative drafts (not jump-forward)
    spec_draft_tokens: int = 0  # speculative draft tokens proposed and verified
    spec_accepted_tokens: int = 0  # speculative draft tokens accepted
    prediction_draft_tokens: int = 0  # of spec_draft_tokens, those taken from the prediction
    prediction_accepted_tokens: int = 0  # of spec_accepted_tokens, those taken from the prediction
    cache_salt: str | None = None  # requests share cached KV only with requests of the same salt
    program: str | None = None  # the DSL program (or other origin label) this request came from
    prompt_cache_key: str | None = None  # groups a session's requests (recorded with the origin)
    return_cache_info: bool = False  # put the cache explanation in meta_info
    retention: list[tuple[int, float]] = field(default_factory=list)  # (prefix tokens, ttl s) hints
    cache_info: dict[str, Any] | None = None  # the cache explanation, built at first admission
    bootstrap_room: int | None = None  # pairs the prefill and decode halves of a disaggregated request
    pd_info: dict[str, Any] | None = None  # what its KV hand-over moved (decode side)
    pooling: PoolingTask | None = None  # set: prefill only, answer with pooled hidden states (pooling.py)
    lora: str | None = None  # the LoRA adapter it runs with (None: the base model)
    lora_key: str | None = None  # what the radix cache keys that adapter's KV by (LoraPool.cache_key)
    priority: int = 0  # its class under --schedule-policy priority: smaller is more urgent
    run_class: int | None = None  # the class it was last admitted at (its priority, or better by aging)
    queued_at: float = 0.0  # when it last joined the waiting queue (monotonic; aging counts from it)
    preemptions: int = 0  # times a more urgent request took its place
    tier_fetch: Any = None  # a concurrent.futures.Future while its prefix is read back from the disk tier
    state_marks: list[int] = field(default_factory=list)  # hybrid models: prompt positions whose states become tree snapshots
    tier_tokens: dict[str, int] | None = None  # with KV tiers: cached prompt tokens loaded from host and disk (first admission)
    beam_round: bool = False  # one beam's step of a beam search: top logprobs over what its grammar allows, no drafts

    @property
    def fill_ids(self) -> list[int]:
        """Every token of the sequence so far: prompt, output, then unverified draft tokens."""
        return self.input_ids + self.output_ids + self.draft_ids

    @property
    def cache_ids(self) -> list[int]:
        """``fill_ids`` as the radix tree keys them: a salt (and a LoRA adapter) moves the first
        token out of the vocabulary's range, so such sequences share a prefix only with the same
        salt and adapter."""
        ids = self.fill_ids
        salt = self.cache_salt if self.lora_key is None else f"{self.cache_salt or ''}\x00{self.lora_key}"
        if salt is not None:
            ids[0] += salt_offset(salt)
        return ids

    @property
    def seq_len(self) -> int:
        """Length of the sequence so far (drafts included)."""
        return len(self.input_ids) + len(self.output_ids) + len(self.draft_ids)

    @property
    def generating(self) -> bool:
        """True once every token before the newest output token (and its drafts) has KV."""
        return self.kv is not None and self.kv.kv_len >= self.seq_len - 1 - len(self.draft_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True when logprobs of prompt tokens are to be returned."""
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.input_ids)

    def needs_prompt_logprobs(self) -> bool:
        """True while prompt logprobs are wanted and not all collected yet."""
        return self.wants_prompt_logprobs and len(self.input_logprobs) < len(self.input_ids) - self.logprob_start_len

    def max_cacheable_prefix(self) -> int:
        """How much of the sequence may come from the cache (the token before any drafts is recomputed)."""
        limit = self.seq_len - 1 - len(self.draft_ids)
        if self.pooling is not None and not self.pooling.reads_cache:
            return 0  # mean pooling needs every position's hidden state: computed, never cached
        if self.needs_prompt_logprobs():
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return limit

    @property
    def speculating(self) -> bool:
        """True while ``draft_ids`` are speculative (not text a grammar forces)."""
        return bool(self.draft_ids) and self.draft_source not in ("", "jump_forward")

    def clear_drafts(self) -> None:
        """Drop the unverified drafts (and their source and probabilities)."""
        self.draft_ids = []
        self.draft_probs = None
        self.draft_source = ""

    def remaining_tokens(self) -> int:
        """Upper bound on the tokens this request may still generate."""
        return max(self.params.max_new_tokens - len(self.output_ids) - len(self.draft_ids), 0)
