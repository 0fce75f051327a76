"""Routing benchmark: accuracy on the labelled set, and in-process route latency with the
24-lane default roster and a generated 1,000-lane roster, against a bare reference
(`text.lower().split()` + a set intersection with every lane's keywords) measured in the same
run. Targets: >= 90% top-1 on decided, <= 15% escalation of in-roster, >= 80% of
should-escalate escalated; p50 <= 50 µs (24 lanes) and <= 1 ms (1,000 lanes)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from daemon.routing import Router
from roster.models import Roster
from surfaces.cli.route import read_roster
from tests.routing.labelled import LABELLED, Accuracy, evaluate, load

PASSES = 15
FRESH = LABELLED.with_name("fresh.jsonl")


def generated_roster(lanes: int, seed: int = 11) -> Roster:
    """`lanes` lanes drawn from a 6,000-word vocabulary: 8-30 keywords and 3-6 two-word
    phrases each, so common words land in many lanes (IDF matters) as in a real roster."""
    rng = random.Random(seed)
    vocabulary = [f"w{i}x" for i in range(6000)]
    weights = [1 / (rank + 1) for rank in range(len(vocabulary))]  # Zipf-like reuse
    members = [{"name": "m", "url": "http://127.0.0.1:1/v1", "model_id": "x"}]
    data: dict[str, Any] = {
        "models": members,
        "tiers": {"ladder": ["cheap"], "cheap": ["m"]},
        "lanes": [],
    }
    for index in range(lanes):
        words = sorted(set(rng.choices(vocabulary, weights, k=rng.randint(8, 30))))
        phrases = [" ".join(rng.sample(vocabulary[:2000], 2)) for _ in range(rng.randint(3, 6))]
        negative = rng.sample(vocabulary, 2)
        data["lanes"].append(
            {
                "name": f"lane{index}",
                "keywords": words,
                "phrases": phrases,
                "negative": negative,
                "tier": "cheap",
                "system": "s",
            }
        )
    return Roster.model_validate(data)


def generated_requests(roster: Roster, count: int, seed: int = 12) -> list[str]:
    """Requests of 6-40 words mixing a lane's keywords with filler words."""
    rng = random.Random(seed)
    filler = [
        "please",
        "can",
        "you",
        "help",
        "me",
        "with",
        "the",
        "this",
        "our",
        "in",
        "a",
        "for",
        "to",
        "of",
        "and",
        "it",
    ]
    out = []
    for _ in range(count):
        lane = rng.choice(roster.lanes)
        words = rng.sample(lane.keywords, min(3, len(lane.keywords)))
        words += rng.choices(filler, k=rng.randint(3, 30))
        words += [rng.choice(rng.choice(roster.lanes).keywords)]
        rng.shuffle(words)
        out.append(" ".join(words))
    return out


class Reference:
    """The bare baseline: lowercase, split on whitespace, intersect with each lane's set."""

    def __init__(self, roster: Roster) -> None:
        self.lanes = [(lane.name, frozenset(lane.keywords)) for lane in roster.lanes]

    def route(self, text: str) -> str | None:
        tokens = set(text.lower().split())
        best, best_hits = None, 0
        for name, keywords in self.lanes:
            hits = len(tokens & keywords)
            if hits > best_hits:
                best, best_hits = name, hits
        return best


def latencies(call: Callable[[str], object], texts: Sequence[str]) -> list[float]:
    """Per-call wall time in µs, PASSES passes over the texts (after one warm-up pass)."""
    for text in texts:
        call(text)
    clock = time.perf_counter_ns
    samples = []
    for _ in range(PASSES):
        for text in texts:
            start = clock()
            call(text)
            samples.append((clock() - start) / 1000)
    return samples


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def accuracy_row(name: str, acc: Accuracy) -> str:
    return (
        f"| {name} | {acc.in_roster} | {acc.top1:.1%} ({acc.correct}/{acc.decided}) "
        f"| {acc.escalation_rate:.1%} | {acc.escalation_recall:.1%} "
        f"({acc.escalated}/{acc.should_escalate}) |"
    )


def main() -> None:
    roster = read_roster()
    router = Router(roster)
    examples = load()
    print("| labelled set | in-roster | top-1 on decided | in-roster escalated |", end=" ")
    print("should-escalate escalated |")
    print("|---|---|---|---|---|")
    print(accuracy_row("all", evaluate(router, examples)))
    print(
        accuracy_row(
            "tuned (not holdout)", evaluate(router, [e for e in examples if not e.holdout])
        )
    )
    print(accuracy_row("holdout", evaluate(router, [e for e in examples if e.holdout])))
    print(accuracy_row("fresh (see note)", evaluate(router, load(FRESH))))
    print(
        "\nTargets: top-1 >= 90%, in-roster escalated <= 15%, should-escalate escalated >= 80%.\n"
        "The labelled set was written before the roster; the roster was tuned on its non-holdout\n"
        "lines only. The fresh set was written after the roster was frozen; its blind run gave\n"
        "85.2% top-1 (23/27), 43.8% in-roster escalated, 75.0% (6/8) should-escalate escalated;\n"
        "each lane's vocabulary was then widened once with general domain words, so the fresh\n"
        "row above is no longer blind.\n"
    )

    big = generated_roster(1000)
    start = time.perf_counter()
    big_router = Router(big)
    build_ms = (time.perf_counter() - start) * 1000
    texts = [e.text for e in examples]
    big_texts = generated_requests(big, 300)
    print(
        "| route latency (in-process) | p50 µs | p99 µs | reference p50 µs | p50 ratio | target |"
    )
    print("|---|---|---|---|---|---|")
    for label, subject, requests, target in (
        ("24 lanes, labelled set", router, texts, "p50 <= 50 µs"),
        ("1,000 lanes, generated", big_router, big_texts, "p50 <= 1000 µs"),
    ):
        reference = Reference(subject.roster)
        ours = latencies(subject.route, requests)
        base = latencies(reference.route, requests)
        p50, base50 = statistics.median(ours), statistics.median(base)
        print(
            f"| {label} ({len(requests)} requests x {PASSES}) | {p50:.1f} | "
            f"{percentile(ours, 0.99):.1f} | {base50:.1f} | {p50 / base50:.2f}x | {target} |"
        )
    print(
        f"\nReference: `text.lower().split()` + set intersection with every lane's keywords "
        f"(no stemming, phrases, IDF or negatives). Building the 1,000-lane index: "
        f"{build_ms:.0f} ms."
    )
