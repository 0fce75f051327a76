"""The labelled routing set and its scoring, shared by the accuracy test and the benchmark."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from daemon.router import GENERAL, Router

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
            # an off-topic request is right to escalate, or to be decided `general` now that
            # the `general` lane has examples of its own (everyday requests)
            right = route.escalate or (example.kind == "outside" and route.lane == GENERAL)
            acc.should_escalate += 1
            acc.escalated += right
            if not right:
                acc.errors.append((example.text, None, route.lane))
            continue
        acc.in_roster += 1
        if route.lane is not None:
            acc.decided += 1
            acc.correct += route.lane == example.lane
        if route.lane != example.lane:
            acc.errors.append((example.text, example.lane, route.lane))
    return acc


@dataclass
class EndToEnd:
    """What `submit` does with each request (the route's `decision`), against the label: an
    in-roster request should end in its lane, an off-topic one ("outside") in `general`.
    Requests labelled ambiguous (several lanes fit) count in neither."""

    in_roster: int = 0
    in_roster_right: int = 0
    decided: int = 0
    decided_right: int = 0
    outside: int = 0
    outside_general: int = 0
    errors: list[tuple[str, str | None, str | None]] = field(default_factory=list)

    @property
    def top1(self) -> float:
        """End to end: the lane submit takes, the fallback included, is the labelled one."""
        total = self.in_roster + self.outside
        return (self.in_roster_right + self.outside_general) / total if total else 0.0

    @property
    def decided_top1(self) -> float:
        return self.decided_right / self.decided if self.decided else 0.0

    @property
    def escalation(self) -> float:
        """In-roster requests the route did not decide (a classifier would be asked)."""
        return 1 - self.decided / self.in_roster if self.in_roster else 0.0

    @property
    def general(self) -> float:
        return self.outside_general / self.outside if self.outside else 1.0

    def row(self) -> str:
        total = self.in_roster + self.outside
        right = self.in_roster_right + self.outside_general
        return (
            f"{self.top1:.1%} ({right}/{total}) | {self.decided_top1:.1%} "
            f"({self.decided_right}/{self.decided}) | {self.escalation:.1%} "
            f"({self.in_roster - self.decided}/{self.in_roster}) | "
            f"{self.outside_general}/{self.outside}"
        )


def end_to_end(router: Router, examples: Iterable[Example]) -> EndToEnd:
    acc = EndToEnd()
    for example in examples:
        if example.lane is None and example.kind != "outside":
            continue
        route = router.route(example.text)
        got = route.decision.lane
        if example.lane is None:
            acc.outside += 1
            acc.outside_general += got == "general"
            if got != "general":
                acc.errors.append((example.text, "general", got))
            continue
        acc.in_roster += 1
        acc.in_roster_right += got == example.lane
        if route.lane is not None:
            acc.decided += 1
            acc.decided_right += route.lane == example.lane
        if got != example.lane:
            acc.errors.append((example.text, example.lane, got))
    return acc
