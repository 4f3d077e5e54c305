"""Tree of thought: fork into several lines of reasoning, judge each with select, pick the best.

    .venv/bin/python examples/tree_of_thought.py

``s.fork(n)`` sends the shared text once (so every branch starts from the cache), runs the
branches concurrently, and ``join()`` gathers each branch's variables into lists.
"""

import radixlm as rl


@rl.function
def tree_of_thought(s, question, width=3):
    s += rl.system("You think carefully and answer briefly.")
    s += rl.user(question)
    s += rl.assistant_begin()
    s += "Let me think about this in a few different ways.\n"
    branches = s.fork(width)
    branches += lambda i: (
        f"Idea {i + 1}:"
        + rl.gen("idea", max_tokens=32, stop="\n", temperature=0.8)
        + "\nIs this idea correct? "
        + rl.select("verdict", ["Yes", "No"])
    )
    branches.join()
    for i, idea in enumerate(s["idea"]):
        s += f"Idea {i + 1}:{idea}\n"
    s += "The best idea is number " + rl.select("best", [str(i + 1) for i in range(width)]) + ".\n"
    s += "Final answer: " + rl.gen("answer", max_tokens=40, stop="\n\n", temperature=0)
    s += rl.assistant_end()


def main() -> None:
    with rl.EngineBackend() as backend:
        state = tree_of_thought.run(question="How can I keep my houseplants alive while I travel for two weeks?", backend=backend)
        for idea, verdict, meta in zip(state["idea"], state["verdict"], state.get_meta_info("idea")["branches"]):
            print(f"[{verdict:>3}] {idea.strip()}   ({meta['cached_tokens']}/{meta['prompt_tokens']} prompt tokens cached)")
        print("best idea:", state["best"])
        print("answer:", state["answer"].strip())


if __name__ == "__main__":
    main()
