"""The Engine's pooling API: embeddings and relevance scores, through the same scheduler and
radix cache as generation (``runtime/pooling.py`` says what each mode computes and caches)."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable
from functools import cached_property
from typing import Any

from radixlm.runtime.engine.results import async_sink, await_final, wait_final
from radixlm.runtime.pooling import PoolingConfig, PoolingTask, load_pooling_config, normalize
from radixlm.runtime.request import Req, ReqOutput
from radixlm.runtime.rerank_prompt import rerank_input_ids, yes_no_ids

EmbedInput = str | list[str] | list[int] | list[list[int]]


def split_inputs(value: Any, name: str = "input") -> tuple[bool, list[dict[str, Any]]]:
    """Whether ``value`` is a batch, and one ``prompt``/``input_ids`` dict per text (ValueError naming ``name``)."""
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{name} must not be an empty string")
        return False, [{"prompt": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name} must be a string, a list of strings, a list of token ids or a list of lists of token ids (not empty)")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return False, [{"input_ids": list(value)}]
    items = []
    for i, v in enumerate(value):
        if isinstance(v, str) and v:
            items.append({"prompt": v})
        elif isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            items.append({"input_ids": list(v)})
        else:
            raise ValueError(f"{name}[{i}] must be a non-empty string or a non-empty list of token ids")
    return True, items


class PoolingIntake:
    """Builds pooling requests and offers ``embed`` / ``score`` (mixed into ``Engine``)."""

    make_request: Callable[..., Req]
    submit: Callable[[Req], None]
    tokenizer: Any
    model_path: str

    @cached_property
    def pooling_config(self) -> PoolingConfig:
        """How this model pools (``--pooling``, its sentence-transformers files, else last token)."""
        return load_pooling_config(self.model_path, self.config.hidden_size, self.args.pooling, self.args.matryoshka_dims)

    @cached_property
    def score_ids(self) -> tuple[int, int]:
        """The ("yes", "no") token ids scores compare (ValueError when the tokenizer lacks them)."""
        return yes_no_ids(self.tokenizer)

    def embedding_request(self, sink: Callable[[ReqOutput], None], item: dict[str, Any], **kwargs: Any) -> Req:
        """A pooling request for one text or id list (``split_inputs``'s item)."""
        return self.make_request(sink, **item, pooling=PoolingTask(self.pooling_config.mode), **kwargs)

    def score_request(self, sink: Callable[[ReqOutput], None], query: str, document: str, instruction: str | None = None, **kwargs: Any) -> Req:
        """A scoring request for one (query, document) pair in Qwen3-Reranker's template."""
        yes, no = self.score_ids
        for name, text in (("query", query), ("documents", document), ("instruction", instruction or "x")):
            if not isinstance(text, str):
                raise ValueError(f"{name} must be a string")
            self.tokenize_check(text, name)
        ids = rerank_input_ids(self.tokenizer, query, document, instruction)
        return self.make_request(sink, input_ids=ids, pooling=PoolingTask("score", (yes, no)), **kwargs)

    def tokenize_check(self, text: str, name: str) -> None:
        """Refuse (naming ``name``) a text longer than any context could hold, before tokenizing it."""
        if len(text) > self._max_text_chars:
            raise ValueError(f"{name} is {len(text):,} characters, more than the context length ({self.context_len} tokens) can hold")

    async def start_pooling(self, build: Callable[[Callable[[ReqOutput], None]], Req]) -> tuple[Req, asyncio.Queue]:
        """Build (off the event loop: tokenizing is CPU work) and queue one pooling request."""
        q: asyncio.Queue = asyncio.Queue()
        sink = async_sink(asyncio.get_running_loop(), q)
        req = await asyncio.to_thread(build, sink)
        self.submit(req)
        return req, q

    # ------------------------------------------------------------------ public API
    def embed(self, input: EmbedInput, dimensions: int | None = None, cache_salt: str | None = None) -> list[float] | list[list[float]]:
        """L2-normalised embeddings of a text, a list of texts, an id list or a list of id lists
        (a list of vectors for a list); ``dimensions``: Matryoshka truncation, where allowed."""
        self.pooling_config.check_dimensions(dimensions)
        batch, items = split_inputs(input)
        queues = [queue.Queue() for _ in items]
        reqs = [self.embedding_request(q.put, item, cache_salt=cache_salt) for q, item in zip(queues, items)]
        for req in reqs:
            self.submit(req)
        vecs = [_answer(wait_final(q, self._loop), dimensions) for q in queues]
        return vecs if batch else vecs[0]

    async def async_embed(self, input: EmbedInput, dimensions: int | None = None, cache_salt: str | None = None) -> list[float] | list[list[float]]:
        """The asyncio form of ``embed``."""
        self.pooling_config.check_dimensions(dimensions)
        batch, items = split_inputs(input)
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in items]
        reqs = [self.embedding_request(async_sink(loop, q), item, cache_salt=cache_salt) for q, item in zip(queues, items)]
        for req in reqs:
            self.submit(req)
        vecs = [_answer(await await_final(q), dimensions) for q in queues]
        return vecs if batch else vecs[0]

    def score(self, query: str, documents: str | list[str], instruction: str | None = None, cache_salt: str | None = None) -> float | list[float]:
        """Relevance P(yes) of each document to ``query`` (Qwen3-Reranker's template; one forward a pair)."""
        docs = _documents(documents)
        queues = [queue.Queue() for _ in docs]
        reqs = [self.score_request(q.put, query, d, instruction, cache_salt=cache_salt) for q, d in zip(queues, docs)]
        for req in reqs:
            self.submit(req)
        scores = [_answer(wait_final(q, self._loop))[0] for q in queues]
        return scores if isinstance(documents, list) else scores[0]

    async def async_score(self, query: str, documents: str | list[str], instruction: str | None = None, cache_salt: str | None = None) -> float | list[float]:
        """The asyncio form of ``score``."""
        docs = _documents(documents)
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in docs]
        reqs = [self.score_request(async_sink(loop, q), query, d, instruction, cache_salt=cache_salt) for q, d in zip(queues, docs)]
        for req in reqs:
            self.submit(req)
        scores = [_answer(await await_final(q))[0] for q in queues]
        return scores if isinstance(documents, list) else scores[0]


def _documents(documents: Any) -> list[str]:
    docs = documents if isinstance(documents, list) else [documents]
    if not docs or not all(isinstance(d, str) for d in docs):
        raise ValueError("documents must be a string or a non-empty list of strings")
    return docs


def _answer(out: ReqOutput, dimensions: int | None = None) -> list[float]:
    """The pooled answer of a final output (RuntimeError carrying the engine's message when it failed)."""
    if out.pooled is None:
        fr = out.meta_info.get("finish_reason") or {}
        raise RuntimeError(fr.get("message") or "the pooling request failed")
    return normalize_to(out.pooled, dimensions)


def normalize_to(vec: list[float], dimensions: int | None) -> list[float]:
    """``vec`` cut to ``dimensions`` and renormalised (unchanged without ``dimensions``)."""
    if dimensions is None or dimensions >= len(vec):
        return vec
    import torch

    return normalize(torch.tensor(vec), dimensions)
