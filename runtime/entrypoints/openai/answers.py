"""What chat and completion answers share: finish reasons, usage, final info, logprob entries."""

from __future__ import annotations

from typing import Any

from radixlm.runtime.entrypoints.openai.plan import Plan
from radixlm.runtime.request import ReqOutput


def answer_usage(plan: Plan, outs: list[ReqOutput]) -> dict[str, Any]:
    """The ``usage`` object of an answer: token counts, cache hits, prediction and speculation."""
    prompt = sum(len(p) for p in plan.prompts)
    completion = sum(o.meta_info["completion_tokens"] for o in outs)
    cached = sum(o.meta_info["cached_tokens"] for o in outs[:: plan.n]) if outs else 0
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}
    tiered = [o.meta_info["cached_tokens_details"] for o in outs[:: plan.n] if "cached_tokens_details" in o.meta_info]
    if tiered:  # KV tiers on: the cached tokens split by the tier they came from
        usage["prompt_tokens_details"]["cached_tokens_details"] = {t: sum(d[t] for d in tiered) for t in ("device", "host", "disk")}
    if plan.prediction is not None:
        usage["completion_tokens_details"] = {name: sum(o.meta_info.get(name, 0) for o in outs) for name in ("accepted_prediction_tokens", "rejected_prediction_tokens")}
    passes = sum(o.meta_info.get("spec_verify_passes", 0) for o in outs)
    if passes:  # speculation ran (extra fields, as meta_info names them)
        usage["spec_verify_passes"] = passes
        usage["spec_draft_tokens"] = sum(o.meta_info.get("spec_draft_tokens", 0) for o in outs)
        usage["spec_accepted_tokens"] = sum(o.meta_info.get("spec_accepted_tokens", 0) for o in outs)
        usage["spec_accept_length"] = usage["spec_accepted_tokens"] / passes
    return usage


def finish_reason(plan: Plan, out: ReqOutput, has_calls: bool) -> str | None:
    """OpenAI's ``finish_reason`` for an output (None while it runs)."""
    fr = out.meta_info["finish_reason"]
    if fr is None:
        return None
    if has_calls and (fr["type"] != "length" or fr.get("closed_within_budget")):  # calls then a cut one (auto): "length", the whole ones kept
        return "tool_calls"  # whole calls, also when the budget closer shortened them
    if fr["type"] == "abort":
        return "abort"
    return "length" if fr["type"] == "length" else "stop"


def with_final_info(plan: Plan, out: ReqOutput, choice: dict[str, Any]) -> dict[str, Any]:
    """Add to a finished request's choice its cache explanation (when the client asked for it)
    and what its constraint does not enforce (``constraint_warnings``, e.g. an ignored format)."""
    if plan.return_cache_info and out.finished and "cache_info" in out.meta_info:
        choice["cache_info"] = out.meta_info["cache_info"]
    if out.finished and out.meta_info.get("constraint_warnings"):
        choice["constraint_warnings"] = out.meta_info["constraint_warnings"]
    return choice


def token_entries(out: ReqOutput, echo: bool) -> tuple[list, list]:
    """(logprob entry, top alternatives) of each output token, the prompt's first when ``echo``."""
    meta = out.meta_info
    entries = list(meta.get("output_token_logprobs", []))
    tops = list(meta.get("output_top_logprobs", [None] * len(entries)))
    if echo:
        entries = list(meta.get("input_token_logprobs", [])) + entries
        tops = list(meta.get("input_top_logprobs", [None] * len(meta.get("input_token_logprobs", [])))) + tops
    return entries, tops

