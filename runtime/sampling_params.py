"""SamplingParams: the per-request decoding settings, with SGLang's key names, validated."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.beam_search import check_beam_options
from radixlm.runtime.constrained.schema_strict import close_objects
from radixlm.runtime.stop_regex import validate_stop_regex
from radixlm.runtime.stop_strings import StopStrings


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


GREEDY_TEMPERATURE = 1e-5  # temperatures below this decode greedily (as SGLang does)
MAX_TOP_K = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts

# Bounds on what one request may make every decode step do (issue 32): each step checks a
# request's stops, stop tokens and logit_bias on the engine thread, for everyone in the batch.
MAX_STOP_STRINGS = 32  # as many as stop_regex patterns (SGLang's bound there); OpenAI takes 4
MAX_STOP_STRING_CHARS = 256  # characters in one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's bound
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range, on every route
# A repetition penalty divides positive logits by itself (multiplies negative ones): below
# about 1e-38 that overflows float32 to inf; this floor keeps it a factor of 100 at most.
REPETITION_PENALTY_RANGE = (0.01, 2.0)
MAX_N = 128  # samples of one prompt (OpenAI's bound)

# SGLang parameters that cannot apply here: each is accepted only with one of its neutral values.
UNSUPPORTED_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "structural_tag": ("",),  # xgrammar structural tags
    "custom_params": ({},),  # arguments of server-side custom logit processors
    "watermark": ({}, {"enabled": False}),  # output watermarking
}
ALIASES = {"sampling_seed": "seed"}  # SGLang's name -> ours


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; build with ``from_dict`` to validate user input."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_regex: list[str] = field(default_factory=list)
    spaces_between_special_tokens: bool = True  # passed to the tokenizer's decode (no effect on fast tokenizers)
    n: int = 1  # samples of the prompt; each sample's request carries the group's n
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    stream_interval: int | None = None  # stream an output every this many tokens (None: 1)
    seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None
    json_schema_strict: bool = True  # generate only the properties a schema declares (unless it allows others)
    close_json_within_budget: bool | None = None  # steer JSON output to close before max_new_tokens (constrained/budget.py); None: on for json_schema, off for beams
    ebnf: str | None = None
    beam_width: int = 1  # > 1: beam search with this many beams, answered by as many outputs (runtime/beam_search.py)
    length_penalty: float = 1.0  # beam scores divide by output length ** this (transformers' meaning)
    early_stopping: bool | str = False  # when beam search ends: True, False or "never" (transformers' meanings)
    # The automaton over ``stop``, built where the params are validated (off the engine loop);
    # not a request parameter (``accepted_keys`` leaves out names that begin with "_").
    _stop_strings: StopStrings | None = field(default=None, repr=False, compare=False)

    def stop_strings(self) -> StopStrings:
        """The automaton of ``stop`` (built now if the params were not validated, or changed since)."""
        stops = tuple([self.stop] if isinstance(self.stop, str) else self.stop)
        if self._stop_strings is None or self._stop_strings.stops != stops:
            self._stop_strings = StopStrings(stops)
        return self._stop_strings

    @property
    def greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, str] | None:
        """The ``(kind, spec)`` of the grammar constraint, if any."""
        for kind in ("regex", "json_schema", "ebnf"):
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return None

    @property
    def closes_json_within_budget(self) -> bool:
        """Whether the output's JSON is steered to close before ``max_new_tokens``: as asked, or
        by default for a ``json_schema`` constraint (beams end on the grammar's end or the budget)."""
        if self.close_json_within_budget is not None:
            return self.close_json_within_budget
        return self.json_schema is not None and self.beam_width == 1

    @property
    def has_penalties(self) -> bool:
        """True when any repetition-style penalty is active."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None, vocab_size: int | None = None, context_len: int | None = None) -> SamplingParams:
        """Validate user-supplied sampling parameters; raises ValueError naming the bad key.

        ``context_len``, when known, bounds ``max_new_tokens`` to what a context can hold.
        """
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(params).__name__}")
        known = accepted_keys()
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter {unknown[0]!r} (known: {', '.join(sorted(known))})")
        params = _resolve_aliases(params)
        for name, neutral in UNSUPPORTED_NEUTRAL.items():
            value = params.pop(name, None)
            if value is not None and not any(_same(value, v) for v in neutral):
                shown = ", ".join(["null"] + [json.dumps(v) for v in neutral])
                raise ValueError(f"{name} is not supported by radixlm; it takes only its neutral value ({shown}), got {value!r}")
        sp = cls(**{k: v for k, v in params.items() if v is not None})
        sp._normalize()
        sp.validate(vocab_size, context_len)
        sp._close_schema()
        if sp.stop:
            sp.stop_strings()
        return sp

    def _normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        if isinstance(self.logit_bias, dict) and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in self.logit_bias):
            self.logit_bias = _parse_logit_bias(self.logit_bias)
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            if _is_int(getattr(self, name)):
                setattr(self, name, float(getattr(self, name)))
        if _is_number(self.temperature) and 0 < self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0  # 1/T would overflow: such a temperature is greedy anyway

    def _close_schema(self) -> None:
        """Strict generation: the schema compiled is closed to its declared properties."""
        if self.json_schema is None or not self.json_schema_strict:
            return
        try:
            schema = json.loads(self.json_schema)
        except json.JSONDecodeError:
            return  # the grammar compiler names the error
        closed = close_objects(schema)
        if closed != schema:
            self.json_schema = json.dumps(closed, ensure_ascii=False)

    def validate(self, vocab_size: int | None = None, context_len: int | None = None) -> None:
        """Raise ValueError naming the first invalid field."""
        checks_int = {"max_new_tokens": 0, "min_new_tokens": 0}
        for name, lo in checks_int.items():
            v = getattr(self, name)
            if not _is_int(v):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            if v < lo:
                raise ValueError(f"{name} must be >= {lo}, got {v}")
        if context_len is not None and self.max_new_tokens > context_len - 1:
            raise ValueError(f"max_new_tokens: this model's maximum context length is {context_len} tokens; you asked for {self.max_new_tokens} to generate, more than any prompt leaves room for (at most {context_len - 1})")
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or in [1, {MAX_TOP_K}], got {self.top_k}")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not _is_number(value):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise ValueError(f"repetition_penalty must be in [{lo:g}, {hi:g}], got {self.repetition_penalty}")
        self._validate_stop()
        if isinstance(self.stop_token_ids, list) and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids (MAX_STOP_TOKEN_IDS), got {len(self.stop_token_ids)}")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be < the vocabulary size {vocab_size}")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "json_schema_strict"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.close_json_within_budget is not None and not isinstance(self.close_json_within_budget, bool):
            raise ValueError(f"close_json_within_budget must be a boolean or null, got {self.close_json_within_budget!r}")
        if self.seed is not None and not (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed!r}")
        self._validate_extras(vocab_size)
        given = [k for k in ("regex", "json_schema", "ebnf") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of regex, json_schema, ebnf (got {', '.join(given)})")
        for name in given:
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string" + (" or a dict" if name == "json_schema" else ""))
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens ({self.max_new_tokens})")
        self._validate_beams()

    def _validate_beams(self) -> None:
        if _is_int(self.length_penalty):
            self.length_penalty = float(self.length_penalty)
        check_beam_options(self.beam_width, self.length_penalty, self.early_stopping)
        if self.beam_width == 1:
            return
        if self.n != 1:
            raise ValueError(f"n must be 1 with beam_width > 1 (beam search answers beam_width outputs), got {self.n}")
        if self.close_json_within_budget:
            raise ValueError("close_json_within_budget does not apply to beam_width > 1 (beams end on the grammar's end or the budget)")
        if self.has_penalties or self.logit_bias:
            raise ValueError("beam_width > 1 ranks beams by the model's log-probabilities: frequency_penalty, presence_penalty, repetition_penalty and logit_bias must keep their neutral values")

    def _validate_stop(self) -> None:
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings (MAX_STOP_STRINGS), got {len(self.stop)}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        longest = max(self.stop, key=len, default="")
        if len(longest) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings are at most {MAX_STOP_STRING_CHARS} characters (MAX_STOP_STRING_CHARS), got one of {len(longest)}")

    def _validate_extras(self, vocab_size: int | None) -> None:
        """SGLang's further parameters: n, stop_regex, logit_bias, stream_interval, spaces."""
        _check_n(self.n)
        self.stop_regex = validate_stop_regex(self.stop_regex)
        if not isinstance(self.spaces_between_special_tokens, bool):
            raise ValueError(f"spaces_between_special_tokens must be a boolean, got {self.spaces_between_special_tokens!r}")
        if self.stream_interval is not None and not (_is_int(self.stream_interval) and self.stream_interval >= 1):
            raise ValueError(f"stream_interval must be an integer >= 1, got {self.stream_interval!r}")
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias, vocab_size)


def _check_n(n: Any) -> None:
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise ValueError(f"n must be an integer in [1, {MAX_N}], got {n!r}")


def _check_logit_bias(bias: Any, vocab_size: int | None) -> None:
    if isinstance(bias, dict) and len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens (MAX_LOGIT_BIAS_ENTRIES), got {len(bias)}")
    if not isinstance(bias, dict) or not all(_is_int(k) for k in bias):
        raise ValueError("logit_bias must map token ids (integers, as strings in JSON) to numbers")
    lo, hi = LOGIT_BIAS_RANGE
    for token, value in bias.items():
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise ValueError(f"logit_bias has token id {token}, outside the vocabulary [0, {vocab_size})")
        if not _is_number(value) or not math.isfinite(value):
            raise ValueError(f"logit_bias for token {token} must be a finite number, got {value!r}")
        if not lo <= value <= hi:
            raise ValueError(f"logit_bias for token {token} must be in [{lo:g}, {hi:g}], got {value!r}")


def accepted_keys() -> set[str]:
    """Every key ``SamplingParams.from_dict`` takes: our fields, SGLang's aliases and neutral-only names."""
    return {f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")} | set(ALIASES) | set(UNSUPPORTED_NEUTRAL)


def requested_n(params: dict[str, Any] | SamplingParams | None) -> Any:
    """The ``n`` one prompt's params ask for, as given (1 when absent), read without building anything."""
    if isinstance(params, SamplingParams):
        return params.n
    if isinstance(params, dict) and params.get("n") is not None:
        return params["n"]
    return 1  # no params, or not a dict (``from_dict`` refuses that by name)


def per_sample_params(params: dict[str, Any] | SamplingParams | None) -> list[dict[str, Any] | SamplingParams | None]:
    """The params of each of a prompt's ``n`` samples (sample j seeded seed + j); ValueError naming n."""
    n = requested_n(params)
    _check_n(n)
    if n == 1:
        return [params]
    if isinstance(params, SamplingParams):
        return [params if params.seed is None else dataclasses.replace(params, seed=params.seed + j) for j in range(n)]
    out: list[dict[str, Any] | SamplingParams | None] = []
    for j in range(n):
        copy = dict(params)  # type: ignore[arg-type]
        for key in ("seed", "sampling_seed"):
            if _is_int(copy.get(key)):
                copy[key] += j
        out.append(copy)
    return out


def _resolve_aliases(params: dict[str, Any]) -> dict[str, Any]:
    params = dict(params)
    for alias, ours in ALIASES.items():
        value = params.pop(alias, None)
        if value is None:
            continue
        if params.get(ours) is not None and not _same(params[ours], value):
            raise ValueError(f"{alias} ({value!r}) and {ours} ({params[ours]!r}) name the same setting; give one, or equal values")
        params[ours] = value
    return params


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same JSON kind (True is not 1)."""
    return type(a) is type(b) and a == b


def _parse_logit_bias(bias: dict[str | int, Any]) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for key, value in bias.items():
        if isinstance(key, str):
            try:
                token = int(key.strip())
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        else:
            token = key
        out[token] = value
    return out
