"""Routing benchmark: what `submit` does with each request of every labelled set (the route's
`decision`, the fallback included), and route latency.

Per set: end-to-end top-1 (the lane submit takes, `general` or the best score included, is the
labelled one; off-topic requests should end in `general`), top-1 on the requests the router
decided, the share of in-roster requests it escalated (where a classifier would be asked), and
off-topic -> `general`. Targets (issue 31, default roster, no model, sets never tuned on):
end-to-end >= 85% and no set below 80%, every off-topic request to `general`, escalation
<= 15% of in-roster requests; the held-out parts of the older sets must not drop. Latency: p50
<= 1 ms per route with the 24-lane default roster and its examples, with 5,000 examples, and
with a generated 1,000-lane roster, against a bare reference (`text.lower().split()` + a set
intersection with every lane's keywords) measured in the same run."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from daemon.router import Router
from roster.loading import load_roster_text
from roster.models import Roster
from surfaces.cli.route import read_roster
from tests.routing.corpus import big_roster
from tests.routing.labelled import LABELLED, Example, end_to_end, load

PASSES = 15

# The same sets, end to end, with the router and roster of main at ccde225 (before issue 31):
# end-to-end top-1 | top-1 on decided | escalated | off-topic -> general.
BEFORE = {
    "labelled (tuned on)": "97.4% (151/155) | 99.2% (132/133) | 10.7% | 3/6",
    "labelled (holdout)": "97.9% (47/48) | 100.0% (39/39) | 9.3% | 4/5",
    "fresh": "90.6% (48/53) | 97.7% (42/43) | 10.4% | 3/5",
    "blind": "96.9% (126/130) | 100.0% (109/109) | 9.2% | 8/10",
    "walkthrough (tuned on)": "100.0% (16/16) | 100.0% (15/15) | 6.2% | 0/0",
    "walkthrough (holdout)": "90.0% (9/10) | 100.0% (7/7) | 30.0% | 0/0",
    "dev (tuned on)": "93.8% (75/80) | 100.0% (65/65) | 12.2% | 3/6",
    "dev2 (tuned on)": "94.4% (85/90) | 100.0% (76/76) | 7.3% | 4/8",
    "dev2 (holdout)": "88.6% (39/44) | 94.4% (34/36) | 10.0% | 2/4",
    "new user (never tuned on)": "89.1% (57/64) | 95.9% (47/49) | 14.0% | 5/7",
    "stranger (tuned on)": "83.9% (104/124) | 91.7% (77/84) | 23.6% | 9/14",
    "stranger (holdout)": "83.6% (51/61) | 95.3% (41/43) | 21.8% | 3/6",
}


def sets() -> list[tuple[str, list[Example]]]:
    folder = LABELLED.parent

    def split(name: str) -> tuple[list[Example], list[Example]]:
        examples = load(folder / f"{name}.jsonl")
        return [e for e in examples if not e.holdout], [e for e in examples if e.holdout]

    labelled, walkthrough, dev2, stranger, offtopic = (
        split(n) for n in ("labelled", "walkthrough", "dev2", "stranger", "offtopic")
    )
    return [
        ("labelled (tuned on)", labelled[0]),
        ("labelled (holdout)", labelled[1]),
        ("fresh", load(folder / "fresh.jsonl")),
        ("blind", load(folder / "blind.jsonl")),
        ("walkthrough (tuned on)", walkthrough[0]),
        ("walkthrough (holdout)", walkthrough[1]),
        ("dev (tuned on)", load(folder / "dev.jsonl")),
        ("dev2 (tuned on)", dev2[0]),
        ("dev2 (holdout)", dev2[1]),
        ("new user (never tuned on)", load(folder / "newuser.jsonl")),
        ("stranger (tuned on)", stranger[0]),
        ("stranger (holdout)", stranger[1]),
        ("off-topic (tuned on)", offtopic[0]),
        ("off-topic (holdout)", offtopic[1]),
        ("everyday off-topic (tuned on)", load(folder / "everyday.jsonl")),
        ("short in-roster (tuned on)", load(folder / "inroster.jsonl")),
        ("unseen (never tuned on)", load(folder / "unseen.jsonl")),
    ]


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


def main() -> None:
    roster = read_roster()
    router = Router(roster)
    router.prepare()
    print("| set | end-to-end top-1 | top-1 on decided | escalated | off-topic -> general ", end="")
    print("| before (ccde225): end-to-end | decided | escalated | off-topic |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, subset in sets():
        before = BEFORE.get(name, "- | - | - | -")
        print(f"| {name} | {end_to_end(router, subset).row()} | {before} |")
    print(
        "\nstranger: 165 in-roster + 20 off-topic requests in the style of people who never saw\n"
        "the roster, written and committed (edcfd4f) before any change for issue 31; every\n"
        "third line is held out. Issue 31 wrote the lanes' examples, then tuned the router's\n"
        "constants and a few keywords on the tuned-on parts of all sets (their errors read),\n"
        "and looked at the held-out parts' totals only. So the 'stranger (holdout)' and 'new\n"
        "user' rows are the honest estimate; 'dev2 (holdout)', 'labelled (holdout)' and\n"
        "'walkthrough (holdout)' were held out by earlier rounds too. For the sets' own\n"
        "histories (fresh, blind, dev, dev2, new user, walkthrough) see git log. off-topic:\n"
        "45 everyday requests no lane fits, written for issue 31 before tuning on them.\n"
        "everyday: 70 more off-topic requests, written (dccd78e) before the support rule and\n"
        "the general lane's examples were tuned on them. short in-roster: 84 casual requests\n"
        "(e8c6e87), written to measure what the support rule costs in-roster, then tuned on.\n"
        "unseen: 42 in-roster requests over all lanes + 26 off-topic, written and committed\n"
        "(2405f74) before any measurement on them and never tuned on.\n"
    )

    big_text, big_requests = big_roster()
    started = time.process_time()
    big_examples = Router(load_roster_text(big_text))
    big_examples.prepare()
    examples_ms = (time.process_time() - started) * 1000
    big = generated_roster(1000)
    started = time.process_time()
    big_router = Router(big)
    big_router.prepare()
    build_ms = (time.process_time() - started) * 1000
    texts = [e.text for _, subset in sets() for e in subset]
    print("| route latency (in-process) | p50 µs | p99 µs | reference p50 µs | target |")
    print("|---|---|---|---|---|")
    for label, subject, requests, target in (
        ("24 lanes + their examples, every set", router, texts, "p50 <= 1000 µs"),
        ("24 lanes, 5,000 examples, generated", big_examples, big_requests, "p50 <= 1000 µs"),
        ("1,000 lanes, generated", big_router, generated_requests(big, 300), "p50 <= 1000 µs"),
    ):
        reference = Reference(subject.roster)
        ours = latencies(subject.route, requests)
        base = latencies(reference.route, requests)
        print(
            f"| {label} ({len(requests)} requests x {PASSES}) | {statistics.median(ours):.1f} | "
            f"{percentile(ours, 0.99):.1f} | {statistics.median(base):.1f} | {target} |"
        )
    print(
        f"\nReference: `text.lower().split()` + set intersection with every lane's keywords "
        f"(no stemming, phrases, IDF, negatives or examples). Loading and indexing (CPU): "
        f"5,000 examples {examples_ms:.0f} ms, 1,000 lanes {build_ms:.0f} ms."
    )
