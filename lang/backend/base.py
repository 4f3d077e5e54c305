"""The backend interface: what the interpreter needs from a radixlm runtime."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from radixlm.lang.chat_template import ChatTemplate


class BackendError(RuntimeError):
    """The runtime failed or could not be reached (not a problem with the request itself)."""


@dataclass
class TokenUsage:
    """Tokens a backend's requests have used so far (``backend.token_usage``); thread-safe."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, prompt_tokens: int = 0, completion_tokens: int = 0, cached_tokens: int = 0) -> None:
        """Count one request."""
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.cached_tokens += cached_tokens
            self.requests += 1

    def add_outputs(self, outputs: Any) -> None:
        """Count the final ``{"text", "meta_info"}`` output(s) of radixlm requests."""
        for out in outputs if isinstance(outputs, list) else [outputs]:
            meta = out.get("meta_info") or {}
            self.add(meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0), meta.get("cached_tokens", 0))

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens

    def snapshot(self) -> dict[str, int]:
        """The counts now, as a dict."""
        with self._lock:
            return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens, "requests": self.requests}

    def reset(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self.prompt_tokens = self.completion_tokens = self.cached_tokens = self.requests = 0


class Backend(ABC):
    """Runs the requests of prompt programs on one radixlm runtime.

    Contract, for every implementation:

    - Methods are called from many threads at once (each program state and each fork branch
      runs on its own thread); they must be thread-safe and block only their caller.
    - A request the runtime refuses (bad sampling parameter, uncompilable regex or schema, prompt
      too long) raises ``ValueError`` with the runtime's message; a runtime that fails or cannot
      be reached raises ``BackendError``. No method waits forever on a runtime that has died.
    - Results use the runtime's ``/generate`` shape: ``{"text", "meta_info"}`` where ``meta_info``
      has ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` and ``finish_reason``, and
      ``input_token_logprobs`` (``(logprob, token_id, text)`` triples) when logprobs were asked.
    - Texts are tokenized by the runtime the way ``/generate`` tokenizes them (special tokens
      added), so ``tokenize`` and ``generate`` agree on token boundaries.
    - With ``sampling_params["n"] = k > 1``, ``generate`` returns a list of k such results.
    - ``lora`` (on ``generate``, ``generate_stream``, ``prefill`` and ``cache_prefix``) names the
      LoRA adapter the request runs with; it is passed only when set, so a backend without
      adapters may leave it out of its signatures (a program that names one is then refused).
    - Every request's final output is counted in ``token_usage``.
    """

    def __init__(self) -> None:
        self._template: ChatTemplate | None = None
        self._template_lock = threading.Lock()
        self.token_usage = TokenUsage()

    @abstractmethod
    def generate(
        self,
        text: str,
        sampling_params: dict[str, Any],
        *,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        return_text_in_logprobs: bool = False,
        lora: str | None = None,
    ) -> dict[str, Any]:
        """Complete ``text`` with SGLang's sampling parameters (``lora``: the adapter's name); returns the final ``{"text", "meta_info"}``."""

    @abstractmethod
    def generate_stream(self, text: str, sampling_params: dict[str, Any], **logprob_options: Any) -> Iterator[dict[str, Any]]:
        """Like ``generate``, yielding ``{"text", "meta_info"}`` with the text so far; the last is final."""

    @abstractmethod
    def prefill(self, input_ids: list[list[int]], logprob_start_len: int, lora: str | None = None) -> list[dict[str, Any]]:
        """Run prompts without generating (one batch, under the adapter ``lora``), returning prompt logprobs from ``logprob_start_len``."""

    @abstractmethod
    def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, as the runtime tokenizes it."""

    @abstractmethod
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """Render chat messages with the model's chat template."""

    @abstractmethod
    def flush_cache(self) -> bool:
        """Empty the runtime's radix cache; False when it refused (requests in flight)."""

    def cache_prefix(self, text: str, lora: str | None = None) -> dict[str, Any]:
        """Prefill ``text`` with no new tokens so that requests extending it (under the same adapter ``lora``) hit the cache."""
        return self.generate(text, {"max_new_tokens": 0}, **({"lora": lora} if lora is not None else {}))

    def get_chat_template(self) -> ChatTemplate:
        """The model's role markers, probed once and kept."""
        with self._template_lock:
            if self._template is None:
                self._template = ChatTemplate.probe(self.apply_chat_template, self.tokenize)
            return self._template

    @abstractmethod
    def shutdown(self) -> None:
        """Release what the backend holds (connections, a child server, an engine it created)."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
