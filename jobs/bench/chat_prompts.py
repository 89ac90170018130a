"""The `chat` presets' requests: real-length chat prompts, built in (nothing downloaded).

Each request is one user turn. A short one is a question or instruction of its own; a
longer one is a run of sentences from the passages below (real prose on everyday
topics) followed by a task about them ("Summarise the text above..."), as people paste
a document and ask about it. The request's prompt length is drawn from the preset
(tokens of the whole templated prompt); the passage is as many sentences as fit under
it, found by bisection. Every conversation goes through the model's chat template and
is tokenized once, by fusegen's tokenizer, before any engine runs: every engine gets
the same prompt ids.
"""
from __future__ import annotations

import random

from fusegen.jobs.bench.presets import LengthDist
from fusegen.jobs.bench.workload import BenchRequest, draw_length

QUESTIONS = [
    "What is the capital of Australia?",
    "Write a haiku about the first snow of winter.",
    "Explain in two sentences why the sky is blue.",
    "Give me three ideas for a vegetarian dinner that takes less than thirty minutes.",
    "What is the difference between weather and climate?",
    "Translate 'Where is the train station?' into French, Spanish and German.",
    "How do I reverse a list in Python? Show a short example.",
    "Write a polite email to my landlord asking when the heating will be repaired.",
    "What are the main causes of inflation?",
    "Suggest a name for a small bakery that sells sourdough bread.",
    "How many minutes are there in a week? Show your working.",
    "Explain what a black hole is to a ten-year-old.",
    "List five tips for sleeping better.",
    "What is photosynthesis, and why does it matter for life on Earth?",
    "Write a short story of about five sentences about a lost umbrella.",
    "What should I pack for a weekend hiking trip in the mountains?",
    "Explain the rules of chess for the knight and the bishop.",
    "Is it better to rent or to buy a home? Give the main arguments on both sides.",
    "Describe the water cycle step by step.",
    "Write a limerick about a cat who loves to sleep in the sink.",
    "What is the Pythagorean theorem? Give an example with numbers.",
    "Recommend three classic novels for someone who enjoyed adventure stories as a child.",
    "How does a refrigerator keep food cold?",
    "Summarise the plot of Romeo and Juliet in four sentences.",
    "What are some good ways to learn a new language as an adult?",
    "Write a thank-you note to a colleague who helped me finish a difficult project.",
    "Why do leaves change colour in autumn?",
    "What is the difference between a virus and a bacterium?",
    "Plan a one-day itinerary for a first visit to Rome.",
    "Explain what compound interest is, with a simple example.",
    "I have eggs, spinach, cheese and bread. What can I cook for breakfast?",
    "What are the pros and cons of working from home?",
]

TASKS = [
    "Summarise the text above in three sentences.",
    "What is the main point of this passage? Answer briefly.",
    "Write five questions a teacher could ask about this text.",
    "Rewrite the passage above in simpler words for a young reader.",
    "List the key facts from the text as bullet points.",
    "What is one thing the text leaves out that a reader might want to know?",
    "Give the passage a short, catchy title and explain your choice.",
    "Translate the first two sentences of the text into French.",
]

PASSAGES = [
    "Bread is one of the oldest prepared foods. Archaeologists have found traces of "
    "flatbread baked over fourteen thousand years ago, before farming began. Early bakers "
    "ground wild grains between stones and cooked the paste on hot embers. Leavened bread "
    "came later, when people noticed that dough left in the warmth rose and became lighter. "
    "The yeasts and bacteria responsible live on the grain itself and in the air. Sourdough "
    "bakers still keep these cultures alive today, feeding them flour and water every day. "
    "A good starter can be passed down for generations.",
    "Lighthouses guided ships along dangerous coasts for centuries. The most famous ancient "
    "example stood at Alexandria and was counted among the wonders of the world. Early "
    "lighthouses burned wood or coal in open fires, which were hard to see in bad weather. "
    "The invention of the Fresnel lens in the nineteenth century changed everything. Its "
    "rings of glass prisms bent the light into a narrow, powerful beam visible for many "
    "miles. Each lighthouse was given its own pattern of flashes so that sailors could tell "
    "them apart at night. Today most lighthouses are automated, and many keepers' cottages "
    "have become museums or holiday homes.",
    "The honeybee colony works like a single organism. A queen lays up to two thousand eggs "
    "a day during the summer. Worker bees change jobs as they age: the youngest clean cells "
    "and feed larvae, older ones build comb and guard the entrance, and the oldest fly out "
    "to gather nectar and pollen. A forager that finds a rich patch of flowers returns to "
    "the hive and performs a waggle dance. The angle of the dance tells the others the "
    "direction of the food relative to the sun, and its length tells them the distance. In "
    "winter the bees cluster together and shiver their muscles to keep the queen warm.",
    "Trains changed how people thought about time. Before railways, each town kept its own "
    "local time, set by the position of the sun at noon. A clock in one city might differ "
    "from a clock fifty miles away by several minutes. This did not matter when travel was "
    "slow, but railway timetables became confusing and even dangerous. In the eighteen "
    "forties British railways adopted a single standard time taken from Greenwich. Other "
    "countries followed with time zones, and in 1884 an international conference chose "
    "Greenwich as the prime meridian for the whole world.",
    "Libraries have existed for as long as writing itself. The library of Ashurbanipal in "
    "Nineveh held thousands of clay tablets, some of which survived because the building "
    "burned and the fire baked the clay hard. Medieval monasteries copied books by hand, "
    "and a single Bible could take a scribe years to finish. The printing press made books "
    "cheaper, and public lending libraries spread in the nineteenth century. Modern "
    "libraries lend not only books but also films, music, tools and even seeds. Many "
    "people use them as quiet places to study or work.",
    "Rain on a roof makes a sound that many people find calming. Scientists who study "
    "sound describe it as a kind of broadband noise, similar to the hiss of a radio between "
    "stations. Because it covers many frequencies at once, it masks sudden sounds that "
    "might otherwise wake a sleeper. The drops themselves are not shaped like tears, as "
    "they are often drawn. Small raindrops are almost perfect spheres, and larger ones "
    "flatten at the bottom as they fall, like a hamburger bun. Drops bigger than about "
    "five millimetres break apart before they reach the ground.",
    "The Moon is slowly moving away from the Earth. Laser beams fired from observatories "
    "bounce off mirrors left on its surface by astronauts, and the time they take to return "
    "shows that the distance grows by about four centimetres a year. The cause is the tide. "
    "The Moon pulls the oceans into a bulge, and because the Earth spins faster than the "
    "Moon orbits, the bulge runs slightly ahead of it. The bulge tugs the Moon forward, "
    "raising its orbit, while the Earth's rotation slows a little. Millions of years ago a "
    "day on Earth lasted only about twenty-two hours.",
    "Autumn colours come from pigments that were in the leaves all along. During the "
    "summer, green chlorophyll is so abundant that it hides the yellow and orange "
    "carotenoids. As days shorten and nights grow cold, trees stop making chlorophyll and "
    "break it down to recover its nitrogen. The yellows appear as the green fades. Reds and "
    "purples are different: they come from anthocyanins, which some trees make fresh in "
    "the autumn, especially after bright sunny days and cool nights. That is why the "
    "colours are more vivid in some years than in others.",
    "The sea covers about seventy percent of the Earth's surface, yet most of it remains "
    "unexplored. Sunlight reaches only the top two hundred metres or so; below that lies "
    "the twilight zone, and below a thousand metres there is no sunlight at all. Animals "
    "of the deep make their own light, using it to hunt, to hide and to find mates. The "
    "pressure at the bottom of the deepest trench is more than a thousand times that at "
    "the surface. Even so, scientists have found shrimp, worms and fish living there. "
    "Every expedition to the deep sea discovers species no one has seen before.",
    "Learning to ride a bicycle is a lesson in balance and momentum. A moving bicycle is "
    "much easier to keep upright than a still one, partly because the rider can steer into "
    "a fall to correct it. The shape of the front fork also helps: the wheel touches the "
    "ground slightly behind the line of the steering axis, so the bicycle tends to steer "
    "itself back under the rider. Children often learn faster on a balance bike without "
    "pedals, because they can concentrate on steering before they learn to pedal. Once "
    "learned, the skill is almost never forgotten.",
]


def _sentences() -> list[str]:
    return [s.strip().rstrip(".") + "." for p in PASSAGES for s in p.split(". ")]


SENTENCES = _sentences()


def make_chat_workload(tokenizer, num_requests: int, prompt_len: LengthDist,
                       output_len: LengthDist, seed: int = 0) -> list[BenchRequest]:
    """Requests whose prompt ids are chat-templated conversations; the same seed and
    tokenizer give the same requests."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        target, budget = draw_length(prompt_len, rng), draw_length(output_len, rng)
        prompt = _fit(tokenizer, target, rng.choice(QUESTIONS), rng.choice(TASKS),
                      rng.randrange(len(SENTENCES)))
        requests.append(BenchRequest(prompt, budget))
    return requests


def conversation(question: str, task: str, start: int, num_sentences: int) -> list[dict]:
    """One user turn: the question alone, or `num_sentences` sentences of the passages
    from `start` on (wrapping around) and the task about them."""
    if num_sentences == 0:
        return [{"role": "user", "content": question}]
    passage = " ".join(SENTENCES[(start + i) % len(SENTENCES)] for i in range(num_sentences))
    return [{"role": "user", "content": f"{passage}\n\n{task}"}]


def _fit(tokenizer, target: int, question: str, task: str, start: int) -> list[int]:
    """The longest conversation whose prompt has at most `target` tokens (the question
    alone when even one sentence is too many). Lengths grow with the sentence count, so
    a bisection over it needs ~log2(len(SENTENCES)) tokenizations."""
    def ids(n: int) -> list[int]:
        return tokenizer.encode_chat(conversation(question, task, start, n))

    best, low, high = ids(0), 1, len(SENTENCES)
    while low <= high:
        mid = (low + high) // 2
        candidate = ids(mid)
        if len(candidate) <= target:
            best, low = candidate, mid + 1
        else:
            high = mid - 1
    return best
