"""Benchmark workloads built from data shipped with the project (no downloads)."""

from __future__ import annotations

FEW_SHOT_FACTS = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Canada", "Ottawa"),
    ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo"),
    ("India", "New Delhi"), ("Chile", "Santiago"), ("Spain", "Madrid"), ("Greece", "Athens"),
    ("Poland", "Warsaw"), ("Cuba", "Havana"), ("Ireland", "Dublin"), ("Austria", "Vienna"),
    ("Sweden", "Stockholm"), ("Portugal", "Lisbon"), ("Turkey", "Ankara"), ("Vietnam", "Hanoi"),
]

QUESTION_COUNTRIES = [
    "Germany", "Brazil", "Argentina", "Mexico", "Australia", "China", "Russia", "Thailand",
    "Nigeria", "Morocco", "Finland", "Denmark", "Belgium", "Hungary", "Romania", "Bulgaria",
    "Colombia", "Venezuela", "Ecuador", "Bolivia", "Uruguay", "Paraguay", "Iceland", "Estonia",
    "Latvia", "Lithuania", "Ukraine", "Croatia", "Serbia", "Slovakia", "Slovenia", "Albania",
    "Ethiopia", "Ghana", "Senegal", "Tanzania", "Uganda", "Zambia", "Angola", "Algeria",
    "Tunisia", "Libya", "Sudan", "Iran", "Iraq", "Syria", "Jordan", "Lebanon",
    "Israel", "Pakistan", "Nepal", "Bangladesh", "Mongolia", "Indonesia", "Malaysia", "Philippines",
    "Cambodia", "Laos", "Myanmar", "Singapore", "New Zealand", "Fiji", "Jamaica", "Panama",
]

QUESTION_TEMPLATES = [
    "Question: What is the capital of {c}, the city where its government sits?\nAnswer:",
    "Question: Which city is the capital of {c}, and what is it called?\nAnswer:",
    "Question: Name the capital city of {c}, please, in one short sentence.\nAnswer:",
    "Question: In which city would you find the government of {c}?\nAnswer:",
]


def few_shot_prefix() -> str:
    """About 420 tokens of question/answer examples every request of the workload shares."""
    return "".join(f"Question: What is the capital of {c}?\nAnswer: The capital of {c} is {k}.\n\n" for c, k in FEW_SHOT_FACTS)


def few_shot_prompts(n: int = 64) -> list[str]:
    """``n`` prompts: the shared few-shot prefix plus a distinct ~20-token question each."""
    prefix = few_shot_prefix()
    return [
        prefix + QUESTION_TEMPLATES[i % len(QUESTION_TEMPLATES)].format(c=QUESTION_COUNTRIES[i % len(QUESTION_COUNTRIES)])
        for i in range(n)
    ]


def optimal_cached_tokens(prompts_ids: list[list[int]], page_size: int = 1) -> int:
    """Tokens a perfect prefix cache could reuse: each prompt's longest shared prefix with an earlier one."""
    total = 0
    for i, ids in enumerate(prompts_ids):
        best = 0
        for prev in prompts_ids[:i]:
            n = 0
            limit = min(len(ids) - 1, len(prev))
            while n < limit and ids[n] == prev[n]:
                n += 1
            best = max(best, n - n % page_size)
        total += best
    return total


SYSTEM_PROMPT = (
    "You are Atlas, a concise and friendly assistant for a travel company. You help customers "
    "plan trips, compare destinations, understand visa rules in general terms, and pack sensibly. "
    "Always answer in plain English, in at most three short sentences, unless the customer asks "
    "for a list. When a question is about prices, say that prices change and suggest checking the "
    "booking page. When a question is about safety, recommend the official travel advice of the "
    "customer's own government. Never invent flight numbers, hotel names or exact prices. If you "
    "do not know something, say so and suggest where the customer could find out. Be warm but "
    "professional, avoid slang, and do not use emojis. If the customer writes in another "
    "language, answer in that language. Keep the conversation focused on travel; politely steer "
    "other topics back to trip planning. Remember that many customers travel with children, "
    "older relatives or pets, and mention relevant tips when it helps."
)

CHAT_QUESTIONS = [
    "What should I pack for a week in {c} in winter?",
    "Is {c} a good destination for a family with two small children?",
    "What is the best time of year to visit {c}?",
    "How many days do I need to see the main sights of {c}?",
]


def chat_questions(n: int) -> list[str]:
    """``n`` short distinct user questions for the shared-system-prompt chat workload."""
    return [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)].format(c=QUESTION_COUNTRIES[i % len(QUESTION_COUNTRIES)]) for i in range(n)]
