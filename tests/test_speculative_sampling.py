"""Speculative sampling is exact: verified drafts are distributed as plain sampling would draw.

A tiny vocabulary (8 tokens), fixed target logits and a deliberately different draft law q: the
draft ``d ~ q`` is verified with ``accept_draft`` many times under a fixed seed, and a chi-square
goodness-of-fit test compares the picked tokens with the target distribution ``p`` (the
request's temperature, top-k/top-p/min-p, penalties and mask applied). The same test, with the
same number of samples, is shown to reject a law that misplaces 5% of the mass.
"""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.sampler import SamplingRow, _sampling_probs, accept_draft, sample_draft
from radixlm.runtime.sampling_params import SamplingParams

V = 8
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])
Q = torch.tensor([0.02, 0.03, 0.05, 0.1, 0.1, 0.2, 0.2, 0.3])  # favours the target's tail
ALPHA = 1e-3  # a fixed seed: the test either always passes or always fails


def _row(gen: torch.Generator | None, prompt=(), output=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams.from_dict(params), list(prompt), list(output), gen, [], False, 0)


def _target(row: SamplingRow, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The law plain sampling draws from for this row (what ``sample`` uses)."""
    x = LOGITS.clone()
    if mask is not None:
        x[~mask] = float("-inf")
    out = torch.tensor(row.output_ids)
    counts = torch.bincount(out, minlength=V).float() if len(out) else torch.zeros(V)
    x -= row.params.frequency_penalty * counts + row.params.presence_penalty * (counts > 0).float()
    return _sampling_probs(x[None], [row])[0]


def _chi_square_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test over the categories the target can produce."""
    keep = expected_probs > 0
    assert int(counts[~keep].sum()) == 0, f"a token the target never draws was picked: {counts.tolist()}"
    n = counts.sum()
    expected = expected_probs[keep].double() * n
    stat = float(((counts[keep].double() - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def _verified_counts(n: int, row_params: dict, q: torch.Tensor | None, mask=None, output=(), fixed_draft=None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Counts of ``accept_draft``'s picks over ``n`` drafts drawn from ``q`` (or one fixed draft),
    the target law and the share of drafts kept."""
    draw_gen = torch.Generator().manual_seed(1234)
    row = _row(torch.Generator().manual_seed(99), output=output, **row_params)
    law = Q if q is None else q
    drafts = [fixed_draft] * n if fixed_draft is not None else torch.multinomial(law, n, replacement=True, generator=draw_gen).tolist()
    picks = [accept_draft(LOGITS, row, d, None, mask, q).token_ids[0] for d in drafts]
    kept = sum(p == d for p, d in zip(picks, drafts)) / n
    return torch.bincount(torch.tensor(picks), minlength=V), _target(row, mask), kept


# (name, sampling params, samples): each row applies a different part of the processing to p
CASES = [
    ("temperature", {"temperature": 0.7}, 6000),
    ("top_k_and_min_p", {"temperature": 1.3, "top_k": 6, "min_p": 0.05}, 6000),
    ("top_p_penalties_and_mask", {"temperature": 1.0, "top_p": 0.9, "frequency_penalty": 0.4, "presence_penalty": 0.2}, 6000),
]


@pytest.mark.parametrize(("name", "params", "n"), CASES, ids=[c[0] for c in CASES])
def test_speculative_sampling_with_draft_probs_matches_the_target_distribution(name, params, n):
    mask = None
    output = ()
    if name == "top_p_penalties_and_mask":
        mask = torch.ones(V, dtype=torch.bool)
        mask[1] = False  # the grammar forbids a token q proposes
        output = (0, 0, 3)
    counts, p, kept = _verified_counts(n, params, Q, mask, output)
    assert _chi_square_pvalue(counts, p) > ALPHA, (counts.tolist(), (p * n).tolist())
    # a draft is kept with probability sum_d min(p(d), q(d)) = 1 - TV(p, q): q is used, not ignored
    assert abs(kept - float(torch.minimum(p, Q).sum())) < 0.03, kept


def test_point_mass_rule_without_draft_probs_matches_the_target_distribution():
    counts, p, _ = _verified_counts(4000, {"temperature": 1.0}, None)  # drafts from Q, verified as deterministic
    assert _chi_square_pvalue(counts, p) > ALPHA
    counts, p, _ = _verified_counts(3000, {"temperature": 1.0, "top_k": 5}, None, fixed_draft=2)
    assert _chi_square_pvalue(counts, p) > ALPHA


def test_chi_square_test_has_the_power_to_detect_a_5_percent_bias():
    """With the sample sizes above, a law that misplaces 5% of the mass (onto q) is rejected."""
    gen = torch.Generator().manual_seed(7)
    for name, params, n in CASES:
        row = _row(None, **params)
        p = _target(row)
        misplaced = Q * (p > 0)
        biased = 0.95 * p + 0.05 * misplaced / misplaced.sum()
        draws = torch.multinomial(biased, n, replacement=True, generator=gen)
        assert _chi_square_pvalue(torch.bincount(draws, minlength=V), p) < ALPHA, name


def test_a_residual_from_p_instead_of_max_p_minus_q_is_detected():
    """Resampling from p (not from the residual) after a rejection is a known bias: the test sees it."""
    gen, draw_gen = torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)
    row = _row(None, temperature=0.7)
    p = _target(row)
    n = CASES[0][2]
    picks = []
    for d in torch.multinomial(Q, n, replacement=True, generator=draw_gen).tolist():
        accept = float(torch.rand((), generator=gen)) * float(Q[d]) < float(p[d])
        picks.append(d if accept else int(torch.multinomial(p, 1, generator=gen)))
    assert _chi_square_pvalue(torch.bincount(torch.tensor(picks), minlength=V), p) < ALPHA


def test_greedy_rows_keep_the_argmax_whatever_the_draft_law():
    row = _row(None, temperature=0.0)
    for d in range(V):
        assert accept_draft(LOGITS, row, d, None, None, Q).token_ids == [0]


def test_speculative_acceptance_is_reproducible_with_a_request_seed():
    def run(seed: int) -> list[int]:
        row = _row(torch.Generator().manual_seed(seed), temperature=1.0)
        return [accept_draft(LOGITS, row, d % V, None, None, Q).token_ids[0] for d in range(60)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_logprobs_of_a_speculatively_accepted_token_are_the_raw_ones():
    row = SamplingRow(SamplingParams.from_dict({"temperature": 0.7}), [], [], torch.Generator().manual_seed(0), [], True, 2)
    res = accept_draft(LOGITS, row, 3, None, None, Q)
    raw = torch.log_softmax(LOGITS, 0)
    assert abs(res.logprobs[0] - float(raw[res.token_ids[0]])) < 1e-6
    assert [t for _, t in res.top_logprobs[0]] == [0, 1]


def test_sample_draft_returns_the_law_each_token_was_drawn_from():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    rows = [_row(torch.Generator().manual_seed(0), temperature=0.0), _row(torch.Generator().manual_seed(1), temperature=0.8, top_k=3)]
    tokens, q = sample_draft(logits, rows)
    assert tokens[0] == 0 and q is not None
    assert torch.equal(q[0], torch.nn.functional.one_hot(torch.tensor(0), V).float())
    assert torch.allclose(q[1], _sampling_probs(logits[1:], rows[1:])[0])
    assert q[1, tokens[1]] > 0 and int((q[1] > 0).sum()) == 3
    greedy_only, none = sample_draft(logits, [rows[0], rows[0]])
    assert greedy_only == [0, 7] and none is None
