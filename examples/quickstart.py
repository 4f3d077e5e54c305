"""Quickstart: a multi-turn chat program on the embedded SmolLM2, run in-process.

    .venv/bin/python examples/quickstart.py

A program is plain Python over a state ``s``: ``s += ...`` appends text, chat roles and
generation calls; ``s["name"]`` reads what a ``gen`` produced. Every turn resends the whole
conversation, and the runtime's radix cache makes the repeated part free (see cached_tokens).
"""

import radixlm as rl


@rl.function
def multi_turn(s, questions):
    s += rl.system("You are a concise assistant. Answer in one or two sentences.")
    for i, question in enumerate(questions):
        s += rl.user(question)
        s += rl.assistant(rl.gen(f"answer_{i}", max_tokens=48))


def main() -> None:
    with rl.EngineBackend() as backend:  # no model_path: the embedded SmolLM2-135M-Instruct
        rl.set_default_backend(backend)

        questions = ["What is the capital of France?", "What is a famous museum there?", "When was it opened?"]
        state = multi_turn.run(questions=questions, temperature=0)
        for message in state.messages():
            print(f"{message['role']:>9}: {message['content']}")
        for i in range(len(questions)):
            meta = state.get_meta_info(f"answer_{i}")
            print(f"turn {i + 1}: {meta['prompt_tokens']} prompt tokens, {meta['cached_tokens']} from the cache")

        print("\nstreaming:", end=" ", flush=True)
        streamed = multi_turn.run(questions=["Tell me a fun fact about octopuses."], temperature=0, stream=True)
        for chunk in streamed.text_iter("answer_0"):
            print(chunk, end="", flush=True)
        print()


if __name__ == "__main__":
    main()
