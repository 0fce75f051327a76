"""The keyword router: a request's text -> the lane that should handle it, or an escalation.

One piece past 600 lines: the scoring rules below (weights, support, the decision) are one
calculation whose numbers must mean the same thing in every branch of it; split, the constants
and the rule that reads them would drift apart.

Deterministic and model-free. Every lane's keywords, phrases and negative keywords are
normalized once (a `Router(roster)` builds an inverted index at its first route);
`route(text)` normalizes the request the same way and only touches the lanes its terms point at.

Scoring, in one place so the numbers mean the same thing everywhere:

* term weight `w(t) = ln(1 + N / df(t)) / ln(1 + N)` where N is the number of lanes and
  df(t) the number of lanes listing the keyword t: a word only one lane claims weighs 1.0,
  a word every lane claims weighs ln(2)/ln(1+N).
* a lane's evidence `E` = the sum of the weights of its distinct matched keywords
  + `PHRASE_BOOST` x the same IDF weight for each distinct matched phrase
  - `NEGATIVE_PENALTY` for each distinct matched negative keyword or phrase.
  Counting distinct matches only, and never dividing by the size of the lane's keyword list,
  keeps the score independent of how many keywords a lane declares: listing more words gives
  a lane more chances to match, never a smaller score for the same matched words.
* everyday words (`GENERIC`: "plan", "design", "review", "slow", "story", ...) are also
  what people say outside every lane ("plan my vacation", "a story for my kids"), so as
  keywords they weigh `GENERIC_FACTOR` x their IDF weight: alone they score at most 0.375,
  so they decide only when no other lane is near (the default threshold is 0.35; a roster
  that sets 0.4 makes them always need a second word or a phrase), and a lane's negative
  keywords ("vacation" for planning) keep everyday requests out.
* a phrase matches its words in order with at most `PHRASE_GAP` other words inside it
  ("throws a 500 error" meets "throws an error").
* a lane's score `s = E / (E + SATURATION)` (0 when E <= 0), in [0, 1): the first unique
  keyword gives 0.5, each further word adds less.
* `confidence = s1 - s2`, the margin between the best and the second-best lane (s2 = 0 when
  only one lane matched), in [0, 1). It is the same quantity whether or not the route decides.
* the route decides (`lane` set, `escalate` False) iff `s1 >= policy.threshold`,
  `confidence >= policy.margin`, and the request is not contested: a runner-up with
  evidence `E2 >= CONTEST_MIN` (a real word of its own, not a shared one) and
  `E2 >= CONTEST_RATIO x E1` means the request asks for two lanes' work ("make the mobile app
  faster", "write tests and docs"), which a keyword count cannot split (at the default margin
  0.1 such a runner-up already fails the margin: s1 - s2 < 0.09 whenever E2 >= 0.7 x E1, so
  the rule decides for rosters with a smaller margin); otherwise `lane` is
  None and `escalate` is True, and a `Classifier` (a model call, wired up by the run engine)
  picks among `Router.candidates`.

Beyond the keywords (issue 31), the evidence E of a lane also holds:

* its likeness to the lane's example requests and description, `BM25_WEIGHT` x their BM25
  score over stems and character n-grams (daemon.examples), so users' own words, other word
  forms and typos count;
* `NEAR_WEIGHT` x (cosine - `NEAR_FROM`) for its example nearest the request, plus
  `SAME_BONUS` when the request has that example's words (a taught example decides);
* `HEAD_EXTRA` x the keyword evidence of the request's head, its words before "about", "on",
  "for", "of" or a colon: the task ("write a changelog entry about ...") over the topic.

With an embedding member (`[policy] embeddings`, daemon.embeddings), E also holds
`EMBED_WEIGHT` x (cosine - `EMBED_FROM`) for the lane's example nearest the request by
embedding (centred cosines); when the member is down or its vectors are still being built, the
route is scored without it and `Route.embedding` says why.

A lane whose E stays below `FLOOR` is no candidate (a shared everyday word, a few letters in
common). Nor is a lane that too little of the request points at (`SUPPORT_MIN`,
`FOREIGN_MAX`): a request is about a lane's work when two of its meaningful words are the
lane's (keywords, phrases, words of its examples or description), or when its one such word
is specific to the lane and stands nearly alone ("glsl?"). One word of a lane among several of
nothing ("when should I prune hydrangeas so they still bloom next year": "bloom" is a graphics
keyword) is a request about something else: it goes to `general`, as does a request whose
words are those of the `general` lane's own examples (everyday requests) more than any other
lane's. `Route.decision` (`decide`) is what submit does: the decided lane; else, with no
classifier configured, the best-scoring lane, or `general` when no lane reached the floor,
both with no model call; else the classifier on the best few lanes and `general`.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel, ConfigDict

from daemon.decisions import CANDIDATES, GENERAL, Decision, classifier_of, decide
from daemon.embeddings import Embeddings, Likeness
from daemon.stems import stem
from roster.models import Lane, Roster

__all__ = ["CANDIDATES", "GENERAL", "Decision", "Route", "Router", "classifier_of", "decide"]

if TYPE_CHECKING:
    from daemon.examples import ExampleIndex, Query

PHRASE_BOOST = 1.5
NEGATIVE_PENALTY = 1.0
SATURATION = 1.0
TOP_K = 5
GENERIC_FACTOR = 0.6
PHRASE_GAP = 1
CONTEST_MIN = 0.9
CONTEST_RATIO = 0.85
JOINED_MIN = 0.55
JOINED_RATIO = 0.5
# The likeness to a lane's examples (daemon.examples), added to its keyword evidence.
BM25_WEIGHT = 0.08
NEAR_WEIGHT = 3.0
NEAR_FROM = 0.35
SAME_FROM = 0.95
SAME_BONUS = 3.0
"""A request with the words of one of a lane's examples (a taught one, say) goes there."""
HEAD_EXTRA = 1.5
"""The head's keywords (the task, before "about ..."; see daemon.examples) count this much more."""
EMBED_WEIGHT = 1.0
EMBED_FROM = 0.5
"""An embedding member's nearest example adds EMBED_WEIGHT x (cosine - EMBED_FROM) above it."""
FLOOR = 0.65
"""A lane whose evidence stays below this is not a candidate (with none, `general`): a lone
everyday word (GENERIC_FACTOR) is not enough."""
SUPPORT_MIN = 2
FOREIGN_MAX = 2
COMMON_DOCS = 3
"""Support: a lane is a candidate only if SUPPORT_MIN of the request's meaningful words point
at it (its keywords and phrases, the words of its examples and description), or one word
specific to it (no everyday word, in fewer than COMMON_DOCS lanes' examples) with at most
FOREIGN_MAX other meaningful words beside it. "bloom" alone does not make "when should I
prune hydrangeas so they still bloom next year" a graphics request, nor "train" "how do I
crate train a puppy" an ML one; "glsl shader", or "glsl?" alone, do."""
STRONG = 2.2
LEAD_RATIO = 0.85
"""Evidence of at least STRONG, with the runner-up at most LEAD_RATIO of it, decides even
when the saturated scores are closer than the margin."""
# Words that join two asks in one request ("write tests and docs"): with one of them, a
# weaker runner-up already counts as a second lane's work.
_CONJUNCTIONS = frozenset({"and", "plus", "then", "also"})

# Everyday English words that lanes use as keywords but people also use about anything else.
_GENERIC_TEXT = """
    plan planning schedule agenda checklist deadline estimate timeline phases goal goals
    design visual sketch icon logo palette spacing style layout screen
    review approve feedback opinion
    test testing check
    story letter speech draft tone toast bio essay headline wording rewrite
    summary overview highlights digest recap shorten briefing
    research study studies survey sources evidence investigate compare
    document manual usage installation tutorial onboarding guide
    customer complaint ticket refund subscription charged angry unhappy frustrated inquiry
    slow faster fastest speed efficient profile benchmark
    crash crashes wrong broken freezes hangs glitch refused undefined
    render rendering lighting shadow canvas texture mesh terrain particle 3d
    proof prime matrix equation equations probability
    mobile tablet battery smartphone
    server worker spring express rails broker upload handler controller payload
    container cloud pipeline deploy deployment cluster staging
    index query join transaction column partition
    training predict recall precision classify dataset
    resource contract patch cursor envelope
    cleanup simplify extract rename legacy composition inheritance abstraction
    chart aggregate excel notebook
    secure password secrets harden
"""
GENERIC_WORDS = frozenset(_GENERIC_TEXT.split())

# A word is a run of Unicode letters/digits. Words joined by `.`, `/`, `-` or `_` with no
# space ("ci/cd", "node.js", "end-to-end", "user_id") form a compound that is kept whole as
# an extra term next to its parts; a trailing "++" or "#" stays on its word ("c++", "c#").
_WORD = r"[^\W_]+"
_WORDS = re.compile(_WORD)
_TOKEN = re.compile(rf"{_WORD}(?:[./_-]{_WORD})*(?:\+\+|#)?")
_APOSTROPHES = re.compile(r"['’`]")
_JOINERS = re.compile(r"[./_-]")


@dataclass(frozen=True, slots=True)
class Terms:
    """A normalized text: `sequence` (stemmed words, in order, for phrases) and `bag`
    (the same words plus whole compounds such as "ci/cd" and "node.js", for keywords)."""

    sequence: tuple[str, ...]
    bag: frozenset[str]


def normalize(text: str) -> Terms:
    """Case-fold, NFKC-normalize, drop apostrophes, split into words, stem each word."""
    if not text.isascii():  # NFKC leaves ASCII as it is
        text = unicodedata.normalize("NFKC", text)
    text = _APOSTROPHES.sub("", text.casefold())
    sequence: list[str] = []
    bag: set[str] = set()
    for token in _TOKEN.findall(text):
        stems, compound = _token_terms(token)
        sequence.extend(stems)
        if compound:
            bag.add(token)
            joined = _JOINERS.sub("", token)  # "k-means" meets "kmeans", "e-mail" "email"
            bag.update((joined, stem(joined)))
    bag.update(sequence)
    return Terms(tuple(sequence), frozenset(bag))


@lru_cache(maxsize=65536)
def _token_terms(token: str) -> tuple[tuple[str, ...], bool]:
    """A token's stemmed words, and whether it is a compound of several: worked out once per
    distinct token (requests reuse a small vocabulary), like `stem`."""
    if token.endswith(("++", "#")):
        return (token,), False
    parts = [token] if token.isalnum() else _WORDS.findall(token)
    return tuple(stem(part) for part in parts), len(parts) > 1


def term_of(keyword: str) -> str | tuple[str, ...]:
    """How a roster keyword is matched: one term (a stem or a compound), or, when it is
    several words ("unit test", "tl;dr"), a phrase over the stemmed word sequence."""
    terms = normalize(keyword)
    compounds = {t for t in terms.bag.difference(terms.sequence) if _JOINERS.search(t)}
    if len(terms.sequence) == 1 or (len(compounds) == 1 and _TOKEN.fullmatch(keyword.casefold())):
        return next(iter(compounds)) if compounds else terms.sequence[0]
    return terms.sequence


class Route(BaseModel):
    """One routing decision. `scores` are the top lanes (best first) whose evidence reached
    the floor; `matched` lists, per scored lane, the roster keywords and phrases that
    matched, and negatives that matched prefixed with "-"; `similar`, the request's words
    that read like the lane's examples and description; `examples`, the lane's example
    nearest the request when it is close. `decision` is what `submit` will do."""

    model_config = ConfigDict(frozen=True)

    lane: str | None
    confidence: float
    escalate: bool
    scores: list[tuple[str, float]]
    matched: dict[str, list[str]]
    similar: dict[str, list[str]] = {}
    examples: dict[str, str] = {}
    decision: Decision = Decision(lane=None, source="general", model_call=False)
    embedding: Likeness | None = None
    """The embedding member's part (None: no member configured): what it compared, the
    cosines, or why it was not used."""


class Classifier(Protocol):
    """Picks a lane when the keywords cannot: a model call constrained to the candidates'
    names (wired up by the run engine). Returns None when it cannot decide either."""

    async def classify(self, text: str, candidates: Sequence[Lane]) -> str | None: ...


@dataclass(frozen=True, slots=True)
class _Posting:
    """The lanes one term (a keyword stem, a compound, or a whole phrase) adds evidence to.
    All lanes listing a term share its IDF weight; negatives carry their own penalty."""

    weight: float
    lanes: tuple[int, ...]
    labels: dict[int, str]  # lane -> the roster word, for `Route.matched`
    words: frozenset[str] = frozenset()
    """The request words (stems, a compound's parts too) a match of this term stands for: a
    phrase of function words only ("why is", "is it safe") stands for none (see SUPPORT)."""


@dataclass(slots=True)
class _Index:
    """The inverted index of a roster's lane words."""

    # term -> postings (its keyword posting, then negative ones)
    keywords: dict[str, list[_Posting]] = field(default_factory=dict)
    # first stem of a phrase -> (the whole phrase, its postings)
    phrases: dict[str, list[tuple[tuple[str, ...], list[_Posting]]]] = field(default_factory=dict)

    @classmethod
    def of(cls, lanes: Sequence[Lane]) -> _Index:
        positive: dict[str | tuple[str, ...], dict[int, str]] = {}
        negative: dict[str | tuple[str, ...], dict[int, str]] = {}
        for index, lane in enumerate(lanes):
            for word in [*lane.keywords, *lane.phrases]:
                if term := term_of(word):
                    positive.setdefault(term, {}).setdefault(index, word)
            for word in lane.negative:
                if term := term_of(word):
                    negative.setdefault(term, {}).setdefault(index, f"-{word}")
        built = cls()
        count = len(lanes)
        for term, owners in positive.items():
            if isinstance(term, str):
                boost = GENERIC_FACTOR if term in _GENERIC_STEMS else 1.0
            else:
                boost = PHRASE_BOOST
            weight = boost * _idf(len(owners), count)
            words = _words_of(term, next(iter(owners.values())))
            built.add(term, _Posting(weight, tuple(owners), owners, words))
        for term, owners in negative.items():
            built.add(term, _Posting(-NEGATIVE_PENALTY, tuple(owners), owners))
        return built

    def add(self, term: str | tuple[str, ...], posting: _Posting) -> None:
        if isinstance(term, str):
            self.keywords.setdefault(term, []).append(posting)
            return
        for phrase, postings in self.phrases.setdefault(term[0], []):
            if phrase == term:
                postings.append(posting)
                return
        self.phrases[term[0]].append((term, [posting]))


class Router:
    """Routes request text to a lane of `roster`; build once per roster (the index is fixed)."""

    def __init__(
        self, roster: Roster, *, top_k: int = TOP_K, embeddings: Embeddings | None = None
    ) -> None:
        self.roster = roster
        self.embeddings = embeddings
        """The roster's embedding member (`[policy] embeddings`), used by `aroute`."""
        self.threshold = roster.policy.threshold
        self.margin = roster.policy.margin
        self.top_k = top_k
        self._names = [lane.name for lane in roster.lanes]

    @cached_property
    def _index(self) -> _Index:
        """Built by the first route, not with the router: the daemon makes one as it starts,
        and normalizing the default roster's ~1,400 words took ~12 ms of its start."""
        return _Index.of(self.roster.lanes)

    def prepare(self) -> None:
        """Build the indexes now (a daemon does it once it listens, before a first route)."""
        _ = self._index
        _ = self._examples

    def _matches(self, terms: Terms) -> list[_Posting]:
        """The postings of the distinct keywords and phrases found in `text`, in a fixed
        order (sorted terms, then phrases by position) so float sums never depend on
        hash order."""
        keywords = self._index.keywords
        found = [p for term in sorted(terms.bag) for p in keywords.get(term, ())]
        phrases = self._index.phrases
        sequence = terms.sequence
        has_all = terms.bag.issuperset  # most candidates lack a word: no walk for them
        seen: set[tuple[str, ...]] = set()
        for position, first in enumerate(sequence):
            for phrase, postings in phrases.get(first, ()):
                if (
                    has_all(phrase)
                    and phrase not in seen
                    and _phrase_at(sequence, position, phrase)
                ):
                    seen.add(phrase)
                    found.extend(postings)
        return found

    def _split_asks(self, sequence: tuple[str, ...], winner: int, rivals: set[int]) -> bool:
        """Whether the request joins two asks: cut at the conjunctions, some part points at
        a rival lane and not at the winner while another points at the winner and not at
        that rival ("write tests | docs for this module"). Words of both lanes inside one
        part ("a bucket with versioning and a lifecycle rule") are one ask, not two."""
        if not rivals:
            return False
        parts: list[set[int]] = []
        start = 0
        for end in [*(i for i, w in enumerate(sequence) if w in _CONJUNCTIONS), len(sequence)]:
            parts.append(self._lanes_in(sequence[start:end]))
            start = end + 1
        for rival in rivals:
            rival_only = any(rival in part and winner not in part for part in parts)
            winner_only = any(winner in part and rival not in part for part in parts)
            if rival_only and winner_only:
                return True
        return False

    def _lanes_in(self, part: tuple[str, ...]) -> set[int]:
        """The lanes with positive evidence from the words and phrases inside `part`."""
        lanes: set[int] = set()
        index = self._index
        for position, word in enumerate(part):
            for posting in index.keywords.get(word, ()):
                if posting.weight > 0:
                    lanes.update(posting.lanes)
            for phrase, postings in index.phrases.get(word, ()):
                if _phrase_at(part, position, phrase):
                    lanes.update(ln for p in postings if p.weight > 0 for ln in p.lanes)
        return lanes

    def evidence(self, text: str) -> dict[int, float]:
        """Per lane index: the keyword evidence E (see the module docstring), before the head
        and the examples add theirs; lanes with none absent."""
        totals: dict[int, float] = {}
        get = totals.get
        for posting in self._matches(normalize(text)):
            weight = posting.weight
            for lane in posting.lanes:
                totals[lane] = get(lane, 0.0) + weight
        return totals

    @cached_property
    def _examples(self) -> ExampleIndex:
        from daemon.examples import ExampleIndex

        return ExampleIndex.of(self.roster.lanes)

    def _evidence(
        self, text: str, matches: list[_Posting], likeness: Likeness | None = None
    ) -> tuple[dict[int, float], Query, dict[int, tuple[float, int]]]:
        """Per lane: keyword evidence (the head's counted again), plus the likeness to the
        lane's examples (BM25) and to its nearest example (see daemon.examples)."""
        totals: dict[int, float] = {}
        get = totals.get
        for posting in matches:
            weight = posting.weight
            for lane in posting.lanes:
                totals[lane] = get(lane, 0.0) + weight
        examples = self._examples
        query = examples.query(text)
        if query.head:
            for posting in self._matches(normalize(" ".join(query.head))):
                for lane in posting.lanes:
                    totals[lane] = get(lane, 0.0) + HEAD_EXTRA * posting.weight
        for lane, score in examples.bm25(query).items():
            totals[lane] = get(lane, 0.0) + BM25_WEIGHT * score
        near = examples.nearest(query)
        for lane, (cosine, _) in near.items():
            if cosine > NEAR_FROM:
                bonus = SAME_BONUS if cosine >= SAME_FROM else 0.0
                totals[lane] = get(lane, 0.0) + NEAR_WEIGHT * (cosine - NEAR_FROM) + bonus
        if likeness is not None and likeness.used:
            position = self._positions
            for name, (value, _) in likeness.lanes.items():
                if value > EMBED_FROM and (at := position.get(name)) is not None:
                    totals[at] = get(at, 0.0) + EMBED_WEIGHT * (value - EMBED_FROM)
        return totals, query, near

    @cached_property
    def _positions(self) -> dict[str, int]:
        return {name: index for index, name in enumerate(self._names)}

    async def aroute(self, text: str, wait: float = 0.0) -> Route:
        """`route`, with the embedding member's likeness when the roster names one (waiting
        up to `wait` s for the example vectors if they are still being built)."""
        if self.embeddings is None:
            return self.route(text)
        return self.route(text, await self.embeddings.compare(text, wait))

    @cached_property
    def _doc_lanes(self) -> dict[str, tuple[frozenset[int], frozenset[int]]]:
        """Per stem of the lanes' examples and descriptions: the lanes whose documents hold it,
        and those for which it is specific (held by fewer than COMMON_DOCS lanes, and no
        everyday word)."""
        out: dict[str, tuple[frozenset[int], frozenset[int]]] = {}
        for term, found in self._examples.postings.items():
            if term.startswith("\x00"):  # a character n-gram, not a word
                continue
            lanes = frozenset(lane for lane, _ in found)
            common = len(lanes) >= COMMON_DOCS or term in _GENERIC_STEMS
            out[term] = (lanes, frozenset() if common else lanes)
        return out

    @cached_property
    def _exampled(self) -> frozenset[int]:
        """The lanes with example requests: support is judged only for them (see `_Support`)."""
        return frozenset(self._examples.owner)

    def _alike(self, likeness: Likeness | None) -> set[int]:
        """The lanes the embedding member finds the request like (an example above
        EMBED_FROM): that likeness supports a lane as one more word would (SUPPORT)."""
        if likeness is None or not likeness.used:
            return set()
        position = self._positions
        return {
            at
            for name, (value, _) in likeness.lanes.items()
            if value > EMBED_FROM and (at := position.get(name)) is not None
        }

    def route(self, text: str, likeness: Likeness | None = None) -> Route:
        """Route `text` (`likeness`: what the embedding member said of it, see `aroute`)."""
        terms = normalize(text)
        matches = self._matches(terms)
        totals, query, near = self._evidence(text, matches, likeness)
        support = _Support(text, matches, self._doc_lanes, self._alike(likeness), self._exampled)
        # Best evidence first, ties by roster order; a request touches a handful of lanes, so
        # sorting them all beats a heap. Below the floor a lane's evidence is noise (a shared
        # everyday word, a few letters in common): it is not a candidate; nor is a lane that
        # only one word of the request points at, among others that do not (SUPPORT), which
        # is checked best first, for as many lanes as it takes to fill the top.
        top: list[tuple[float, int]] = []
        for negated, lane in sorted([(-e, lane) for lane, e in totals.items() if e >= FLOOR]):
            if support.of(lane):
                top.append((negated, lane))
                if len(top) == self.top_k:
                    break
        ranked = [(lane, -negated / (SATURATION - negated)) for negated, lane in top]
        best = ranked[0][1] if ranked else 0.0
        second = ranked[1][1] if len(ranked) > 1 else 0.0
        confidence = round(best - second, 4)
        decided = bool(ranked) and best >= self.threshold and confidence >= self.margin
        if ranked and not decided and best >= self.threshold:
            # Scores saturate: 4.0 against 2.5 is a margin of 0.086 at SATURATION 1.5. Strong
            # evidence with a clear lead in evidence decides too.
            first_e = -top[0][0]
            second_e = -top[1][0] if len(top) > 1 else 0.0
            decided = first_e >= STRONG and second_e <= LEAD_RATIO * first_e
        if decided and len(top) > 1:
            first_e, second_e = -top[0][0], -top[1][0]
            decided = not (second_e >= CONTEST_MIN and second_e >= CONTEST_RATIO * first_e)
            if decided and not _CONJUNCTIONS.isdisjoint(terms.sequence):
                floor = max(JOINED_MIN, JOINED_RATIO * first_e)
                rivals = {lane for negated, lane in top[1:] if -negated >= floor}
                decided = not self._split_asks(terms.sequence, top[0][1], rivals)
        names = self._names
        labels: dict[int, list[str]] = {lane: [] for lane, _ in ranked}
        for posting in matches:
            for lane, label in posting.labels.items():
                if lane in labels:
                    labels[lane].append(label)
        matched = {names[lane]: sorted(found) for lane, found in labels.items()}
        examples = self._examples
        words = examples.words(query, [lane for lane, _ in ranked[:3]])
        similar = {names[lane]: found for lane, found in words.items()}
        shown = {
            names[lane]: examples.texts[near[lane][1]]
            for lane, _ in ranked[:3]
            if lane in near and near[lane][0] > NEAR_FROM
        }
        chosen = names[ranked[0][0]] if decided else None
        return Route(  # validating is faster than model_construct in pydantic 2
            lane=chosen,
            confidence=confidence,
            escalate=not decided,
            scores=[(names[lane], round(score, 4)) for lane, score in ranked],
            matched=matched,
            similar=similar,
            examples=shown,
            decision=decide(self.roster, chosen, [names[lane] for lane, _ in ranked]),
            embedding=likeness,
        )

    def candidates(self, route: Route) -> list[Lane]:
        """The lanes a classifier should choose from: the scored ones, or all when none scored."""
        scored = [lane for name, _ in route.scores if (lane := self.roster.lane(name))]
        return scored or list(self.roster.lanes)


class _Support:
    """Which lanes enough of one request points at (SUPPORT_MIN, FOREIGN_MAX), worked out lane
    by lane, only for the lanes a route considers."""

    def __init__(
        self,
        text: str,
        matches: list[_Posting],
        doc_lanes: dict[str, tuple[frozenset[int], frozenset[int]]],
        alike: set[int],
        exampled: frozenset[int],
    ) -> None:
        self.exampled = exampled
        self.matches = [posting for posting in matches if posting.weight > 0 and posting.words]
        self.doc_lanes = doc_lanes
        self.alike = alike
        content = _meaningful(text)
        for posting in self.matches:  # a keyword the roster made of a short word ("r", "only")
            if all(posting.words.isdisjoint(forms) for forms in content):
                content.append(posting.words)
        self.content = content

    def of(self, lane: int) -> bool:
        """Whether the request rests on more than one word of `lane`, or on one word specific
        to it with few others beside it; the embedding member finding the request like one of
        its examples (`alike`) counts as one specific word more. A word points at the lane
        when it is one of the lane's keywords or phrases, or a word of its examples or
        description; it is specific when it is no everyday word (GENERIC_WORDS, a phrase of
        function words) and no word of COMMON_DOCS lanes' examples.

        A lane without examples is always supported: a roster of keyword-only lanes names
        almost none of a request's other words, so "few words beside it" would send most of
        its requests to general; its keywords decide as they always did."""
        if lane not in self.exampled:
            return True
        words: set[str] = set()
        specific: set[str] = set()
        for posting in self.matches:
            if lane in posting.labels:
                words |= posting.words
                specific.update(
                    w for w in posting.words if w not in _GENERIC_STEMS and w[0] != _FUNCTION_PHRASE
                )
        docs = self.doc_lanes
        pointing = 0
        specific_one = False
        for forms in self.content:
            found = not words.isdisjoint(forms)
            sure = not specific.isdisjoint(forms)
            for form in forms:
                held = docs.get(form)
                if held is not None and lane in held[0]:
                    found = True
                    sure = sure or lane in held[1]
            if found:
                pointing += 1
                specific_one = sure
        alike = lane in self.alike
        if pointing + alike >= SUPPORT_MIN:
            return True
        foreign = len(self.content) - pointing
        if alike:
            return foreign <= FOREIGN_MAX
        return pointing == 1 and specific_one and foreign <= FOREIGN_MAX


def _meaningful(text: str) -> list[frozenset[str]]:
    """The request's meaningful words (no function words, single letters or numbers), each
    as the set of forms it is matched by: its stem, or a compound's whole, joined form and
    parts."""
    from daemon.examples import STOP

    if not text.isascii():
        text = unicodedata.normalize("NFKC", text)
    out: list[frozenset[str]] = []
    seen: set[frozenset[str]] = set()
    for token in _TOKEN.findall(_APOSTROPHES.sub("", text.casefold())):
        stems, compound = _token_terms(token)
        if not compound:
            if token in STOP or token.isdigit() or (len(token) == 1):
                continue
            forms = frozenset(stems)
        else:
            joined = _JOINERS.sub("", token)
            forms = frozenset((*stems, token, joined, stem(joined)))
        if forms not in seen:
            seen.add(forms)
            out.append(forms)
    return out


def _phrase_at(sequence: tuple[str, ...], position: int, phrase: tuple[str, ...]) -> bool:
    """Whether `phrase` starts at `position` (its first word already matched there), its other
    words following in order with at most PHRASE_GAP extra words in between, in total."""
    gap = PHRASE_GAP
    at = position
    end = len(sequence)
    for word in phrase[1:]:
        at += 1
        while at < end and sequence[at] != word:
            if gap == 0:
                return False
            gap -= 1
            at += 1
        if at >= end:
            return False
    return True


_GENERIC_STEMS = frozenset(stem(word) for word in GENERIC_WORDS)
_FUNCTION_PHRASE = "\x02"
"""Marks the word a phrase of function words stands for (see `_words_of`)."""


def _words_of(term: str | tuple[str, ...], written: str) -> frozenset[str]:
    """The request words a keyword stands for: the stems of its meaningful words (as the
    example index keeps them), and a compound whole."""
    from daemon.examples import features, kept, words_of

    words = {features(word)[0] for word in kept(words_of(written))}
    if isinstance(term, str) and (_JOINERS.search(term) or not words):
        words.add(term)  # a compound, or a one-letter language ("r", "c")
    elif not words:  # a phrase of function words ("why is"): one everyday word of the request
        words.add(_FUNCTION_PHRASE + " ".join(term))
    return frozenset(words)


def _idf(df: int, lanes: int) -> float:
    return math.log(1 + lanes / df) / math.log(1 + lanes) if lanes > 1 else 1.0
