"""EngineBackend: prompt programs on an in-process ``radixlm.Engine`` (no server, no HTTP)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from radixlm.lang.backend.base import Backend, BackendError
from radixlm.runtime.engine import Engine, EngineError
from radixlm.runtime.tokenizer import apply_chat_template


class EngineBackend(Backend):
    """Runs programs on an Engine in this process; pass one, or engine arguments to create one."""

    def __init__(self, engine: Engine | None = None, **engine_args: Any) -> None:
        super().__init__()
        if engine is not None and engine_args:
            raise ValueError("give an engine or engine arguments, not both")
        self.owns_engine = engine is None
        self.engine = engine if engine is not None else Engine(**engine_args)

    def generate(self, text: str, sampling_params: dict[str, Any], **logprob_options: Any) -> dict[str, Any]:
        """Complete ``text``; returns the final ``{"text", "meta_info"}``."""
        try:
            out = self.engine.generate(prompt=text, sampling_params=sampling_params, **logprob_options)
        except EngineError as exc:
            raise BackendError(str(exc)) from exc
        self.token_usage.add_outputs(out)
        return out

    def generate_stream(self, text: str, sampling_params: dict[str, Any], **logprob_options: Any) -> Iterator[dict[str, Any]]:
        """Cumulative outputs of one streamed request."""
        out = None
        try:
            for out in self.engine.generate(prompt=text, sampling_params=sampling_params, stream=True, **logprob_options):
                yield out
        except EngineError as exc:
            raise BackendError(str(exc)) from exc
        if out is not None:
            self.token_usage.add_outputs(out)

    def prefill(self, input_ids: list[list[int]], logprob_start_len: int, lora: str | None = None) -> list[dict[str, Any]]:
        """Prompt-only batch with prompt logprobs from ``logprob_start_len`` (under the adapter ``lora``)."""
        try:
            outs = self.engine.generate(input_ids=input_ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=logprob_start_len, lora=lora)
        except EngineError as exc:
            raise BackendError(str(exc)) from exc
        self.token_usage.add_outputs(outs)
        return outs

    def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text."""
        return [self.engine.tokenize(t, add_special_tokens=add_special_tokens) for t in texts]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """Render messages with the engine's tokenizer."""
        return apply_chat_template(self.engine.tokenizer, messages, add_generation_prompt=add_generation_prompt)

    def flush_cache(self) -> bool:
        """Empty the engine's radix cache."""
        return self.engine.flush_cache()

    def shutdown(self) -> None:
        """Stop the engine if this backend created it."""
        if self.owns_engine:
            self.engine.shutdown()
