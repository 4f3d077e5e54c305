"""Data for the program benchmarks (benchmarks/programs.py), written for this project (no downloads).

Small stand-ins for the datasets of SGLang's paper: MMLU-style multiple choice, HellaSwag-style
sentence endings, GSM8K-style word problems for tree-of-thought, and recorded ReAct trajectories
(HotpotQA-style lookups) whose observations are replayed instead of calling a search engine.
"""

from __future__ import annotations

CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Canada": "Ottawa", "Egypt": "Cairo",
    "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo", "Spain": "Madrid", "Greece": "Athens",
    "Poland": "Warsaw", "Cuba": "Havana", "Ireland": "Dublin", "Austria": "Vienna", "Sweden": "Stockholm",
    "Portugal": "Lisbon", "Turkey": "Ankara", "Vietnam": "Hanoi", "Germany": "Berlin", "Brazil": "Brasília",
    "Argentina": "Buenos Aires", "Mexico": "Mexico City", "Australia": "Canberra", "China": "Beijing",
    "Russia": "Moscow", "Thailand": "Bangkok", "Nigeria": "Abuja", "Morocco": "Rabat", "Finland": "Helsinki",
    "Denmark": "Copenhagen", "Belgium": "Brussels", "Hungary": "Budapest", "Chile": "Santiago", "India": "New Delhi",
}
MCQ_SHOTS = ["France", "Japan", "Kenya", "Canada", "Greece"]
MCQ_QUESTIONS = [c for c in CAPITALS if c not in MCQ_SHOTS][:24]
LETTERS = ["A", "B", "C", "D"]


def mcq_options(country: str) -> tuple[list[str], int]:
    """Four capitals (the right one among three others, in a fixed shuffled order) and its index."""
    names = list(CAPITALS)
    i = names.index(country)
    others = [CAPITALS[names[(i + k) % len(names)]] for k in (3, 11, 19)]
    answer = i % 4
    options = others[:answer] + [CAPITALS[country]] + others[answer:]
    return options, answer


def mcq_block(country: str, with_answer: bool) -> str:
    """One question with lettered options (and its answer letter for the few-shot examples)."""
    options, answer = mcq_options(country)
    text = f"Question: What is the capital of {country}?\n" + "".join(f"{letter}. {option}\n" for letter, option in zip(LETTERS, options)) + "Answer:"
    return text + (f" {LETTERS[answer]}\n\n" if with_answer else "")


# (context, four endings, index of the sensible ending)
HELLASWAG = [
    ("A man is standing in a kitchen holding a whisk. He", ["cracks two eggs into a bowl and starts beating them quickly.", "throws the whisk onto the roof and climbs a ladder.", "reads a newspaper article about whisks in the garden.", "paints the whisk blue and hangs it on the wall."], 0),
    ("A girl puts on her helmet and knee pads. She", ["eats the knee pads with a spoon.", "steps onto her skateboard and pushes off down the path.", "folds the helmet into a paper airplane.", "plants the helmet in a flower pot."], 1),
    ("A woman pours hot water over coffee grounds in a filter. She", ["waits for it to drip into the cup below.", "freezes the filter and uses it as a hat.", "sings to the grounds until they turn into tea.", "puts the kettle in the washing machine."], 0),
    ("Two people carry a canoe to the edge of the lake. They", ["bury the canoe in the sand and leave.", "set it in the water, climb in and start paddling.", "light the canoe on fire to keep warm.", "stand it upright and use it as a door."], 1),
    ("A boy is kneeling beside his bicycle with a flat tire. He", ["rides away quickly on the flat tire to the moon.", "paints the tire green and calls it fixed.", "pulls out the inner tube and patches the hole.", "asks the bicycle politely to repair itself."], 2),
    ("A chef lays a sheet of pastry over a pie dish. She", ["trims the edges and crimps them with a fork.", "wears the pastry as a scarf for the evening.", "mails the pie dish to a friend overseas.", "rolls the dish down the hill outside."], 0),
    ("A man fills a bucket with soapy water next to his car. He", ["drinks the soapy water from the bucket.", "dips a sponge in it and scrubs the car's doors.", "pours the bucket into the fuel tank.", "puts the bucket on his head and walks away."], 1),
    ("A woman kneels in the garden with a small trowel. She", ["digs a hole and sets a seedling into it.", "uses the trowel to comb her hair.", "throws the trowel at passing clouds.", "buries her phone to charge it."], 0),
    ("A student opens a textbook and a notebook on the desk. He", ["tears out pages to build a fire on the desk.", "reads the first chapter and writes notes.", "stacks them to reach the ceiling light.", "feeds the notebook to his goldfish."], 1),
    ("A dog owner picks up a leash by the front door. She", ["ties the leash to the ceiling fan.", "calls the dog over and clips the leash to its collar.", "cooks the leash for dinner.", "throws the leash out of the window."], 1),
    ("A man sits at a piano and opens the sheet music. He", ["places his hands on the keys and begins to play.", "closes the lid and sleeps on the piano.", "pours water into the piano to tune it.", "uses the sheet music to wrap a fish."], 0),
    ("A mechanic slides under a car on a rolling board. He", ["loosens the drain plug to change the oil.", "takes a nap and dreams of trains.", "paints a mural on the garage floor.", "starts juggling wrenches for the customers."], 0),
    ("A woman holds a camera up to her eye at the beach. She", ["throws the camera into the sea to clean it.", "frames the sunset and presses the shutter.", "uses the camera as a shovel for sand.", "feeds the camera to a seagull."], 1),
    ("A baker takes a tray of bread out of the oven. He", ["sets it on a rack to cool before slicing.", "puts the tray back into the freezer for baking.", "throws the loaves into the river.", "wears the tray as a shield."], 0),
    ("A girl fills a watering can at the tap. She", ["carries it outside and waters the tomato plants.", "drinks from the watering can while standing on her head.", "pours the water into her backpack.", "freezes the can into an ice sculpture."], 0),
    ("A man ties his running shoes at the start line. He", ["sits down and knits a sweater during the race.", "waits for the signal and starts running with the others.", "unties them again and goes home to sleep.", "throws the shoes at the referee."], 1),
    ("A woman lays out a yoga mat in the living room. She", ["rolls the mat up and uses it as a telescope.", "stands on it and starts a series of slow stretches.", "cooks pancakes on the mat.", "hangs the mat over the window as a curtain."], 1),
    ("A boy holds a kite as the wind picks up in the park. He", ["runs a few steps and lets the kite rise into the air.", "buries the kite under the swings.", "folds the kite into his lunchbox and eats lunch.", "paints the wind orange."], 0),
    ("A woman threads a needle at her sewing table. She", ["begins stitching the torn hem of a skirt.", "uses the needle to pop every balloon in town.", "swallows the thread for good luck.", "mails the needle to the moon."], 0),
    ("A man sets up a tent at the campsite as the sun sets. He", ["drives the stakes into the ground and pulls the lines tight.", "sets the tent on fire to see better.", "packs the tent into the river.", "wears the tent to a wedding."], 0),
]
HELLASWAG_SHOTS = 6


# GSM8K-style word problems (question, answer)
WORD_PROBLEMS = [
    ("A baker makes 24 muffins and sells 15 of them. How many muffins are left?", "9"),
    ("Tom has 3 boxes with 8 pencils in each box. How many pencils does he have?", "24"),
    ("A train travels 60 kilometers per hour for 3 hours. How far does it go?", "180"),
    ("Sara read 12 pages on Monday and twice as many on Tuesday. How many pages did she read in total?", "36"),
    ("A farmer has 40 apples and puts them into bags of 5. How many bags does he fill?", "8"),
    ("A ticket costs 7 dollars. How much do 6 tickets cost?", "42"),
]


# Recorded ReAct trajectories: question and the observations a search tool returned, step by step.
REACT_FEW_SHOT = """Solve a question answering task with interleaving Thought, Action, Observation steps. Thought can reason about the current situation, and Action can be two types:
(1) Search[entity], which searches the exact entity and returns the first paragraph if it exists.
(2) Finish[answer], which returns the answer and finishes the task.
Here are some examples.
Question: Which city is the capital of the country where the Nile delta lies?
Thought 1: I need to find the country where the Nile delta lies, then its capital.
Action 1: Search[Nile delta]
Observation 1: The Nile Delta is the delta formed in Lower Egypt where the Nile River spreads out and drains into the Mediterranean Sea.
Thought 2: The Nile delta lies in Egypt. I need the capital of Egypt.
Action 2: Search[Egypt]
Observation 2: Egypt is a country spanning the northeast corner of Africa. Its capital and largest city is Cairo.
Thought 3: The capital of Egypt is Cairo.
Action 3: Finish[Cairo]
Question: Which is taller, the Eiffel Tower or the Statue of Liberty?
Thought 1: I need the heights of the Eiffel Tower and the Statue of Liberty.
Action 1: Search[Eiffel Tower]
Observation 1: The Eiffel Tower is a wrought-iron lattice tower in Paris. It is 330 metres tall.
Thought 2: The Eiffel Tower is 330 metres tall. Now the Statue of Liberty.
Action 2: Search[Statue of Liberty]
Observation 2: The Statue of Liberty is a colossal sculpture on Liberty Island in New York. It is 93 metres tall including its pedestal.
Thought 3: 330 metres is more than 93 metres, so the Eiffel Tower is taller.
Action 3: Finish[the Eiffel Tower]
"""

REACT_TRACES = [
    ("What is the capital of the country where Machu Picchu is?", ["Machu Picchu is a 15th-century Inca citadel in the Eastern Cordillera of southern Peru.", "Peru is a country in western South America. Its capital and largest city is Lima."]),
    ("Which river flows through the capital of Austria?", ["Austria is a landlocked country in Central Europe. Its capital is Vienna.", "Vienna lies on the Danube river, which flows through the city's eastern part."]),
    ("In which country was the composer of The Four Seasons born?", ["The Four Seasons is a group of four violin concertos by Antonio Vivaldi.", "Antonio Vivaldi was a Venetian composer, born in Venice in the Republic of Venice, now Italy."]),
    ("What is the official language of the country whose capital is Lisbon?", ["Lisbon is the capital and largest city of Portugal.", "Portugal's official language is Portuguese."]),
    ("Which ocean lies west of the country whose capital is Santiago?", ["Santiago is the capital and largest city of Chile.", "Chile is a long, narrow country with the Pacific Ocean along its entire western coast."]),
    ("What currency is used in the country where Mount Fuji stands?", ["Mount Fuji is an active volcano on the Japanese island of Honshu.", "Japan's currency is the Japanese yen."]),
    ("Who designed the tower that is the tallest structure in Paris?", ["The tallest structure in Paris is the Eiffel Tower, at 330 metres.", "The Eiffel Tower was designed by the engineering company of Gustave Eiffel."]),
    ("Which continent is the country with capital Nairobi on?", ["Nairobi is the capital and largest city of Kenya.", "Kenya is a country in East Africa."]),
]
