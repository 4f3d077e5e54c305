"""A tool-using agent in one call: ``rl.run_agent`` loops model calls and tool runs until an answer.

    .venv/bin/python examples/react_agent.py

``@rl.tool`` turns a typed function into a tool (JSON schema from the signature, description
from the docstring). Each step of ``run_agent`` is one assistant message holding one call that is
valid by construction; the loop runs it, appends the result as a tool message, and stops when the
model calls ``final_answer`` (or after ``max_steps``). A tool that raises is reported back to the
model as ``error: ...``. Every step's call, result and cached-token count is in the answer's meta
info: each step's prompt extends the last, so the radix cache serves all but the new tokens.
(The embedded 135M-parameter model is small: its calls are valid, not always wise.)
"""

from typing import Literal

import radixlm as rl

WEATHER = {"Paris": 18, "Tokyo": 24, "Lima": 16, "Oslo": 7}


@rl.tool
def get_weather(city: Literal["Paris", "Tokyo", "Lima", "Oslo"]) -> dict:
    """Current temperature of a city, in degrees Celsius.

    Args:
        city: the city to look up
    """
    return {"city": city, "celsius": WEATHER[city]}


@rl.tool
def celsius_to_fahrenheit(celsius: float) -> float:
    """Convert a temperature from Celsius to Fahrenheit."""
    return round(celsius * 9 / 5 + 32, 1)


TOOLS = [get_weather, celsius_to_fahrenheit]


@rl.function
def weather_agent(s, question):
    rl.run_agent(
        s,
        TOOLS,
        task=question,
        system_prompt="You answer questions about the weather. Look up the city, convert units if asked, then call final_answer with the answer.",
        max_steps=4,
        max_tokens=96,
    )


def main() -> None:
    with rl.EngineBackend() as backend:
        question = "What is the weather in Tokyo? Give the temperature in Fahrenheit."
        state = weather_agent.run(question=question, backend=backend, temperature=0)
        for i, step in enumerate(state.get_meta_info("answer")["steps"], 1):
            print(f"step {i}: {step['call']} -> {step['error'] or step['result']!r} "
                  f"({step['cached_tokens']}/{step['prompt_tokens']} prompt tokens cached)")
        print("answer:", state["answer"])


if __name__ == "__main__":
    main()
