"""Prompt programs against any OpenAI-compatible server: here radixlm's own (``make serve``).

    make serve                                   # in another terminal: SmolLM2 on port 30000
    .venv/bin/python examples/openai_backend.py  # or --base-url http://host:port/v1 --model NAME

The same programs run against llama.cpp's or vLLM's server, or a hosted API (give its base URL,
model name and key). A chat model is sent the program's messages; a completion model its text.
``num_api_spec_tokens`` lets one request serve several ``gen`` calls; ``token_usage`` counts
what was sent.
"""

import argparse
import json

from radixlm import OpenAI, assistant, function, gen, select, user

FEW_SHOT = "Name: Alice\nClass: Mage\nWeapon: Staff\n\nName: Bob\nClass: Warrior\nWeapon: Sword\n\n"


@function
def review(s, product):
    s += user(f"Write a one-sentence review of {product}.")
    s += assistant(gen("review", max_tokens=48))
    s += user("Is that review positive or negative?")
    s += assistant(select("mood", choices=["positive", "negative"]))
    s += user("Give it as JSON with a score from 1 to 5.")
    s += assistant(gen("json", max_tokens=48, json_schema={"type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["score"]}))


@function(num_api_spec_tokens=24)
def hero(s):
    s += FEW_SHOT + "Name:"
    s += gen("name", max_tokens=8, stop="\n") + "\nClass:"
    s += gen("cls", max_tokens=8, stop="\n") + "\nWeapon:"
    s += gen("weapon", max_tokens=8, stop="\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    parser.add_argument("--model", default="default", help="the served model name (radixlm serves any name)")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()

    with OpenAI(args.model, base_url=args.base_url, api_key=args.api_key) as chat:
        state = review.run("a cast-iron pan", temperature=0, backend=chat)
        print("review:", state["review"])
        print("mood:  ", state["mood"], f"(chosen by {state.get_meta_info('mood')['select_method']} generation)")
        print("json:  ", json.loads(state["json"]))
        print("chat usage:", chat.token_usage.snapshot())

    with OpenAI(args.model, base_url=args.base_url, api_key=args.api_key, is_chat_model=False) as completion:
        state = hero.run(temperature=0, backend=completion)
        print("hero:", state["name"].strip(), "/", state["cls"].strip(), "/", state["weapon"].strip())
        print("completion usage (one request for three gens):", completion.token_usage.snapshot())


if __name__ == "__main__":
    main()
