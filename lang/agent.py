"""run_agent: the tool-calling loop of an agent, as one call inside a prompt program.

Each step is one assistant message holding one tool call that is valid by construction
(``gen(tools=...)``); the loop runs the call, appends its result as a tool message and goes on
until the model calls the answer tool (``final_answer(answer)``, added to the tools) or
``max_steps`` calls have been made. A tool that raises does not end the loop: the model reads
``error: <type>: <message>`` as that call's result and may try again. Every step's call, result,
error and token counts (``cached_tokens`` shows the radix cache at work: each step extends the
last one's prompt) are kept in the meta info of the answer variable::

    @radixlm.function
    def weather_agent(s, question):
        radixlm.run_agent(s, TOOLS, task=question, system_prompt="You answer weather questions.")

    state = weather_agent.run(question="How warm is Oslo?")
    state["answer"], state.get_meta_info("answer")["steps"]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixlm.lang import ir
from radixlm.lang.api import assistant, gen, system, user
from radixlm.lang.tools import Tool, as_tools, describe_tools, run_call, tool

ANSWER_TOOL = "final_answer"


def answer_tool(name: str = ANSWER_TOOL) -> Tool:
    """The tool whose call ends an agent's loop; its one argument is the answer."""

    def final_answer(answer: str) -> str:
        """Give the final answer to the user; call this once you know it.

        Args:
            answer: the complete answer, in plain words
        """
        return answer

    return tool(final_answer, name=name)


def run_agent(
    s: Any,
    tools: Sequence[Any],
    task: str | None = None,
    *,
    system_prompt: str | None = None,
    max_steps: int = 8,
    answer: str | None = ANSWER_TOOL,
    name: str = "answer",
    max_tokens: int = 256,
    **gen_kwargs: Any,
) -> Any:
    """Let the model call ``tools`` until it answers or ``max_steps`` calls were made; returns the answer.

    ``system_prompt`` (with the tools described after it) and ``task`` (a user message) are
    appended first when given; otherwise the program has written them. ``answer`` names the
    answer tool (None: no answer tool, the loop always runs ``max_steps`` calls). The answer
    (None when the steps ran out) is stored as ``s[name]``; its meta info holds ``steps`` (per
    call: ``call``, ``result``, ``error``, ``prompt_tokens``, ``cached_tokens``,
    ``completion_tokens``), ``finished`` and ``stop_reason`` (``"answer"`` or ``"max_steps"``).
    Other keywords (``temperature``, ``top_p``, ...) go to each step's ``gen``.
    """
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
        raise ValueError(f"run_agent: max_steps must be a positive integer, got {max_steps!r}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"run_agent: name must be a non-empty string, got {name!r}")
    user_tools = as_tools(tools) if tools else []
    answer_tools = [answer_tool(answer)] if answer is not None else []
    every = user_tools + answer_tools
    if not every:
        raise ValueError("run_agent: give at least one tool (or keep the answer tool)")
    if system_prompt is not None:
        s += system(system_prompt.rstrip() + "\n" + describe_tools(every))
    if task is not None:
        s += user(task)
    call_var = f"{name}_call"
    steps: list[dict[str, Any]] = []
    result: Any = None
    stop_reason = "max_steps"
    for _ in range(max_steps):
        s += assistant(gen(call_var, tools=every, max_tokens=max_tokens, **gen_kwargs))
        call = s[call_var]
        meta = s.get_meta_info(call_var) or {}
        step = {
            "call": call,
            "result": None,
            "error": None,
            "prompt_tokens": meta.get("prompt_tokens"),
            "cached_tokens": meta.get("cached_tokens"),
            "completion_tokens": meta.get("completion_tokens"),
        }
        steps.append(step)
        if answer is not None and call["name"] == answer:
            result = step["result"] = (call.get("arguments") or {}).get("answer")
            stop_reason = "answer"
            break
        value, text, error = run_call(call, user_tools)
        step["result"] = value
        step["error"] = None if error is None else f"{type(error).__name__}: {error}"
        s += ir.ExprList([ir.RoleBegin("tool"), ir.Constant(text), ir.RoleEnd("tool")])
    s += ir.SetVar(name, result, {"steps": steps, "finished": stop_reason == "answer", "stop_reason": stop_reason})
    return result
