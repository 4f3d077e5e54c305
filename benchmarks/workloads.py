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


AGENT_TOOLS = [
    ("search", "Searches an encyclopedia and returns the first paragraph of the best matching article. Input: a short query of a few words. Use it for facts about people, places, history and science. It does not know about events after its last update, and it returns 'no result' when nothing matches."),
    ("calculator", "Evaluates an arithmetic expression with + - * / ** and parentheses and returns the number. Input: the expression only, without words or units. Use it for every computation, even simple ones, because mental arithmetic is error-prone."),
    ("weather", "Returns the current weather for a city: temperature in Celsius, sky conditions and wind speed. Input: the city name, optionally followed by a comma and the country. It cannot forecast beyond today."),
    ("calendar", "Looks up the user's calendar. Input: a date in the form YYYY-MM-DD. Returns the list of events on that date with their start times, or 'free' when there is nothing planned."),
    ("unit_convert", "Converts a quantity between units of length, mass, volume and temperature. Input: a number, a unit, the word 'to' and a target unit, for example '5 miles to km'. Returns the converted number with its unit."),
    ("translate", "Translates a short text into another language. Input: the target language, a colon, then the text, for example 'French: good morning'. Returns the translation only."),
]

AGENT_TASKS = [
    "What is the population of the capital of {c}, divided by 1000?",
    "Is it warmer today in the capital of {c} than in Oslo?",
    "How do you say 'thank you' in the main language of {c}?",
    "How many kilometres is a 26 mile marathon, and which city in {c} hosts one?",
]

AGENT_OBSERVATIONS = ["no result", "42", "18 degrees, cloudy, wind 10 km/h", "free", "41.8 km", "merci"]


def agent_preamble() -> str:
    """About 600 tokens: the agent's instructions, its tools and the step format (shared by all agents)."""
    tools = "\n".join(f"- {name}: {desc}" for name, desc in AGENT_TOOLS)
    return (
        "You are a careful assistant that answers questions by thinking step by step and using tools.\n"
        "You have access to the following tools:\n"
        f"{tools}\n\n"
        "Use this format for every step:\n"
        "Thought: what you know so far and what you need next\n"
        "Action: the name of one tool\n"
        "Action Input: the input for that tool\n"
        "Observation: the tool's result (written by the system, never by you)\n"
        "Repeat Thought/Action/Action Input/Observation as often as needed. When you know the answer, write:\n"
        "Thought: I now know the final answer\n"
        "Final Answer: the answer, in one sentence.\n\n"
        "Rules: call one tool per step; never invent observations; prefer the calculator for numbers; "
        "if a tool fails, try a different query once, then explain what you could not find. "
        "Keep thoughts short. Answer in English. Do not repeat the question.\n\n"
        "Example:\n"
        "Question: What is 12 times the number of moons of Mars?\n"
        "Thought: I need the number of moons of Mars.\n"
        "Action: search\nAction Input: moons of Mars\n"
        "Observation: Mars has two small moons, Phobos and Deimos.\n"
        "Thought: Now I multiply 12 by 2.\n"
        "Action: calculator\nAction Input: 12 * 2\n"
        "Observation: 24\n"
        "Thought: I now know the final answer\n"
        "Final Answer: 12 times the number of moons of Mars is 24.\n\n"
    )


def agent_tasks(n: int) -> list[str]:
    """``n`` distinct agent questions."""
    return [AGENT_TASKS[i % len(AGENT_TASKS)].format(c=QUESTION_COUNTRIES[(i * 7) % len(QUESTION_COUNTRIES)]) for i in range(n)]


EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "occupation": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "city", "age", "occupation"],
    "additionalProperties": False,
}

PEOPLE = [
    ("Amina Haddad", "Rabat", 34, "architect"), ("Lars Eriksen", "Bergen", 51, "fisherman"),
    ("Mei Tanaka", "Osaka", 27, "nurse"), ("Diego Alvarez", "Quito", 45, "teacher"),
    ("Priya Nair", "Kochi", 38, "pilot"), ("Tomasz Nowak", "Gdansk", 62, "baker"),
    ("Chloe Martin", "Lyon", 23, "student"), ("Kwame Mensah", "Kumasi", 40, "engineer"),
]


def extraction_prompts(n: int) -> list[str]:
    """``n`` short passages, each describing one person, to extract as JSON."""
    out = []
    for i in range(n):
        name, city, age, job = PEOPLE[i % len(PEOPLE)]
        out.append(f"Extract the person as JSON.\nText: {name} is {age + i // len(PEOPLE)} years old, lives in {city} and works as a {job}.")
    return out
