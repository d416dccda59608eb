"""Fixed texts for judging a similarity model: labelled prompt pairs and prompts of typical lengths.

`PAIRS` are real-world question pairs, each marked whether the two ask the same thing. The hard ones
matter most: decorated copies (a greeting, a thank-you) of one wording, which the merge engine must
group, and near misses (same topic, different question), which it must not. `prompt_texts` builds
prompts of 20-200 words from ordinary sentences, for CPU per text at the lengths users send.
Pure data and functions, no I/O.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Pair:
    """Two prompts and whether they ask the same thing (`same`)."""

    a: str
    b: str
    same: bool


_SAME = (
    ("How do I reset my password?", "How can I reset my password?"),
    ("How do I reset my password?", "Hi, how do I reset my password? Thanks."),
    ("What is the capital of France?", "What's the capital city of France?"),
    ("What is the capital of France?", "Which city is the capital of France?"),
    ("How do I cancel my subscription?", "How can I cancel my subscription?"),
    ("How do I cancel my subscription?", "Quick question: how do I cancel my subscription? Thank you!"),
    ("Summarise this article in three sentences.", "Summarize this article in three sentences."),
    ("Can I freeze cooked rice?", "Is it safe to freeze cooked rice?"),
    ("Can I freeze cooked rice?", "Hello! Can cooked rice be frozen? Thanks."),
    ("Do I need a visa to visit Japan?", "Is a visa required to visit Japan?"),
    ("Do I need a visa to visit Japan?", "Hey, does visiting Japan require a visa?"),
    ("Is the Lisbon metro open during the strike?", "Is the Lisbon metro running during the strike?"),
    ("How long should I roast a whole chicken?", "How long does a whole chicken take to roast?"),
    ("What is the best time of year to visit Kyoto?", "When is the best season to go to Kyoto?"),
    ("How do I share a folder with my team?", "How can I share a folder with my team members?"),
    ("Why is my phone battery draining so fast?", "Why does my phone battery run out so quickly?"),
    ("How do I convert Celsius to Fahrenheit?", "What is the formula to convert Celsius to Fahrenheit?"),
    ("What are the symptoms of dehydration?", "What are the signs of being dehydrated?"),
    ("How do I undo my last git commit?", "How can I revert the most recent commit in git?"),
    ("Recommend a good book about the history of Rome.", "Can you suggest a good book on Roman history?"),
    ("Translate 'good morning' into Spanish.", "How do you say 'good morning' in Spanish?"),
    ("How many calories are in a banana?", "How many calories does a banana have?"),
    ("Explain how photosynthesis works.", "Can you explain the process of photosynthesis?"),
    ("What time zone is Tokyo in?", "Which time zone does Tokyo use?"),
    ("How do I remove a red wine stain from a carpet?", "How can I get red wine out of a carpet?"),
)
_DIFFERENT = (
    ("How do I reset my password?", "Which planet is the largest in the solar system?"),
    ("What is the capital of France?", "Write a haiku about autumn leaves."),
    ("How do I cancel my subscription?", "Explain how photosynthesis works."),
    ("Summarise this article in three sentences.", "What time zone is Tokyo in?"),
    ("The cat sits on the mat.", "Quarterly revenue grew by twelve percent."),
    ("How do I bake sourdough bread at home?", "What is the capital of France?"),
    ("What is the capital of France?", "What is the capital of Germany?"),
    ("How do I reset my password?", "How do I change my email address?"),
    ("How do I cancel my subscription?", "How do I upgrade my subscription?"),
    ("Can I freeze cooked rice?", "Can I freeze cooked pasta?"),
    ("Do I need a visa to visit Japan?", "Do I need a visa to visit Canada?"),
    ("Is the Lisbon metro open during the strike?", "Is the Lisbon airport open during the strike?"),
    ("How long should I roast a whole chicken?", "How long should I roast a leg of lamb?"),
    ("What is the best time of year to visit Kyoto?", "What is the best area to stay in Kyoto?"),
    ("How do I share a folder with my team?", "How do I delete a folder shared with my team?"),
    ("Why is my phone battery draining so fast?", "Why is my laptop fan so loud?"),
    ("How do I convert Celsius to Fahrenheit?", "How do I convert miles to kilometres?"),
    ("What are the symptoms of dehydration?", "What are the symptoms of the flu?"),
    ("How do I undo my last git commit?", "How do I create a new branch in git?"),
    ("Recommend a good book about the history of Rome.", "Recommend a good film about ancient Rome."),
    ("Translate 'good morning' into Spanish.", "Translate 'good night' into French."),
    ("How many calories are in a banana?", "How much potassium is in a banana?"),
    ("Write a poem about the sea.", "Write a short story about the sea."),
    ("What is the boiling point of water?", "What is the freezing point of water?"),
)
PAIRS: tuple[Pair, ...] = (*(Pair(a, b, True) for a, b in _SAME), *(Pair(a, b, False) for a, b in _DIFFERENT))

_SENTENCES = (
    "I run a small bakery and we are moving our order system to a new cloud provider next month.",
    "Please explain the steps in plain language, because the people reading this are not engineers.",
    "The report should cover the last three quarters and compare them with the same period last year.",
    "Our customers mostly order on weekends, and the busiest hour is between nine and ten in the morning.",
    "Write the answer as a numbered list and keep every item under two sentences.",
    "We tried restarting the router twice, but the connection still drops every few minutes.",
    "My grandmother's recipe uses lard, but I would like a vegetarian version that tastes the same.",
    "The flight lands at six in the evening and the hotel is about forty minutes from the airport.",
    "Can you also point out anything in the contract that looks unusual or one-sided?",
    "The team has four developers, one designer and a product manager who joined last week.",
    "I am not sure whether the error comes from the database or from the network between the two servers.",
    "Use a friendly tone, avoid jargon, and end with a short summary of what to do next.",
    "Last winter the heating bill doubled even though we kept the thermostat at the same temperature.",
    "The museum is closed on Mondays, so we would like to plan the other days around that.",
    "Here is the paragraph I wrote for the grant application, and it feels far too long.",
    "Our son is allergic to peanuts and sesame, so please leave both out of every suggestion.",
    "The spreadsheet has one row per order with the date, the customer, the amount and the status.",
    "We need to decide by Friday whether to renew the lease or look for a smaller office.",
)


def prompt_texts(count: int, *, min_words: int = 20, max_words: int = 200, seed: int = 1) -> list[str]:
    """`count` different prompts of `min_words` to `max_words` words (evenly spread), built from plain sentences."""
    rng = random.Random(seed)
    texts = []
    for i in range(count):
        target = min_words + (max_words - min_words) * i // max(1, count - 1)
        words: list[str] = [f"Request-{seed}-{i}:"]
        while len(words) < target:
            words += rng.choice(_SENTENCES).split()
        texts.append(" ".join(words[:target]))
    rng.shuffle(texts)
    return texts
