"""A ReAct-style agent with two Python tools; every call is valid by construction.

    .venv/bin/python examples/react_agent.py

``@rl.tool`` turns a typed function into a tool (JSON schema from the signature, description
from the docstring). ``gen(tools=...)`` constrains the model to one valid call, read back as
``s["call"] == {"name": ..., "arguments": {...}}``; ``call_tool`` runs it and appends the result
as the chat template's tool message. (The embedded 135M-parameter model is small: it makes
valid calls, not always the wise ones.)
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
def react_agent(s, question, max_steps=3):
    s += rl.system(
        "You answer questions about the weather. First look up the weather of the city, "
        "then convert units if the user asks for Fahrenheit.\n" + rl.describe_tools(TOOLS)
    )
    s += rl.user(question)
    for _ in range(max_steps):
        s += rl.assistant(rl.gen("call", tools=TOOLS, max_tokens=64))
        s += rl.call_tool(s["call"], TOOLS)
        s += rl.assistant_begin() + rl.select("next", ["Next I will call a tool.", "The answer is"])
        if s["next"] == "The answer is":
            s += rl.gen("answer", max_tokens=48, stop="\n") + rl.assistant_end()
            return
        s += rl.assistant_end()


def main() -> None:
    with rl.EngineBackend() as backend:
        question = "What is the weather in Tokyo? Give the temperature in Fahrenheit."
        state = react_agent.run(question=question, backend=backend, temperature=0)
        for message in state.messages()[1:]:
            print(f"{message['role']:>9}: {message['content']}")


if __name__ == "__main__":
    main()
