"""Every family under the engine's options: weight quantization, KV-cache dtypes, tensor parallelism."""

from __future__ import annotations

import pytest

import radixlm
from helpers import FAMILY_ARCHS, make_tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [40, 41, 42], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    """A tiny random checkpoint per family (the same as tests/test_families.py's)."""
    root = tmp_path_factory.mktemp("family_options")
    return {arch: make_tiny_model(arch, root / arch) for arch in FAMILY_ARCHS}


def _greedy(engine) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    engine.check_accounting()
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_every_family_runs_at_tp_2_with_one_process_greedy_output(arch, family_dirs):
    opts = {"model_path": family_dirs[arch], "max_total_tokens": 1024, "page_size": 4}
    with radixlm.Engine(**opts) as engine:
        reference = _greedy(engine)
    with radixlm.Engine(tp_size=2, **opts) as engine:
        got = _greedy(engine)
    for (ref_ids, ref_lp), (ids, lp) in zip(reference, got):
        assert ids == ref_ids
        assert max(abs(a - b) for a, b in zip(ref_lp, lp)) < 1e-3  # the all-reduce sums in another order


@pytest.mark.parametrize("option", [{"quantization": "int8"}, {"quantization": "int4"}, {"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "bfloat16"}])
@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_every_family_runs_with_quantized_weights_and_kv(arch, option, family_dirs):
    with radixlm.Engine(model_path=family_dirs[arch], max_total_tokens=1024, **option) as engine:
        plain_close = _greedy(engine)
    assert [len(ids) for ids, _ in plain_close] == [GREEDY["max_new_tokens"]] * len(PROMPTS)
    assert all(lp <= 0 for _, lps in plain_close for lp in lps)
