"""OpenAI ``/v1/completions``: planning a text completion and shaping its choices."""

from __future__ import annotations

from typing import Any

from radixlm.runtime.entrypoints.http.beams import beam_sampling
from radixlm.runtime.entrypoints.http.common import ServerState
from radixlm.runtime.entrypoints.http.errors import APIError
from radixlm.runtime.entrypoints.openai.answers import finish_reason, token_entries, with_final_info
from radixlm.runtime.entrypoints.openai.plan import (
    Plan,
    predicted_text,
    sampling_params,
    tokenize_prompt,
)
from radixlm.runtime.entrypoints.openai.protocol import CompletionRequest
from radixlm.runtime.request import ReqOutput


def plan_completion(state: ServerState, body: CompletionRequest) -> Plan:
    """The plan of a ``/v1/completions`` request (its prompts tokenized and checked)."""
    engine = state.engine
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    p = body.prompt
    if isinstance(p, str):
        texts = [p]
    elif p and all(isinstance(x, int) for x in p):
        texts = [None]
        p = [p]
    elif p and all(isinstance(x, str) for x in p):
        texts = list(p)
    elif p and all(isinstance(x, list) for x in p):
        texts = [None] * len(p)
    else:
        raise APIError(400, "prompt must be a non-empty string, list of strings, or token ids", param="prompt")
    state.check_fits(len(texts) * body.n, "n" if body.n > 1 else "prompt")  # before any prompt is tokenized
    prompts = []
    for i, t in enumerate(texts):
        ids = tokenize_prompt(engine, t, "prompt") if t is not None else list(p[i])
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        bad = [x for x in ids if not 0 <= x < engine.config.vocab_size]
        if bad:
            raise APIError(400, f"prompt token {bad[0]} is outside the vocabulary", param="prompt")
        prompts.append(ids)
    texts = [t if t is not None else engine.tokenizer.decode(ids) for t, ids in zip(texts, prompts)]
    sampling = sampling_params(state, body, body.max_tokens, max(len(x) for x in prompts))
    if body.use_beam_search:
        if body.stream:
            raise APIError(400, "use_beam_search answers once its beams end: it does not stream", param="stream")
        if body.logprobs is not None:
            raise APIError(400, "logprobs is not supported with use_beam_search", param="logprobs")
        sampling = beam_sampling(sampling, body.n, body.length_penalty, body.early_stopping)
    elif body.length_penalty is not None or body.early_stopping is not None:
        raise APIError(400, "length_penalty and early_stopping apply only with use_beam_search", param="length_penalty" if body.length_penalty is not None else "early_stopping")
    return Plan(False, body.model or state.model_name, prompts, texts, sampling, body.n, body.stream, bool(body.stream_options and body.stream_options.include_usage), body.logprobs, echo=body.echo, cache_salt=body.cache_salt, prompt_cache_key=body.prompt_cache_key, return_cache_info=body.return_cache_info, prediction=predicted_text(body), bootstrap_room=body.bootstrap_room, priority=body.priority, beam=body.use_beam_search)


def completion_choice(plan: Plan, index: int, out: ReqOutput) -> dict[str, Any]:
    """The ``choices`` entry of a finished completion (after the prompt, when echoed)."""
    text = out.text
    if plan.echo:
        text = plan.prompt_texts[index // plan.n] + text
    choice = {"index": index, "text": text, "finish_reason": finish_reason(plan, out, False), "logprobs": completion_logprobs(plan, out) if plan.logprobs is not None else None}
    return with_final_info(plan, out, choice)


def completion_logprobs(plan: Plan, out: ReqOutput) -> dict[str, Any]:
    """A completion choice's ``logprobs`` object (tokens, values, top maps, text offsets)."""
    entries, tops = token_entries(out, plan.echo)
    tokens, values, top_maps, offsets = [], [], [], []
    offset = 0
    for (lp, _, tok), top in zip(entries, tops):
        tokens.append(tok)
        values.append(lp)
        top_maps.append({t: v for v, _, t in top} if top else None)
        offsets.append(offset)
        offset += len(tok or "")
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top_maps, "text_offset": offsets}

