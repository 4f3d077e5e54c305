"""JSON extraction: fill a pydantic model from free text, valid by construction.

    .venv/bin/python examples/json_extraction.py

``gen(json_schema=Model)`` constrains decoding to the model's JSON schema (its objects admit
only the declared fields), so ``Model.model_validate_json`` never fails on a finished output.
"""

from typing import Literal

from pydantic import BaseModel, Field

import radixlm as rl


class Person(BaseModel):
    name: str = Field(max_length=40)
    occupation: str = Field(max_length=40)
    born: int = Field(ge=1000, le=2100)
    field: Literal["science", "arts", "politics", "sports"]


TEXTS = [
    "Ada Lovelace was an English mathematician, born in 1815, known for her work on the Analytical Engine.",
    "Frida Kahlo, born in 1907 in Coyoacán, was a Mexican painter known for her self-portraits.",
    "Nelson Mandela (born 1918) was a South African anti-apartheid activist and president.",
]


@rl.function
def extract(s, text):
    s += rl.system("You extract facts about people as JSON.")
    s += rl.user("Extract the person described here.\n\n" + text)
    s += rl.assistant(rl.gen("person", json_schema=Person, max_tokens=80))


def main() -> None:
    with rl.EngineBackend() as backend:
        states = extract.run_batch([{"text": t} for t in TEXTS], backend=backend, temperature=0)
        for text, state in zip(TEXTS, states):
            person = Person.model_validate_json(state["person"])
            print(text)
            print("  ->", person)


if __name__ == "__main__":
    main()
