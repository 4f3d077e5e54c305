"""The server through the official openai client: JSON-schema output, valid by construction.

    .venv/bin/python examples/openai_json.py

``rl.Runtime()`` starts ``radixlm serve`` (the embedded SmolLM2) as a child process on a free
port and stops it at exit; any OpenAI client can then talk to ``runtime.url + "/v1"``.
"""

import json

from openai import OpenAI

import radixlm as rl

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "species": {"enum": ["cat", "dog", "parrot", "turtle"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 50},
        "tricks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "species", "age", "tricks"],
    "additionalProperties": False,
}


def main() -> None:
    runtime = rl.Runtime()  # radixlm serve --port <free port>, the embedded model
    try:
        client = OpenAI(base_url=runtime.url + "/v1", api_key="none")
        reply = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Invent a pet and describe it."}],
            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}},
            max_tokens=96,
            temperature=0,
        )
        pet = json.loads(reply.choices[0].message.content)
        print(json.dumps(pet, indent=2))
        print("usage:", reply.usage)
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    main()
