"""Request intake: a caller's arguments checked and turned into a ``Req``, its constraint compiled."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

import torch

from radixlm.runtime.cache_control import check_cache_options
from radixlm.runtime.constrained.base import Matcher
from radixlm.runtime.constrained.budget import BudgetMatcher, CloseVocab
from radixlm.runtime.engine.assembly import EngineParts
from radixlm.runtime.pooling import PoolingTask
from radixlm.runtime.request import Req, ReqOutput
from radixlm.runtime.sampling_params import SamplingParams, per_sample_params
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.speculative.prediction import prediction_text


class RequestIntake:
    """Validates requests against the loaded model and builds them (raising ValueError naming the bad argument)."""

    def __init__(self, args: ServerArgs, parts: EngineParts, in_flight: Callable[[str | None, str], bool]) -> None:
        self.args = args
        self.tokenizer, self.runner, self.grammars, self.pd = parts.tokenizer, parts.runner, parts.grammars, parts.pd
        self.config = self.runner.config
        self.context_len = self.runner.context_len
        self._rid_in_flight = in_flight  # (cache_salt, rid) -> True while that request is in flight
        self._close_vocab: CloseVocab | None = None  # built on the first request that closes JSON within budget
        # No token spells more characters than its vocabulary entry has, so a longer text than
        # this is over the context length for sure: refused before the (slow) tokenizer runs.
        self._max_text_chars = self.context_len * max(map(len, self.tokenizer.get_vocab()), default=1)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (ValueError, without tokenizing, for a text no context can hold)."""
        if len(text) > self._max_text_chars:
            raise ValueError(f"prompt is {len(text):,} characters, more than the context length ({self.context_len} tokens) can hold")
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def make_request(
        self,
        sink: Callable[[ReqOutput], None],
        prompt: str | None = None,
        input_ids: list[int] | None = None,
        sampling_params: dict[str, Any] | SamplingParams | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | None = None,
        cache_salt: str | None = None,
        return_cache_info: bool = False,
        program: str | None = None,
        prompt_cache_key: str | None = None,
        cache_ttl: float | None = None,
        retention: list[tuple[int, float]] | None = None,
        prediction: str | dict[str, Any] | None = None,
        bootstrap_room: int | None = None,
        pooling: PoolingTask | None = None,
        priority: int = 0,
        lora: str | None = None,
    ) -> Req:
        """Validate one request and build its Req (raises ValueError naming the bad argument).

        ``cache_salt``: the request shares cached KV only with requests of the same salt (without
        one, a client can tell from ``cached_tokens`` whether others sent the same prefix).
        ``return_cache_info`` adds the cache explanation to meta_info; ``program`` and
        ``prompt_cache_key`` label the prefixes this request computes; ``cache_ttl`` (seconds) asks
        eviction to spare the whole prompt that long, ``retention`` the given (length, ttl) prefixes.
        ``prediction``: the output the client expects (a string, or OpenAI's ``{"type": "content",
        "content": ...}``); its tokens are proposed as speculative drafts, even when no
        ``speculative_algorithm`` is set. The output is the same with or without it.
        ``bootstrap_room``: on one side of a prefill/decode pair, the id that pairs this request
        with its other half (the router sets it): the prefill side only computes the prompt, the
        decode side takes the prompt's KV from it.
        ``pooling``: the request only prefills and answers with pooled hidden states or a score
        (``runtime/pooling.py``); its sampling parameters are ignored.
        ``priority``: the request's class under ``--schedule-policy priority`` (smaller is more
        urgent; any other policy takes only 0).
        """
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if not prompt:
                raise ValueError("prompt must not be empty")
            input_ids = self.tokenize(prompt)
        else:
            if not isinstance(input_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
                raise ValueError("input_ids must be a list of integers")
            if not input_ids:
                raise ValueError("input_ids must not be empty")
            bad = [t for t in input_ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"input_ids contains {bad[0]}, outside the vocabulary [0, {self.config.vocab_size})")
        if len(input_ids) >= self.context_len:
            raise ValueError(f"prompt is {len(input_ids)} tokens; the context length is {self.context_len} (prompt must be shorter)")
        if len(input_ids) + 1 > self.runner.max_total_tokens:
            raise ValueError(f"prompt is {len(input_ids)} tokens; the KV pool holds only {self.runner.max_total_tokens}")
        if pooling is not None:
            if self.pd is not None or bootstrap_room is not None:
                raise ValueError("pooling requests do not run on a prefill/decode (disaggregated) server")
            sampling_params = {"max_new_tokens": 0}
        params = sampling_params if isinstance(sampling_params, SamplingParams) else SamplingParams.from_dict(sampling_params, self.config.vocab_size, self.context_len)
        params = self._check_bootstrap_room(bootstrap_room, params)
        if params.beam_width > 1 and (stream or pooling is not None or bootstrap_room is not None):
            raise ValueError("beam_width > 1 answers with its finished beams at the end: it does not stream, pool or run on a prefill/decode pair")
        if not isinstance(return_logprob, bool):
            raise ValueError("return_logprob must be a boolean")
        if not isinstance(top_logprobs_num, int) or isinstance(top_logprobs_num, bool) or top_logprobs_num < 0:
            raise ValueError("top_logprobs_num must be an integer >= 0")
        if not isinstance(logprob_start_len, int) or isinstance(logprob_start_len, bool) or logprob_start_len < -1:
            raise ValueError("logprob_start_len must be an integer >= -1")
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise ValueError("rid must be a non-empty string")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        if rid is not None and self._rid_in_flight(cache_salt, rid):
            raise ValueError(f"rid {rid!r} is already in flight")
        self._check_priority(priority)
        lora_key = self._lora_key(lora)
        predicted = prediction_text(prediction)
        hints = check_cache_options(return_cache_info, program, prompt_cache_key, cache_ttl, retention, not self.args.disable_cache_explain)
        if cache_ttl is not None:
            hints.append((len(input_ids), float(cache_ttl)))
        req = Req(
            rid=rid or uuid.uuid4().hex,
            input_ids=list(input_ids),
            params=params,
            sink=sink,
            stream=stream,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            logprob_start_len=logprob_start_len,
            return_text_in_logprobs=return_text_in_logprobs,
            cache_salt=cache_salt,
            program=program,
            prompt_cache_key=prompt_cache_key,
            return_cache_info=return_cache_info,
            retention=hints,
            bootstrap_room=bootstrap_room,
            pooling=pooling,
            priority=priority,
            lora=lora,
            lora_key=lora_key,
        )
        if predicted:
            # indexed on the loop thread at the first step: bounded by what the output can use
            # (twice max_new_tokens leaves room for an output that drops parts of the prediction)
            keep = min(self.context_len, 2 * params.max_new_tokens + 16)
            req.prediction_ids = self.tokenizer(predicted[: self._max_text_chars], add_special_tokens=False).input_ids[:keep]
        if params.seed is not None:
            req.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        return req

    def _lora_key(self, lora: str | None) -> str | None:
        """The radix-cache key of adapter ``lora`` (None: the base model); ValueError naming ``lora``."""
        if lora is None:
            return None
        if not isinstance(lora, str) or not lora:
            raise ValueError(f"lora must be a non-empty string (an adapter's name), got {lora!r}")
        if self.runner.lora is None:
            raise ValueError(f"lora {lora!r}: this server serves no LoRA adapters (start it with --lora-paths or --enable-lora)")
        return self.runner.lora.pool.cache_key(lora)

    def _check_priority(self, priority: int) -> None:
        """Validate ``priority``: an integer, and non-zero only under ``--schedule-policy priority``."""
        if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**31) <= priority < 2**31:
            raise ValueError(f"priority must be an integer in [-2**31, 2**31), got {priority!r}")
        if priority != 0 and self.args.schedule_policy != "priority":
            raise ValueError(f"priority {priority} needs a server started with --schedule-policy priority (this one orders by {self.args.schedule_policy})")

    def _check_bootstrap_room(self, room: int | None, params: SamplingParams) -> SamplingParams:
        """Validate ``bootstrap_room``; on the prefill side the request only computes its prompt."""
        if room is None:
            return params
        if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2**63:
            raise ValueError(f"bootstrap_room must be an integer in [0, 2**63), got {room!r}")
        if self.pd is None:
            raise ValueError("bootstrap_room applies only to a server started with --disaggregation-mode prefill or decode")
        if params.n != 1:
            raise ValueError("bootstrap_room pairs one request: n must be 1")
        if self.pd.role == "prefill":  # the decode side samples, checks stops and applies the constraint
            params = dataclasses.replace(params, max_new_tokens=0, min_new_tokens=0, regex=None, json_schema=None, ebnf=None)
        return params

    def attach_grammar(self, req: Req) -> None:
        """Compile the request's constraint (off the loop thread) and give it a matcher."""
        if req.params.constraint is not None:
            compiled = self.grammars.compile(*req.params.constraint)
            req.grammar, req.constraint_warnings = self._within_budget(req, compiled.matcher()), compiled.warnings

    async def attach_grammar_async(self, req: Req) -> None:
        """The awaitable form of ``attach_grammar``."""
        if req.params.constraint is not None:
            compiled = await self.grammars.compile_async(*req.params.constraint)
            # its first mask is CPU work, and so is the budget closer's vocabulary the first time
            req.grammar = await asyncio.to_thread(lambda: self._within_budget(req, compiled.matcher()))
            req.constraint_warnings = compiled.warnings

    def _within_budget(self, req: Req, matcher: Matcher) -> Matcher:
        """``matcher``, wrapped to close its JSON in time (close_json_within_budget: by default for a JSON schema)."""
        if not req.params.closes_json_within_budget:
            return matcher
        if self._close_vocab is None:
            self._close_vocab = CloseVocab.from_tokenizer(self.tokenizer, self.config.vocab_size)
        budget = min(req.params.max_new_tokens, self.context_len - len(req.input_ids))
        return BudgetMatcher(matcher, self._close_vocab, budget)


def split_batch(prompt: Any, input_ids: Any, sampling_params: Any) -> tuple[bool, list[dict[str, Any]]]:
    """Whether the call is a batch, and one ``make_request`` argument dict per sample (prompt-major)."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt or input_ids")
    if prompt is not None:
        batch = isinstance(prompt, list)
        prompts = prompt if batch else [prompt]
        items = [{"prompt": p} for p in prompts]
    else:
        batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        items = [{"input_ids": ids} for ids in (input_ids if batch else [input_ids])]
    if batch and not items:
        raise ValueError("prompt must not be an empty list")
    if isinstance(sampling_params, list):
        if not batch or len(sampling_params) != len(items):
            raise ValueError("sampling_params as a list needs one dict per prompt")
        for item, sp in zip(items, sampling_params):
            item["sampling_params"] = sp
    else:
        for item in items:
            item["sampling_params"] = sampling_params
    samples = [{**item, "sampling_params": sp} for item in items for sp in per_sample_params(item["sampling_params"])]
    return batch, samples
