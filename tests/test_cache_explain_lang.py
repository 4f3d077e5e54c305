"""The DSL's side of cache explanations: gen(return_cache_info=True) and the program label."""

from __future__ import annotations

import pytest

import radixlm as sgl

FEW_SHOT = "Q: What is two plus two?\nA: four\nQ: What is the capital of France?\nA: Paris\n" * 3


@sgl.function
def quiz(s, question):
    s += FEW_SHOT + "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=2, temperature=0, return_cache_info=True)


def test_program_name_is_the_origin_of_the_prefix_a_second_run_reuses(lang_backend):
    first = quiz.run(question="Who wrote Hamlet?", backend=lang_backend)
    second = quiz.run(question="What is the speed of light?", backend=lang_backend)
    assert first.error() is None and second.error() is None
    info = second.get_meta_info("answer")["cache_info"]
    assert info["cached_tokens"] > 0
    # the end of the reused prefix is quiz's own text (its first tokens may have been computed by
    # another program on a shared server: the docs' few_shot example also opens with "Q: What is")
    assert info["segments"][-1]["program"] == "quiz" and info["segments"][-1]["end"] == info["cached_tokens"]


def test_gen_refuses_a_non_boolean_return_cache_info():
    with pytest.raises(ValueError, match="return_cache_info"):
        sgl.gen("x", return_cache_info="yes")
