"""Few-shot questions in a batch: run_batch with a progress bar, sharing one cached prefix.

    .venv/bin/python examples/batch_few_shot.py

Written with SGLang's names (``import radixlm as sgl``): the program runs unchanged. Before the
batch starts, ``run_batch`` traces the program to find the text every instance shares (the
examples) and prefills it once; every instance then starts from the radix cache.
"""

import radixlm as sgl

EXAMPLES = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Canada", "Ottawa"), ("Egypt", "Cairo"), ("Kenya", "Nairobi")]
QUESTIONS = {
    "Germany": "Berlin", "Spain": "Madrid", "Greece": "Athens", "Poland": "Warsaw", "Portugal": "Lisbon",
    "Sweden": "Stockholm", "Norway": "Oslo", "Ireland": "Dublin", "Austria": "Vienna", "Peru": "Lima",
    "Cuba": "Havana", "Chile": "Santiago", "Turkey": "Ankara", "Vietnam": "Hanoi", "Russia": "Moscow", "China": "Beijing",
}


@sgl.function
def capital(s, country):
    for example_country, city in EXAMPLES:
        s += f"Q: What is the capital of {example_country}?\nA: {city}\n\n"
    s += "Q: What is the capital of " + country + "?\nA:" + sgl.gen("city", max_tokens=8, stop="\n")


def main() -> None:
    with sgl.EngineBackend() as backend:
        sgl.set_default_backend(backend)
        states = capital.run_batch([{"country": c} for c in QUESTIONS], temperature=0, progress_bar=True)
        correct = 0
        for (country, expected), state in zip(QUESTIONS.items(), states):
            answer = state["city"].strip()
            correct += expected in answer
            meta = state.get_meta_info("city")
            print(f"{country:>9}: {answer:<12} ({meta['cached_tokens']}/{meta['prompt_tokens']} prompt tokens cached)")
        print(f"{correct}/{len(QUESTIONS)} correct")


if __name__ == "__main__":
    main()
