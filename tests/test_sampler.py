"""The sampler: filtering, penalties, masks, seeds and logprobs on hand-made logits."""

from __future__ import annotations

import torch

from radixlm.runtime.sampler import SamplingRow, apply_penalties, prompt_logprobs, sample
from radixlm.runtime.sampling_params import SamplingParams


def _row(gen: torch.Generator | None = None, prompt=(), output=(), banned=(), logprob=False, top=0, **params) -> SamplingRow:
    return SamplingRow(SamplingParams.from_dict(params), list(prompt), list(output), gen, list(banned), logprob, top)


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def _draws(n: int, **params) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    rows = [_row(gen, **params) for _ in range(n)]
    return torch.tensor(sample(LOGITS.repeat(n, 1), rows).token_ids)


def test_greedy_takes_the_argmax_and_top_k_1_is_greedy():
    assert sample(LOGITS, [_row(temperature=0)]).token_ids == [0]
    assert set(_draws(50, top_k=1).tolist()) == {0}


def test_temperature_one_sampling_follows_the_softmax():
    draws = _draws(4000)
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    expected = torch.softmax(LOGITS[0], 0)
    assert torch.allclose(freq, expected, atol=0.03)


def test_top_k_top_p_and_min_p_remove_the_tail():
    assert set(_draws(400, top_k=2).tolist()) <= {0, 1}
    probs = torch.softmax(LOGITS[0], 0)  # ≈ [.57, .21, .13, .08, .03, .004]
    assert set(_draws(400, top_p=0.7).tolist()) <= {0, 1}
    assert set(_draws(400, min_p=0.2).tolist()) <= {0, 1, 2}
    assert probs[2] / probs[0] > 0.2 > probs[3] / probs[0]


def test_banned_ids_and_the_allowed_mask_are_never_sampled():
    draws = sample(LOGITS.repeat(200, 1), [_row(torch.Generator().manual_seed(1), banned=[0, 1]) for _ in range(200)])
    assert not {0, 1} & set(draws.token_ids)
    allowed = torch.zeros(1, 6, dtype=torch.bool)
    allowed[0, 4] = True
    assert sample(LOGITS, [_row(temperature=0)], allowed_mask=allowed).token_ids == [4]


def test_seeded_rows_do_not_depend_on_their_neighbours():
    def draw(seeds: list[int], target: int) -> list[int]:
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        out = []
        for _ in range(30):
            rows = [_row(g) for g in gens]
            out.append(sample(LOGITS.repeat(len(rows), 1), rows).token_ids[target])
        return out

    alone = draw([7], 0)
    assert draw([3, 7, 9], 1) == alone
    assert draw([8], 0) != alone


def test_frequency_presence_and_repetition_penalties():
    logits = torch.tensor([[1.0, 1.0, -1.0, 0.5]])
    apply_penalties(logits, [_row(prompt=[3], output=[0, 0, 2], frequency_penalty=0.5, presence_penalty=0.25)])
    assert torch.allclose(logits, torch.tensor([[1.0 - 1.0 - 0.25, 1.0, -1.0 - 0.5 - 0.25, 0.5]]))
    logits = torch.tensor([[1.0, 1.0, -1.0, 0.5]])
    apply_penalties(logits, [_row(prompt=[3], output=[2], repetition_penalty=2.0)])
    assert torch.allclose(logits, torch.tensor([[1.0, 1.0, -2.0, 0.25]]))


def test_logprobs_are_from_the_raw_distribution():
    res = sample(LOGITS, [_row(temperature=0.5, logprob=True, top=2, top_k=1)])
    raw = torch.log_softmax(LOGITS[0], 0)
    assert abs(res.logprobs[0] - float(raw[0])) < 1e-6
    assert [t for _, t in res.top_logprobs[0]] == [0, 1]


def test_prompt_logprobs_pick_the_next_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
    values, tops = prompt_logprobs(logits, [1, 2], top_k=1)
    assert torch.allclose(torch.tensor(values), torch.log(torch.tensor([0.25, 0.8])))
    assert tops[0][0][1] == 0 and tops[1][0][1] == 2
