"""Write calib_data/draft_prompts.jsonl: the project's own chat prompts for training draft heads by self-distillation.

    python calib_data/draft_prompts.py

Requests of eight kinds (writing, role play, reasoning, math, coding, extraction, science, humanities), each kind
a few templates filled from word lists, drawn with a fixed seed. Answers come from the model being served, at
training time; this file holds only the prompts. None of it comes from MT-bench, the evaluation set.
"""
import json
import random
from pathlib import Path

NUM_PROMPTS = 2400
SEED = 0

TOPICS = [
    "photosynthesis", "the French Revolution", "compound interest", "volcanoes", "the immune system", "machine learning",
    "the water cycle", "ancient Rome", "climate change", "the stock market", "black holes", "healthy sleep",
    "the printing press", "electric cars", "honeybees", "the Internet", "chess", "baking bread", "the Silk Road",
    "plate tectonics", "vaccines", "jazz", "solar power", "the human brain", "coral reefs", "supply and demand",
    "the Moon landing", "recycling", "Shakespeare", "bicycles", "the Olympic Games", "prime numbers", "coffee",
    "remote work", "urban gardening", "the Roman aqueducts", "artificial satellites", "inflation", "meditation",
    "the Renaissance", "earthquakes", "public libraries", "video games", "the periodic table", "rainforests",
    "smartphones", "the Great Wall of China", "antibiotics", "wind turbines", "the human heart", "democracy",
    "social media", "the Industrial Revolution", "deep sea creatures", "tea ceremonies", "classical music",
    "electric guitars", "the metric system", "glaciers", "online privacy", "space tourism", "microplastics",
    "the ancient Egyptians", "bird migration", "nuclear fusion", "minimalism", "public transport", "3D printing",
    "volunteering", "the gig economy", "sourdough", "marathon training", "the Cold War", "quantum computers",
    "street art", "language learning", "water scarcity", "the Vikings", "self-driving cars", "bees and pollination",
]
FORMS = ["short story", "poem", "blog post", "persuasive essay", "product description", "speech", "newsletter",
         "diary entry", "letter to a friend", "news report", "limerick", "dialogue between two friends"]
AUDIENCES = ["a ten-year-old", "a busy manager", "a retired engineer", "a first-year student", "a tourist",
             "a skeptical reader", "my grandmother", "a small business owner"]
PERSONAS = ["a ship's captain", "a medieval knight", "a patient chemistry teacher", "a travel guide in Kyoto",
            "a detective in 1920s London", "a personal fitness coach", "a chef in a busy restaurant", "a museum curator",
            "an astronaut on the space station", "a friendly librarian", "a startup founder", "a park ranger",
            "a sports commentator", "a career counsellor", "a pirate", "a wise old farmer"]
CODE_TASKS = [
    "reverses the words in a sentence", "checks whether a string is a palindrome", "returns the n-th Fibonacci number",
    "merges two sorted lists into one sorted list", "counts how often each word appears in a text",
    "finds the largest and smallest number in a list", "removes duplicates from a list while keeping the order",
    "converts a temperature from Celsius to Fahrenheit", "checks whether a number is prime", "computes a factorial",
    "performs a binary search in a sorted array", "flattens a nested list", "validates an email address",
    "returns the longest common prefix of a list of strings", "rotates a matrix by 90 degrees",
    "parses a CSV line into fields", "computes the moving average of a list", "groups words that are anagrams",
    "finds the second largest element of an array", "checks whether brackets in a string are balanced",
    "sorts a list of dictionaries by a key", "counts the vowels in a string", "returns the greatest common divisor",
    "reads a text file and prints its longest line", "converts a Roman numeral to an integer",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C++", "Java", "Go", "Rust"]
NAMES = ["Alice", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Keiko", "Luis", "Maya", "Noah"]
ITEMS = ["apples", "books", "marbles", "stickers", "pencils", "cookies", "coins", "stamps"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Krakow", "Lima", "Melbourne", "Cairo", "Oslo", "Hanoi"]
COMPANIES = ["Northwind Foods", "BluePeak Energy", "Orbit Robotics", "Greenleaf Bank", "Sunset Airlines", "Pixel Forge"]
SCIENCE = [
    "why the sky is blue", "how a refrigerator keeps food cold", "what causes the seasons", "how vaccines train the immune system",
    "how a transistor works", "why ice floats on water", "how DNA stores information", "what entropy means",
    "how GPS finds your position", "why we have tides", "how batteries store energy", "what a black hole is",
    "how airplanes stay in the air", "how the kidneys clean the blood", "what causes lightning", "how lenses focus light",
    "why metals conduct electricity", "how enzymes speed up reactions", "what dark matter is", "how sound travels",
]
HUMANITIES = [
    "the causes of the First World War", "the influence of Greek philosophy on modern thought", "the role of trade in ancient cities",
    "how the printing press changed religion and politics", "the ideas of the Enlightenment", "the legacy of the Roman Empire",
    "the impact of colonialism on language", "the history of human rights", "the rise of the novel as a literary form",
    "the effects of globalisation on local cultures", "the ethics of free speech", "the history of money",
    "why societies build monuments", "the role of music in protest movements", "the economics of minimum wages",
]


def writing(rng: random.Random) -> str:
    topic = rng.choice(TOPICS)
    return rng.choice([
        f"Write a {rng.choice(FORMS)} about {topic}.",
        f"Write a {rng.choice(FORMS)} about {topic} for {rng.choice(AUDIENCES)}.",
        f"Draft an email to my team announcing a workshop on {topic}. Keep it friendly and under 150 words.",
        f"Give me five catchy headlines for an article about {topic}.",
        f"Rewrite this sentence to sound more formal: \"{topic.capitalize()} is kind of a big deal and everyone should care.\"",
    ])


def roleplay(rng: random.Random) -> str:
    persona, topic = rng.choice(PERSONAS), rng.choice(TOPICS)
    return rng.choice([
        f"Pretend you are {persona}. Tell me what a normal day looks like for you.",
        f"You are {persona}. Explain {topic} to me in your own voice.",
        f"Act as {persona} and give me three pieces of advice for someone starting out.",
        f"Stay in character as {persona}. A visitor asks you about {topic}. What do you say?",
    ])


def reasoning(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    y = rng.randint(2, 15)
    x = rng.randint(y + 3, 40)
    return rng.choice([
        f"{a} has {x} {rng.choice(ITEMS)} and gives {y} to {b}, who then has twice as many as {a}. "
        f"How many did {b} have at first? Explain step by step.",
        f"{a} is taller than {b}, and {b} is taller than {rng.choice(NAMES)}. Who is the shortest? Explain your reasoning.",
        f"If it takes {y} workers {x} hours to build a wall, how long would it take {y * 2} workers? State your assumptions.",
        f"A train leaves {rng.choice(CITIES)} at {rng.randint(1, 11)} am travelling at {x + 40} km/h. How far has it gone after {y} hours?",
        f"Is this argument valid? All {rng.choice(ITEMS)} in the box are red. {a} took one from the box. So {a}'s is red. Explain.",
    ])


def math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 12), rng.randint(1, 30), rng.randint(31, 120)
    return rng.choice([
        f"Solve for x: {a}x + {b} = {c}. Show each step.",
        f"What is the sum of the first {c} positive integers? Explain the formula you use.",
        f"A rectangle is {a} cm wide and {b + a} cm long. What are its area and perimeter?",
        f"Find the derivative of f(x) = {a}x^3 - {b}x + {c}.",
        f"What is {b}% of {c * 10}? Explain how to compute it.",
        f"A fair die is rolled twice. What is the probability that the sum is {rng.randint(3, 11)}?",
        f"Simplify the fraction {a * b}/{a * c} and explain each step.",
    ])


def coding(rng: random.Random) -> str:
    task, language = rng.choice(CODE_TASKS), rng.choice(LANGUAGES)
    return rng.choice([
        f"Write a {language} function that {task}.",
        f"Write a {language} function that {task}, and explain how it works.",
        f"How would you test a function that {task}? Give example test cases in {language}.",
        f"What is the time complexity of a function that {task}? Write a short {language} implementation.",
    ])


def extraction(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    company, city = rng.choice(COMPANIES), rng.choice(CITIES)
    year, amount = rng.randint(1995, 2025), rng.randint(2, 90)
    passage = (f"In {year}, {company} opened a new office in {city}. Its chief executive, {a}, said the move would "
               f"create {amount * 10} jobs, while {b}, the city's mayor, promised {amount} million dollars of support.")
    return rng.choice([
        f"List every person, company, place and year mentioned in this text: {passage}",
        f"Return a JSON object with the keys company, city, year and jobs for this text: {passage}",
        f"Summarise this in one sentence: {passage}",
        f"Answer from the text only: who is the mayor, and how much money was promised? {passage}",
    ])


def science(rng: random.Random) -> str:
    question = rng.choice(SCIENCE)
    return rng.choice([
        f"Explain {question}.",
        f"Explain {question} to {rng.choice(AUDIENCES)}.",
        f"What are common misconceptions about {question}?",
        f"Describe {question}, then give an everyday example.",
    ])


def humanities(rng: random.Random) -> str:
    subject = rng.choice(HUMANITIES)
    return rng.choice([
        f"Discuss {subject}.",
        f"Give three arguments for and three against this view: {subject} still matters today.",
        f"Write a short lesson plan for teaching {subject} to high-school students.",
        f"Compare two historians' possible views on {subject}.",
        f"Explain {subject} to {rng.choice(AUDIENCES)}.",
        f"Write a {rng.choice(FORMS)} inspired by {subject}.",
    ])


KINDS = [writing, roleplay, reasoning, math, coding, extraction, science, humanities]


def main() -> None:
    rng = random.Random(SEED)
    prompts: dict[str, str] = {}
    for kind in KINDS:  # an equal share of distinct prompts per kind, fewer where the templates run out
        drawn = {kind(rng) for _ in range(4 * NUM_PROMPTS // len(KINDS))}
        prompts |= {prompt: kind.__name__ for prompt in sorted(drawn)[: NUM_PROMPTS // len(KINDS)]}
    prompts = dict(rng.sample(sorted(prompts.items()), len(prompts)))
    output = Path(__file__).with_name("draft_prompts.jsonl")
    with open(output, "w") as file:
        for prompt, kind in prompts.items():
            file.write(json.dumps({"prompt": prompt, "kind": kind}) + "\n")
    print(f"{len(prompts)} prompts -> {output}")


if __name__ == "__main__":
    main()
