"""Routing benchmark: accuracy on the labelled, fresh and blind sets (before and after
router2), and in-process route latency with the 24-lane default roster and a generated
1,000-lane roster, against a bare reference
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
BLIND = LABELLED.with_name("blind.jsonl")
WALKTHROUGH = LABELLED.with_name("walkthrough.jsonl")
NEWUSER = LABELLED.with_name("newuser.jsonl")
DEV = LABELLED.with_name("dev.jsonl")
DEV2 = LABELLED.with_name("dev2.jsonl")

# The same sets routed by the router and roster of commit 53704b3 (before the router2 branch),
# measured once; kept here so the table shows before and after side by side.
BEFORE = {
    "all": "98.9% (179/181) | 5.7% | 86.4% (19/22)",
    "tuned (not holdout)": "99.3% (139/140) | 6.0% | 91.7% (11/12)",
    "holdout": "97.6% (40/41) | 4.7% | 80.0% (8/10)",
    "fresh": "92.3% (36/39) | 18.8% | 75.0% (6/8)",
    "blind": "97.1% (101/104) | 13.3% | 65.0% (13/20)",
    # router3: the README walkthrough set, routed by the router and roster of main at d567fd0
    "walkthrough (tuned on)": "42.9% (3/7) | 56.2% | 0.0% (0/0)",
    "walkthrough (holdout)": "100.0% (5/5) | 50.0% | 100.0% (1/1)",
    # router4: the dev set and the new-user set, routed by the router and roster of 385362d
    "dev (tuned on)": "96.6% (57/59) | 20.3% | 100.0% (6/6)",
    "new user (never tuned on)": "95.1% (39/41) | 28.1% | 100.0% (7/7)",
    # router5: the dev2 set, routed by the router and roster of main at d4dd1ed
    "dev2 (tuned on)": "95.2% (60/63) | 23.2% | 100.0% (8/8)",
    "dev2 (holdout)": "91.2% (31/34) | 15.0% | 100.0% (4/4)",
}


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
    blind = load(BLIND)
    walkthrough = load(WALKTHROUGH)
    dev2 = load(DEV2)
    sets = [
        ("all", examples),
        ("tuned (not holdout)", [e for e in examples if not e.holdout]),
        ("holdout", [e for e in examples if e.holdout]),
        ("fresh", load(FRESH)),
        ("blind", blind),
        ("walkthrough (tuned on)", [e for e in walkthrough if not e.holdout]),
        ("walkthrough (holdout)", [e for e in walkthrough if e.holdout]),
        ("dev (tuned on)", load(DEV)),
        ("dev2 (tuned on)", [e for e in dev2 if not e.holdout]),
        ("dev2 (holdout)", [e for e in dev2 if e.holdout]),
        ("new user (never tuned on)", load(NEWUSER)),
    ]
    print("| set | in-roster | top-1 on decided | in-roster escalated |", end=" ")
    print("should-escalate escalated | before: top-1 | before: escalated |", end=" ")
    print("before: should-escalate |")
    print("|---|---|---|---|---|---|---|---|")
    for name, subset in sets:
        before = BEFORE.get(name, "- | - | -")
        print(f"{accuracy_row(name, evaluate(router, subset))} {before} |")
    print(
        "\nTargets: top-1 >= 90%, in-roster escalated <= 15%, should-escalate escalated >= 80%.\n"
        "labelled: written before the first roster, which was tuned on its non-holdout lines.\n"
        "fresh: written after that roster; its vocabulary was widened once after a look at it,\n"
        "and router2's constants were chosen on labelled (not holdout) + fresh together.\n"
        "blind: 120 + 20 requests written on router2 before reading the roster or the other\n"
        "sets; the 'before' column is its truly blind run. router2 then widened lane vocabulary\n"
        "from domain knowledge after seeing that run's errors (exact blind phrases left out),\n"
        "so the blind row is no longer blind: read it as an optimistic bound.\n"
        "walkthrough: requests a README walkthrough found misrouted (tokens, JWTs, XSS, CSRF,\n"
        "replay, secrets, CVEs; version bumps and release notes; 'fix the login API'), written\n"
        "before router3 tuned the roster on its non-holdout lines; the holdout lines were not\n"
        "looked at until the tuning was done. 'before' is main at d567fd0 on the same lines.\n"
        "new user: 57 requests a new user might type, one to three per lane, and 7 off-topic\n"
        "ones (they go to the `general` lane without a model call), written before any change\n"
        "to the router or the roster and never used to tune either.\n"
        "dev: 74 + 6 new-user-style requests written for router4 (before it looked at them),\n"
        "then tuned on: lane vocabulary widened from domain knowledge (tables, IDOR, fonts,\n"
        "callbacks, flaky tests, ...) and CONTEST_RATIO 0.6 -> 0.7; then the default roster's\n"
        "threshold 0.4 -> 0.35 (the Policy default), chosen on labelled + fresh + blind.\n"
        "The new-user set was routed after each of the two steps (21.1%, then 17.5% escalated)\n"
        "and only its totals were looked at.\n"
        "dev2: 122 + 12 new-user-style requests (casual, typos, vague verbs), spread over the\n"
        "lanes roughly as often as users ask, written and committed for router5 before any\n"
        "change; a third marked holdout. Lane vocabulary was then widened on the errors of\n"
        "dev + dev2 (tuned on) only, plus everyday words of each lane taken from no test\n"
        "sentence; no policy change. The holdout lines were never looked at (totals only), so\n"
        "the dev2 (holdout) row is the honest estimate of how the changes generalise.\n"
        "The new-user set was routed once after router5 (14.0% escalated, 95.9% top-1);\n"
        "only its totals were looked at, as before.\n"
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
