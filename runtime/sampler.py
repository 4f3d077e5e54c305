"""Batched token sampling: masks, penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

Order per step (as in SGLang): grammar mask → stop-token mask for ``min_new_tokens`` →
logit_bias → penalties → temperature → top-k → top-p → min-p → sample. Greedy rows take the argmax of the
processed logits. Logprobs are those of the model's raw distribution.

A row that cannot be sampled is reported, not picked: NaN or +inf in its processed logits (its
logit_bias, penalties or temperature overflowed), or no token left that its bans allow (a grammar
that allows nothing is the grammar's refusal, which the decoder reports; that row is picked as
before). Its entry in ``SampleResult.failed`` says why; the other rows are untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from radixlm.runtime.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request this step."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generator: torch.Generator | None
    banned_ids: Sequence[int]  # ids that may not be sampled yet (min_new_tokens)
    want_logprob: bool
    top_logprobs_num: int
    masked_tops: bool = False  # top alternatives only among the tokens the row's mask allows (beam search)


@dataclass
class SampleResult:
    """Chosen tokens and, for rows that asked, their logprobs and top alternatives."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[float, int]] | None]
    failed: list[str | None] = field(default_factory=list)  # per row: why it could not be sampled (or None)

    def failure(self, i: int) -> str | None:
        """Why row ``i`` could not be sampled, or None when its token stands."""
        return self.failed[i] if i < len(self.failed) else None


NON_FINITE = "sampling failed: this request's logits became NaN or infinite after its logit_bias, penalties or temperature"
NOTHING_ALLOWED = "sampling failed: every token is banned for this request (stop_token_ids with min_new_tokens?)"


def unsampleable(logits: torch.Tensor, allowed_mask: torch.Tensor | None) -> torch.Tensor:
    """Codes per row of processed ``logits`` ``[B, V]``: 0 usable, 1 NaN or +inf, 2 nothing
    allowed by its bans (rows whose grammar ``allowed_mask`` allows nothing count as usable)."""
    top = logits.amax(dim=-1)  # NaN when any entry is NaN (amax: one pass, no indices)
    broken = torch.isnan(top) | (top == float("inf"))
    empty = top == float("-inf")
    if allowed_mask is not None:
        empty &= allowed_mask.any(dim=-1)
    return torch.where(broken, 1, torch.where(empty, 2, 0))


def _messages(codes: list[int]) -> list[str | None]:
    return [None if c == 0 else NON_FINITE if c == 1 else NOTHING_ALLOWED for c in codes]


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Frequency/presence penalties on output tokens and repetition penalty on all seen tokens."""
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        if (p.frequency_penalty or p.presence_penalty) and row.output_ids:
            out = torch.tensor(row.output_ids, dtype=torch.int64, device=logits.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(list(row.prompt_ids) + list(row.output_ids), dtype=torch.int64, device=logits.device)
            seen = torch.unique(seen[seen < vocab])
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Add each row's ``logit_bias`` ({token id: bias}) to its logits (masked tokens stay -inf)."""
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.int64, device=logits.device)
            logits[i].index_add_(0, ids, torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device))


def _filter_top_k_top_p_min_p(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Set filtered-out entries of temperature-scaled logits to -inf; returns probabilities."""
    device = logits.device
    top_k = torch.tensor([min(r.params.top_k, logits.shape[-1]) if r.params.top_k > 0 else logits.shape[-1] for r in rows], device=device)
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype, device=device)
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=logits.dtype, device=device)
    probs = torch.softmax(logits, dim=-1)
    need_sort = bool((top_k < logits.shape[-1]).any() or (top_p < 1).any())
    if need_sort:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=device)[None, :]
        cumulative = sorted_probs.cumsum(dim=-1)
        # keep a token while the mass before it is below top_p (the top token always stays)
        drop = (ranks >= top_k[:, None]) | ((cumulative - sorted_probs) > top_p[:, None])
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    if bool((min_p > 0).any()):
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _prepare(logits: torch.Tensor, rows: Sequence[SamplingRow], allowed_mask: torch.Tensor | None) -> torch.Tensor:
    """Masked, banned and penalized copy of ``logits``."""
    logits = logits.clone()
    if allowed_mask is not None:
        logits.masked_fill_(~allowed_mask, float("-inf"))
    for i, row in enumerate(rows):
        if row.banned_ids:
            logits[i, list(row.banned_ids)] = float("-inf")
    apply_logit_bias(logits, rows)
    apply_penalties(logits, rows)
    return logits


def sample(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    default_generator: torch.Generator | None = None,
    allowed_mask: torch.Tensor | None = None,
    recheck: Callable[[int, int], torch.Tensor | None] | None = None,
) -> SampleResult:
    """Pick one token per row of ``logits`` ``[B, V]`` (fp32); ``allowed_mask`` is bool ``[B, V]``.

    ``recheck(i, token)``, for rows picked without their grammar mask (lazy masking): None when
    row ``i``'s grammar takes ``token``, else the row's allowed mask (bool ``[V]``), under which
    the row is picked again with the same noise. For greedy rows and rows without top-k, top-p
    or min-p (``exact_without_mask``) that is the token masked sampling picks: the winner of the
    race ``p_i / E_i`` over the whole vocabulary, if allowed, wins it over the allowed tokens.
    """
    raw = logits
    logits = _prepare(logits, rows, allowed_mask)
    codes = unsampleable(logits, allowed_mask)

    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    random = [i for i, r in enumerate(rows) if not r.params.greedy]
    tokens = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
    if len(greedy) == len(rows):  # every row greedy: no copy of the rows
        tokens = logits.argmax(dim=-1)
    elif greedy:
        idx = torch.tensor(greedy, device=logits.device)
        tokens[idx] = logits.index_select(0, idx).argmax(dim=-1)
    probs = noise = None
    if random:
        idx = torch.tensor(random, device=logits.device)
        sub_rows = [rows[i] for i in random]
        probs = _sampling_probs(logits.index_select(0, idx), sub_rows)
        tokens[idx], noise = _draw(probs, sub_rows, default_generator)
        # temperature can overflow what was finite: its row's probabilities are then all NaN
        codes[idx] = torch.where((codes[idx] == 0) & torch.isnan(probs.sum(dim=-1)), 1, codes[idx])
    failed = _messages(codes.tolist())
    if recheck is not None:
        where = {i: j for j, i in enumerate(random)}
        for i, token in enumerate(tokens.tolist()):
            if failed[i] is not None:
                continue  # its grammar must not take a token that was never really picked
            mask = recheck(i, token)
            if mask is None:
                continue
            mask = mask.to(logits.device)
            if i in where:
                j = where[i]
                tokens[i] = (probs[j].masked_fill(~mask, 0.0) / noise[j]).argmax()
            else:
                tokens[i] = logits[i].masked_fill(~mask, float("-inf")).argmax()

    result = _with_logprobs(raw, tokens, rows, allowed_mask)
    result.failed = failed
    return result


def exact_without_mask(params: SamplingParams) -> bool:
    """True when picking first and masking only a refused pick gives the masked pick exactly:
    greedy, or temperature alone (top-k, top-p and min-p depend on what the mask leaves)."""
    return params.greedy or (params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0)


def _sampling_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The distribution sampled rows draw from: temperature, then top-k/top-p/min-p."""
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=logits.device)
    return _filter_top_k_top_p_min_p(logits / temps[:, None], rows)


def _draw(probs: torch.Tensor, rows: Sequence[SamplingRow], default_generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One index per row of ``probs`` ``[B, V]``, drawn with the row's generator (else the
    default), and the noise the draw used."""
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws index i with probability p_i.
    noise = torch.empty_like(probs)
    shared = [j for j, r in enumerate(rows) if r.generator is None]
    if shared:
        noise[shared] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(generator=default_generator)
    for j, r in enumerate(rows):
        if r.generator is not None:
            noise[j].exponential_(generator=r.generator)
    return (probs / noise).argmax(dim=-1), noise


def sample_draft(
    logits: torch.Tensor, rows: Sequence[SamplingRow], default_generator: torch.Generator | None = None
) -> tuple[list[int], torch.Tensor | None]:
    """Draft tokens from a draft model's ``logits`` ``[B, V]`` and the distribution q of each.

    Rows use their own settings (penalties, temperature, top-k/top-p/min-p; no grammar mask):
    greedy rows take the argmax and get a point mass as q, sampled rows draw from q with their
    generator. Returns the tokens and q (float32 ``[B, V]``), or None for q when every row is greedy.
    """
    logits = _prepare(logits, rows, None)
    tokens = logits.argmax(dim=-1)
    random = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not random:
        return tokens.tolist(), None
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    probs[torch.arange(len(rows), device=logits.device), tokens] = 1.0
    idx = torch.tensor(random, device=logits.device)
    sub_rows = [rows[i] for i in random]
    sub_probs = _sampling_probs(logits.index_select(0, idx), sub_rows).float()
    tokens[idx] = _draw(sub_probs, sub_rows, default_generator)[0]
    probs[idx] = sub_probs
    return tokens.tolist(), probs


def accept_draft(
    logits: torch.Tensor,
    row: SamplingRow,
    draft: int,
    default_generator: torch.Generator | None = None,
    allowed_mask: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
) -> SampleResult:
    """Pick a token for one position that has a proposed (draft) token, keeping the law exact.

    Greedy rows take the argmax (so the draft survives only if it is the argmax). Sampled rows,
    with ``p`` the distribution plain sampling would draw from (mask, penalties, temperature,
    top-k/top-p/min-p applied):

    - with ``draft_probs`` (the distribution ``q`` ``[V]`` the draft was drawn from): keep the
      draft with probability ``min(1, p(draft) / q(draft))``, else sample from the normalised
      residual ``max(0, p - q)`` (from ``p`` when that is all zero);
    - without it (a deterministic proposal, or ``q(draft) == 0``): keep the draft with
      probability ``p(draft)``, else sample from ``p`` with the draft removed.

    Either way the result is distributed as ``p``.
    """
    raw = logits[None]
    x = _prepare(raw, [row], None if allowed_mask is None else allowed_mask[None])
    failed = _messages(unsampleable(x, None if allowed_mask is None else allowed_mask[None]).tolist())
    if failed[0] is not None:
        return SampleResult([draft], [None], [None], failed)
    if row.params.greedy:
        token = int(x[0].argmax())
    else:
        gen = row.generator or default_generator
        probs = _sampling_probs(x, [row])[0]
        if bool(torch.isnan(probs.sum())):  # temperature overflowed what was finite
            return SampleResult([draft], [None], [None], [NON_FINITE])
        q = None if draft_probs is None else draft_probs.to(device=probs.device, dtype=probs.dtype)
        if q is not None and float(q[draft]) > 0:
            p_d, q_d = float(probs[draft]), float(q[draft])
            if float(torch.rand((), generator=gen, device=probs.device)) * q_d < p_d:
                token = draft
            else:
                residual = (probs - q).clamp_(min=0.0)
                token = _draw_one(residual if float(residual.sum()) > 0 else probs, gen)
        elif float(torch.rand((), generator=gen, device=probs.device)) < float(probs[draft]):
            token = draft
        else:
            probs[draft] = 0.0
            token = _draw_one(probs, gen)
    return _with_logprobs(raw, torch.tensor([token], device=raw.device), [row])


def _draw_one(weights: torch.Tensor, gen: torch.Generator | None) -> int:
    """An index drawn with probability proportional to ``weights`` ``[V]`` (not normalised)."""
    noise = torch.empty_like(weights).exponential_(generator=gen)
    return int((weights / noise).argmax())


def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: Sequence[SamplingRow], allowed_mask: torch.Tensor | None = None) -> SampleResult:
    token_list = tokens.tolist()
    logprobs: list[float | None] = [None] * len(rows)
    tops: list[list[tuple[float, int]] | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.want_logprob]
    if want:
        idx = torch.tensor(want, device=raw.device)
        lp = torch.log_softmax(raw.index_select(0, idx), dim=-1)
        chosen = lp.gather(1, tokens[idx][:, None]).squeeze(1).tolist()
        for j, i in enumerate(want):
            logprobs[i] = chosen[j]
            k = rows[i].top_logprobs_num
            if k:
                row_lp = lp[j]
                if rows[i].masked_tops and allowed_mask is not None:  # unnormalized, as transformers masks beams
                    row_lp = row_lp.masked_fill(~allowed_mask[i], float("-inf"))
                vals, ids = row_lp.topk(min(k, int(torch.isfinite(row_lp).sum()) or 1, lp.shape[-1]))
                tops[i] = list(zip(vals.tolist(), ids.tolist()))
    return SampleResult(token_list, logprobs, tops)


def prompt_logprobs(
    logits: torch.Tensor, next_ids: Sequence[int], top_k: int
) -> tuple[list[float], list[list[tuple[float, int]]] | None]:
    """Logprob of each next prompt token under the logits at the position before it."""
    lp = torch.log_softmax(logits, dim=-1)
    ids = torch.tensor(list(next_ids), dtype=torch.int64, device=logits.device)
    values = lp.gather(1, ids[:, None]).squeeze(1).tolist()
    tops = None
    if top_k:
        v, i = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
        tops = [list(zip(a, b)) for a, b in zip(v.tolist(), i.tolist())]
    return values, tops
