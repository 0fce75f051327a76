"""What `submit` does with a route: the decision `tally route` shows and the engine takes.

One function (`decide`) for both, so the preview cannot drift from the run: the route's lane
when it decided; else, with no classifier configured (or one no stronger than the lanes'
first rung), the best-scoring lane or `general`, with no model call; else the classifier on
the best-scoring few lanes and `general`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict

from roster.models import Roster

GENERAL = "general"
"""The fallback lane: a request no lane's words match goes here, with no model call."""
CANDIDATES = 4
"""Lanes a classifier chooses among: the best-scoring few, not every lane."""


class Decision(BaseModel):
    """What `submit` does with a request, in one place so `route` shows exactly that.

    `source`: "router", the route decided `lane`; "scores", it escalated and no classifier is
    configured, so the best-scoring `lane` with no model call; "general", no lane is a candidate
    (its evidence below the floor, or too few of the request's words pointing at it), so the
    `general` lane with no model call; "classifier", the
    `classifier` (a tier or member) picks among `candidates` with one model call, and `lane`
    is None until it has."""

    model_config = ConfigDict(frozen=True)

    lane: str | None
    source: Literal["router", "scores", "general", "classifier"]
    model_call: bool
    classifier: str | None = None
    candidates: list[str] = []

    def __str__(self) -> str:
        if self.source == "router":
            return f"{self.lane}"
        if self.source == "scores":
            return f"{self.lane} (best score, too close to call; no classifier set: no model call)"
        if self.source == "general":
            return f"{self.lane} (no lane's words or examples match it enough: no model call)"
        among = ", ".join(self.candidates)
        return f"classifier on `{self.classifier}` picks among {among} (one model call)"


def classifier_of(roster: Roster) -> str | None:
    """The roster's classifier, if it is stronger than the lanes' first rung: a tier whose
    members all serve the first rung too would add a model call and no judgment."""
    name = roster.policy.classifier
    if name is None:
        return None
    tiers = roster.tiers
    members = set(tiers.members.get(name, [name]))
    first = set(tiers.members.get(tiers.ladder[0], []))
    return name if members - first else None


def decide(roster: Roster, lane: str | None, ranked: Sequence[str]) -> Decision:
    """What submit does with a route that decided `lane` (or None) over the `ranked` lanes."""
    if lane is not None:  # before the set of names: at 1,000 lanes it was a third of a route
        return Decision(lane=lane, source="router", model_call=False)
    names = {item.name for item in roster.lanes}
    ranked = [name for name in ranked if name in names]
    classifier = classifier_of(roster)
    if classifier is None or not ranked:
        if ranked:
            return Decision(lane=ranked[0], source="scores", model_call=False)
        fallback = GENERAL if GENERAL in names else roster.lanes[0].name
        return Decision(lane=fallback, source="general", model_call=False)
    candidates = ranked[:CANDIDATES]
    if GENERAL in names and GENERAL not in candidates:
        candidates.append(GENERAL)  # the classifier may say that no lane fits
    return Decision(
        lane=None,
        source="classifier",
        model_call=True,
        classifier=classifier,
        candidates=candidates,
    )
