"""run_agent: the tool-calling loop, in-process and over HTTP on the tiny random-weight Llama.

The random model makes valid calls (the grammar sees to that), not sensible ones, so each test
leaves it one kind of call to make: the answer tool alone, a tool that raises, a tool that works.
"""

from __future__ import annotations

import pytest

import radixlm as rl


@rl.tool
def boom(code: int) -> str:
    """A tool that always fails."""
    raise RuntimeError("boom: the tool broke")


@rl.tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@rl.function
def agent(s, tools, answer, max_steps):
    # the random model's free-text answer may run long before it closes the string (at 256 tokens, 1 run in 20 was cut off)
    rl.run_agent(s, tools, task="Add 2 and 3.", system_prompt="You use tools.", max_steps=max_steps, answer=answer, max_tokens=1024)


def test_the_answer_tool_ends_the_loop_with_the_answer(lang_backend):
    state = agent.run(tools=[], answer="final_answer", max_steps=3, backend=lang_backend, temperature=1.0)
    assert state.error() is None
    meta = state.get_meta_info("answer")
    assert meta["finished"] and meta["stop_reason"] == "answer" and len(meta["steps"]) == 1
    assert meta["steps"][0]["call"]["name"] == "final_answer"
    assert isinstance(state["answer"], str) and state["answer"] == meta["steps"][0]["call"]["arguments"]["answer"]
    roles = [m["role"] for m in state.messages()]
    assert roles == ["system", "user", "assistant"]
    assert "final_answer" in state.messages()[0]["content"]  # the tools are described to the model


def test_a_tool_that_raises_goes_back_to_the_model_and_max_steps_ends_the_loop(lang_backend):
    state = agent.run(tools=[boom], answer=None, max_steps=2, backend=lang_backend, temperature=1.0)
    assert state.error() is None  # the tool's exception did not go up the stack
    meta = state.get_meta_info("answer")
    assert state["answer"] is None and not meta["finished"] and meta["stop_reason"] == "max_steps"
    assert [step["call"]["name"] for step in meta["steps"]] == ["boom", "boom"]
    assert all(step["error"] == "RuntimeError: boom: the tool broke" for step in meta["steps"])
    tool_messages = [m["content"] for m in state.messages()[2:][1::2]]
    assert tool_messages == ["error: RuntimeError: boom: the tool broke"] * 2


def test_later_steps_hit_the_radix_cache(lang_backend):
    state = agent.run(tools=[add], answer=None, max_steps=3, backend=lang_backend, temperature=1.0)
    steps = state.get_meta_info("answer")["steps"]
    assert len(steps) == 3
    for step in steps:
        assert step["result"] == step["call"]["arguments"]["a"] + step["call"]["arguments"]["b"]
    for before, after in zip(steps, steps[1:]):
        assert after["prompt_tokens"] > before["prompt_tokens"]
        # the previous step's whole prompt (and its call) is reused, up to a token or two at the seam
        assert after["cached_tokens"] >= before["prompt_tokens"] - 2, (before, after)


def test_bad_agent_arguments_name_the_argument(lang_backend):
    @rl.function
    def bad(s, **kwargs):
        rl.run_agent(s, [add], **kwargs)

    with pytest.raises(ValueError, match="max_steps"):
        bad.run(max_steps=0, backend=lang_backend)
    with pytest.raises(ValueError, match="unique"):
        bad.run(answer="add", backend=lang_backend)
    with pytest.raises(ValueError, match="at least one tool"):
        rl.run_agent(None, [], answer=None)
