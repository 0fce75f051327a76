"""Unit tests of the keyword router: normalization, stemming, phrases, negatives, IDF,
length independence, confidence and escalation, determinism."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest

from daemon.router import (
    CONTEST_MIN,
    CONTEST_RATIO,
    FLOOR,
    GENERIC_FACTOR,
    GENERIC_WORDS,
    NEGATIVE_PENALTY,
    PHRASE_BOOST,
    SATURATION,
    Classifier,
    Decision,
    Route,
    Router,
    normalize,
    term_of,
)
from daemon.stems import stem
from roster.models import Lane, Roster
from surfaces.cli.route import read_roster


def lane(name: str, keywords: list[str], **extra: Any) -> dict[str, Any]:
    return {"name": name, "keywords": keywords, "tier": "cheap", "system": "s", **extra}


def roster(*lanes: dict[str, Any], threshold: float = 0.4, margin: float = 0.1) -> Roster:
    return Roster.model_validate(
        {
            "policy": {"threshold": threshold, "margin": margin},
            "models": [{"name": "m", "url": "http://127.0.0.1:1/v1", "model_id": "x"}],
            "tiers": {"ladder": ["cheap"], "cheap": ["m"]},
            "lanes": list(lanes),
        }
    )


def score(evidence: float) -> float:
    return round(evidence / (evidence + SATURATION), 4)


@pytest.mark.parametrize(
    "forms",
    [
        ["test", "tests", "testing", "tested", "Tests"],
        ["run", "running", "runs"],
        ["cache", "caches", "caching", "cached"],
        ["database", "databases"],
        ["query", "queries"],
        ["optimize", "optimization", "optimizing", "optimized", "optimizes"],
        ["translate", "translation", "translations", "translated"],
        ["class", "classes"],
        ["setting", "settings"],
        ["docstring", "docstrings"],
        ["string", "strings"],
        ["deploy", "deploys", "deployed", "deploying"],
        ["jwt", "jwts", "JWTs"],
        ["llm", "LLMs"],
        ["cve", "CVEs"],
    ],
)
def test_stemming_meets_word_forms(forms: list[str]) -> None:
    assert len({normalize(form).sequence for form in forms}) == 1, forms


@pytest.mark.parametrize(
    "word", ["k8s", "c++", "utf8", "s3", "api", "css", "speed", "analysis", "status", "redis"]
)
def test_stemming_leaves_short_symbolic_and_listed_words(word: str) -> None:
    assert stem(word) == word


def test_stemming_is_conservative() -> None:
    assert stem("string") == "string"  # no vowel left after -ing: not a suffix
    assert stem("using") == "using"  # too short a stem
    assert stem("übersetzungen") == "übersetzungen"  # only ASCII words are stemmed


def test_normalize_keeps_compounds_and_parts() -> None:
    terms = normalize("Our CI/CD on K8s builds C++ and C# with Node.js, end-to-end!")
    assert {"ci/cd", "ci", "cd", "k8s", "c++", "c#", "node.js", "nod", "js"} <= terms.bag
    assert {"end-to-end", "end", "to"} <= terms.bag
    assert terms.sequence[:3] == ("our", "ci", "cd")
    assert "c" not in terms.bag  # "c++" is one token, not the letter c


def test_normalize_unicode_and_apostrophes() -> None:
    assert normalize("Ｆｕｌｌｗｉｄｔｈ TESTS").sequence == ("fullwidth", "test")
    assert normalize("Don’t break the user's build").sequence == (
        "dont",
        "break",
        "the",
        "user",
        "build",
    )
    assert normalize("Übersetze ins Deutsche").sequence == ("übersetze", "ins", "deutsch")


def test_term_of_keywords_and_phrases() -> None:
    assert term_of("Testing") == "test"
    assert term_of("ci/cd") == "ci/cd"
    assert term_of("c++") == "c++"
    assert term_of("unit tests") == ("unit", "test")
    assert term_of("tl;dr") == ("tl", "dr")


def test_phrase_matches_in_order_on_normalized_sequence() -> None:
    router = Router(roster(lane("a", ["alpha"], phrases=["unit test"]), lane("b", ["beta"])))
    assert router.route("add Unit Tests please").matched == {"a": ["unit test"]}
    assert router.route("test the unit").scores == []
    assert router.route("unit of test").matched == {"a": ["unit test"]}  # one word inside
    assert router.route("unit of the test").scores == []  # two: too far apart


def test_phrase_counts_more_than_a_word() -> None:
    router = Router(roster(lane("a", ["alpha"], phrases=["gamma delta"]), lane("b", ["beta"])))
    assert router.route("gamma delta").scores == [("a", score(PHRASE_BOOST))]
    assert router.route("alpha").scores == [("a", score(1.0))]


def test_keyword_with_several_words_is_a_phrase() -> None:
    router = Router(roster(lane("a", ["pull request"]), lane("b", ["beta"])))
    assert router.route("please look at my pull request").lane == "a"
    assert router.route("pull the request").lane == "a"  # PHRASE_GAP allows one word
    assert router.route("pull over the request").lane is None


def test_negative_keyword_reduces_a_lane() -> None:
    router = Router(
        roster(
            lane("web", ["react", "css"], negative=["native"]),
            lane("mobile", ["ios"], phrases=["react native"]),
        )
    )
    plain = router.route("react css")
    assert plain.lane == "web"
    assert plain.scores == [("web", score(2.0))]
    hit = router.route("react native css in ios")
    assert hit.lane == "mobile"
    assert dict(hit.scores)["web"] == score(2.0 - NEGATIVE_PENALTY)
    assert "-native" in hit.matched["web"]


def test_negative_phrase_and_veto() -> None:
    lanes = lane("plan", ["roadmap"], negative=["trial roadmap"]), lane("t", ["trial"])
    router = Router(roster(*lanes))
    assert router.route("write a roadmap").lane == "plan"
    route = router.route("trial roadmap")
    assert route.lane == "t"
    assert "plan" not in dict(route.scores)  # evidence 1 - 1 = 0: the lane drops out


def test_idf_weights_shared_words_less() -> None:
    lanes = [
        lane("a", ["shared", "only"]),
        lane("b", ["shared", "bee"]),
        lane("c", ["shared", "sea"]),
        lane("d", ["dee"]),
    ]
    router = Router(roster(*lanes))
    n = 4
    weight = math.log(1 + n / 3) / math.log(1 + n)
    assert sorted(router.evidence("shared").values()) == [pytest.approx(weight)] * 3
    route = router.route("shared")
    # a word three lanes share stays below the floor: no candidate, so `general`
    assert weight < FLOOR
    assert (route.lane, route.scores, route.decision.source) == (None, [], "general")
    assert router.route("shared only").lane == "a"
    assert router.route("only").scores == [("a", score(1.0))]


def test_score_is_independent_of_lane_size() -> None:
    small = lane("small", ["alpha", "beta"])
    large = lane("large", ["gamma", "delta", *[f"filler{i}" for i in range(200)]])
    router = Router(roster(small, large, threshold=0.0, margin=0.0))
    assert (
        dict(router.route("alpha beta").scores)["small"]
        == dict(router.route("gamma delta").scores)["large"]
    )
    # repeating a word is not more evidence
    assert router.route("alpha alpha alpha").scores == router.route("alpha").scores


def test_confidence_is_the_margin_on_both_paths() -> None:
    # b's phrase: two words of the request point at it, so it is a candidate (SUPPORT_MIN)
    lanes = [lane("a", ["alpha", "ant", "ape", "asp"]), lane("b", ["bop"], phrases=["beta bee"])]
    router = Router(roster(*lanes, margin=0.1))
    decided = router.route("alpha ant ape asp beta bee")
    assert decided.lane == "a"
    assert decided.confidence == round(score(4.0) - score(PHRASE_BOOST), 4)  # 0.2
    close = router.route("alpha ant beta bee")
    assert close.confidence == round(score(2.0) - score(PHRASE_BOOST), 4)  # 0.0667 < 0.1
    assert (close.lane, close.escalate) == (None, True)
    tied = router.route("alpha bop")
    assert (tied.lane, tied.escalate, tied.confidence) == (None, True, 0.0)
    alone = router.route("alpha")
    assert alone.confidence == score(1.0)  # the runner-up counts as 0


def test_threshold_and_nothing_matched() -> None:
    router = Router(roster(lane("a", ["alpha"]), lane("b", ["beta"]), threshold=0.6))
    low = router.route("alpha")
    assert (low.lane, low.escalate, low.confidence) == (None, True, 0.5)
    none = router.route("what's a good pasta recipe")
    assert (none.lane, none.confidence, none.escalate) == (None, 0.0, True)
    assert (none.scores, none.matched, none.examples) == ([], {}, {})
    # no `general` lane in this roster: the first lane, still with no model call
    assert none.decision == Decision(lane="a", source="general", model_call=False)
    assert router.route("").scores == []


def test_route_is_deterministic() -> None:
    lanes = [lane(f"l{i}", ["shared", f"own{i}"]) for i in range(6)]
    first = Router(roster(*lanes)).route("shared own3 own4")
    again = Router(roster(*lanes))
    for _ in range(3):
        assert again.route("shared own3 own4") == first
    # ties are ordered by roster order, not by hash or set iteration order
    assert [name for name, _ in first.scores[:2]] == ["l3", "l4"]


def test_route_crosses_to_json() -> None:
    router = Router(roster(lane("a", ["alpha"]), lane("b", ["beta"])))
    route = router.route("alpha")
    data = route.model_dump(mode="json")
    assert data == {
        "lane": "a",
        "confidence": 0.5,
        "escalate": False,
        "scores": [["a", 0.5]],
        "matched": {"a": ["alpha"]},
        "similar": {"a": []},
        "examples": {},
        "decision": {
            "lane": "a",
            "source": "router",
            "model_call": False,
            "classifier": None,
            "candidates": [],
        },
        "embedding": None,
    }
    assert Route.model_validate_json(route.model_dump_json()) == route


def test_top_k_limits_scores() -> None:
    lanes = [lane(f"l{i}", [f"own{i}", f"mine{i}"]) for i in range(8)]
    text = " ".join(f"own{i} mine{i}" for i in range(8))
    route = Router(roster(*lanes), top_k=3).route(text)
    assert len(route.scores) == 3
    assert set(route.matched) == {"l0", "l1", "l2"}


async def test_classifier_protocol_and_candidates() -> None:
    class First:
        async def classify(self, text: str, candidates: Sequence[Lane]) -> str | None:
            return candidates[0].name if candidates else None

    router = Router(roster(lane("a", ["alpha"]), lane("b", ["beta"]), lane("c", ["gamma"])))
    classifier: Classifier = First()
    tied = router.route("alpha beta")
    assert [c.name for c in router.candidates(tied)] == ["a", "b"]
    assert await classifier.classify("alpha beta", router.candidates(tied)) == "a"
    nothing = router.route("pasta")
    assert [c.name for c in router.candidates(nothing)] == ["a", "b", "c"]


def test_generic_word_alone_does_not_decide() -> None:
    router = Router(roster(lane("plan", ["plan", "sprint"]), lane("t", ["pytest"])))
    assert "plan" in GENERIC_WORDS
    alone = router.route("plan my vacation")
    assert (alone.lane, alone.escalate) == (None, True)
    assert list(router.evidence("plan my vacation").values()) == [pytest.approx(GENERIC_FACTOR)]
    assert GENERIC_FACTOR < FLOOR  # alone it is no candidate: `general`
    assert (alone.scores, alone.decision.source) == ([], "general")
    assert router.route("plan the next sprint").lane == "plan"  # a second word decides


def test_contested_request_escalates() -> None:
    # At the default margin a runner-up at CONTEST_RATIO x E1 already fails the margin, so
    # the contest rule is what decides for a roster with a much smaller margin.
    words = ["alpha", "omega", "psi", "chi", "rho"]
    router = Router(roster(lane("a", words), lane("b", ["beta zeta", "eta", "theta"]), margin=0.02))
    assert router.route("alpha omega").lane == "a"
    # E1 = 4.0 (four words) and E2 = 3.5 (b's phrase and two words): the margin (0.8 - 0.778)
    # passes, but E2 >= CONTEST_MIN and E2 >= CONTEST_RATIO x E1
    assert CONTEST_MIN <= PHRASE_BOOST
    assert 4.0 * CONTEST_RATIO <= PHRASE_BOOST + 2.0 < 5.0 * CONTEST_RATIO
    contested = router.route("alpha omega psi chi beta zeta eta theta")
    assert contested.confidence >= 0.02
    assert contested.escalate
    # With a's fifth word (E1 = 5.0) the runner-up is below CONTEST_RATIO x E1: decided.
    assert router.route("alpha omega psi chi rho beta zeta eta theta").lane == "a"


def test_default_roster_known_traps() -> None:
    router = Router(read_roster())
    assert router.route("translate this code from Python to Rust").lane != "translation"
    assert router.route("plan my vacation").escalate
    assert router.route("translate this paragraph into Spanish").lane == "translation"
    assert router.route("plan the milestones for next quarter").lane == "planning"


def test_a_lone_word_among_others_is_no_evidence() -> None:
    """SUPPORT: one word of a lane among several words of nothing is no candidate (the
    request is about something else: `general`); two of its words, or its one word alone or
    with one other, are."""
    graphics = lane("graphics", ["bloom", "shader", "glsl"], examples=["add a bloom pass"])
    router = Router(roster(graphics, lane("general", ["misc"])))
    off = router.route("when should i prune hydrangeas so they still bloom next year")
    assert (off.lane, off.scores, off.decision.lane) == (None, [], "general")
    assert router.evidence("when should i prune hydrangeas so they still bloom")  # it matched
    assert router.route("add bloom to my glsl shader").lane == "graphics"  # three words
    assert router.route("bloom pass looks washed out in the night scene").lane == "graphics"
    assert router.route("bloom?").lane == "graphics"  # alone
    assert router.route("glsl help").lane == "graphics"  # with one other word
    # an everyday word (GENERIC_WORDS) alone is no candidate even with nothing beside it
    plan = Router(roster(lane("planning", ["plan", "milestone", "roadmap"]), lane("x", ["y"])))
    assert plan.route("plan").scores == []
    assert plan.route("plan the milestones").lane == "planning"


def test_default_roster_sends_everyday_requests_to_general() -> None:
    """The class, on the default roster: a lane's lone word ("bloom", "train", "colour",
    "safe") in an everyday request, and everyday words the `general` lane's examples hold."""
    router = Router(read_roster())
    for text in [
        "what flowers bloom in early spring",
        "how do i crate train a puppy",
        "is it safe to swim right after eating",
        "why is the sky blue",
        "my sink drain smells bad, what can i pour down it",
        "my car battery keeps dying overnight what could cause that",
    ]:
        assert router.route(text).decision.lane == "general", text
    for text, lane_name in [
        ("add a bloom effect to the glsl post-processing shader", "graphics"),
        ("train a classifier on our support tickets", "ml"),
        ("is it safe to store the api key in localStorage", "security"),
        # "why is" (a phrase of function words) counts as one everyday word beside "undefined"
        ("why is my variable undefined inside the callback", "debugging"),
    ]:
        assert router.route(text).decision.lane == lane_name, text


def test_a_keyword_only_lane_is_decided_by_its_keyword_among_unknown_words() -> None:
    """The support rule (one word of a lane among several words of nothing is no candidate)
    judges only lanes with examples: a roster of keyword-only lanes knows almost none of a
    request's other words, and would otherwise send its requests to general."""
    lanes = (
        {"name": "security", "keywords": ["xss", "csrf"], "tier": "cheap", "system": "s"},
        {"name": "docs", "keywords": ["readme"], "tier": "cheap", "system": "s"},
    )
    plain = Router(roster(*lanes))
    asked = "could you check this signup form for xss issues please"
    assert plain.route(asked).lane == "security"
    # The same lane with examples: now the request's other words must be its words too.
    exampled = Router(
        roster(
            {**lanes[0], "examples": ["audit the login page for csrf", "find injection bugs"]},
            {**lanes[1], "examples": ["update the readme install section"]},
        )
    )
    assert exampled.route("how do roses bloom in xss weather near the garden shed").lane is None
    assert exampled.route("audit this page for xss").lane == "security"
