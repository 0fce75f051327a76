"""A large generated roster of examples and requests (tests and the routing benchmark)."""

from __future__ import annotations

import random

HEAD = """version = 1
[[models]]
name = "m"
url = "http://127.0.0.1:1/v1"
[tiers]
ladder = ["t"]
t = ["m"]
"""


def lane(name: str, examples: list[str] | str) -> str:
    if isinstance(examples, str):
        listed = examples
    else:
        listed = "[" + ", ".join(f'"{e}"' for e in examples) + "]"
    return (
        f'\n[[lanes]]\nname = "{name}"\nkeywords = ["{name}"]\ntier = "t"\n'
        f'system = "You do {name} work."\nexamples = {listed}\n'
    )


def big_roster(lanes: int = 24, per_lane: int = 209, seed: int = 5) -> tuple[str, list[str]]:
    """`lanes` x `per_lane` (>= 5,000) examples of 5-14 words from a Zipf-like vocabulary of
    3,000 words, each lane favouring its own 120 (a few shared with the next lane); and 312
    requests drawn the same way."""
    rng = random.Random(seed)
    vocabulary = [f"w{i}{'abcdefghij'[i % 10]}ord" for i in range(3000)]
    common = [1 / (rank + 1) for rank in range(len(vocabulary))]

    def sentence(own: list[str]) -> str:
        words = rng.choices(vocabulary, common, k=rng.randint(2, 6))
        words += rng.choices(own, k=rng.randint(3, 8))
        rng.shuffle(words)
        return " ".join(words)

    text = HEAD
    requests = []
    for index in range(lanes):
        own = vocabulary[200 + index * 110 : 200 + index * 110 + 120]
        text += lane(f"lane{index}", [sentence(own) for _ in range(per_lane)])
        requests += [sentence(own) for _ in range(300 // lanes + 1)]
    return text, requests
