"""The labelled routing set and its scoring, shared by the accuracy test and the benchmark."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from daemon.routing import Router

LABELLED = Path(__file__).with_name("labelled.jsonl")


@dataclass(frozen=True)
class Example:
    text: str
    lane: str | None  # None: should escalate
    holdout: bool
    kind: str = ""  # for lane None: "outside" (no lane fits) or "ambiguous" (several do)


@dataclass
class Accuracy:
    in_roster: int = 0
    decided: int = 0
    correct: int = 0
    should_escalate: int = 0
    escalated: int = 0
    errors: list[tuple[str, str | None, str | None]] = field(default_factory=list)

    @property
    def top1(self) -> float:
        """Correct among the in-roster requests the router decided."""
        return self.correct / self.decided if self.decided else 0.0

    @property
    def escalation_rate(self) -> float:
        """In-roster requests the router escalated instead of deciding."""
        return 1 - self.decided / self.in_roster if self.in_roster else 0.0

    @property
    def escalation_recall(self) -> float:
        """Should-escalate requests the router did escalate."""
        return self.escalated / self.should_escalate if self.should_escalate else 0.0


def load(path: Path = LABELLED) -> list[Example]:
    with path.open(encoding="utf-8") as f:
        return [Example(**json.loads(line)) for line in f if line.strip()]


def evaluate(router: Router, examples: Iterable[Example]) -> Accuracy:
    acc = Accuracy()
    for example in examples:
        route = router.route(example.text)
        if example.lane is None:
            acc.should_escalate += 1
            acc.escalated += route.escalate
            if not route.escalate:
                acc.errors.append((example.text, None, route.lane))
            continue
        acc.in_roster += 1
        if route.lane is not None:
            acc.decided += 1
            acc.correct += route.lane == example.lane
        if route.lane != example.lane:
            acc.errors.append((example.text, example.lane, route.lane))
    return acc
