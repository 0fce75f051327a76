"""The example index: how much a request reads like the requests each lane is for.

Keywords catch the words a lane's author thought of; users write in their own words, with
typos and other word forms. So each lane also carries example requests (`[[lanes]]
examples`), and a request is scored against them in two ways, both deterministic:

* **BM25 over lane documents.** A lane's document is its examples and (at
  `DESCRIPTION_WEIGHT`) its system prompt, the lane's description; its keywords and phrases
  score apart, in daemon.router. Terms are the
  stemmed words (function words left out) and the character 4-grams of each word (with word
  boundaries, "<summ", "ariz", "ize>"), so "summarise", "sumarize" and "summarizing" meet
  "summarize". A word's n-grams together weigh `NGRAM_SHARE` of its stem, so a word counts
  about once however long it is. BM25's IDF over the lanes makes a word every lane's examples
  use ("write", "app") count for little, and a word one lane owns count for much.
* **The nearest example.** The cosine between the request's stems and each example's (IDF
  over the examples), and per lane the best one. A taught example ("route --teach") and its
  close paraphrases are near 1, whatever the lane's other examples say.

**Task words over topic words.** "write a changelog entry about the dark-mode toggle" asks for
a changelog; the toggle is only its topic. The head of a request (its words before "about",
"on", "regarding", "for", "of", or before a colon, when that comes early) says the task, so
its terms weigh `HEAD_BOOST` times more here and in the keyword score (see daemon.router).

Everything is built once per roster (`ExampleIndex.of`); a route touches only the postings of
the request's own terms: at most one entry per lane for BM25, and one per example holding the
stem for the nearest example.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from daemon.stems import stem
from roster.models import Lane

NGRAM = 4
NGRAM_SHARE = 0.6
DESCRIPTION_WEIGHT = 0.3
K1 = 1.2
B = 0.4
HEAD_BOOST = 1.6
HEAD_MAX = 6
COMMON_MIN = 64
COMMON_SHARE = 50
"""A stem in more than max(COMMON_MIN, examples / COMMON_SHARE) examples is common."""
"""The head ends at a marker within its first HEAD_MAX words, or there is no head."""
_MARKERS = frozenset({"about", "on", "regarding", "for", "of", "re", "concerning"})

_WORD = re.compile(r"[^\W_]+(?:\+\+|#)?")
_APOSTROPHES = re.compile(r"['’`]")
STOP = frozenset(
    [
        "a",
        "an",
        "the",
        "and",
        "or",
        "but",
        "if",
        "then",
        "so",
        "to",
        "of",
        "in",
        "on",
        "at",
        "by",
        "for",
        "with",
        "from",
        "into",
        "onto",
        "as",
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "being",
        "am",
        "do",
        "does",
        "did",
        "done",
        "doing",
        "have",
        "has",
        "had",
        "having",
        "i",
        "me",
        "my",
        "mine",
        "we",
        "us",
        "our",
        "ours",
        "you",
        "your",
        "yours",
        "he",
        "she",
        "it",
        "its",
        "they",
        "them",
        "their",
        "this",
        "that",
        "these",
        "those",
        "there",
        "here",
        "what",
        "which",
        "who",
        "whom",
        "whose",
        "when",
        "where",
        "why",
        "how",
        "can",
        "could",
        "would",
        "should",
        "shall",
        "will",
        "may",
        "might",
        "must",
        "please",
        "pls",
        "plz",
        "hi",
        "hey",
        "hello",
        "thanks",
        "thank",
        "just",
        "also",
        "too",
        "very",
        "really",
        "some",
        "any",
        "all",
        "each",
        "every",
        "more",
        "most",
        "other",
        "such",
        "only",
        "own",
        "same",
        "than",
        "not",
        "no",
        "nor",
        "up",
        "down",
        "out",
        "over",
        "under",
        "again",
        "further",
        "once",
        "get",
        "got",
        "im",
        "ive",
        "id",
        "dont",
        "doesnt",
        "didnt",
        "cant",
        "wont",
        "isnt",
        "arent",
        "u",
        "ur",
        "ya",
        "yeah",
        "ok",
        "okay",
        "like",
        "want",
        "need",
        "help",
        "let",
        "lets",
        "us",
        "about",
        "while",
        "whats",
        "hows",
        "thats",
        "theres",
        "it's",
        "i'm",
    ]
)


@dataclass(frozen=True, slots=True)
class Query:
    """A request's terms, weighted: `bm25` (stems and n-grams -> weight, head boost applied)
    and `stems` (stem -> weight, for the nearest example); `words` maps each stem back to
    the word the user wrote, for the explanation."""

    bm25: dict[str, float]
    stems: dict[str, float]
    words: dict[str, str]
    head: tuple[str, ...]


def words_of(text: str) -> list[str]:
    """Case-folded, NFKC-normalized words (apostrophes dropped: "don't" -> "dont")."""
    if not text.isascii():
        text = unicodedata.normalize("NFKC", text)
    return _WORD.findall(_APOSTROPHES.sub("", text.casefold()))


def head_of(words: Sequence[str], raw: str) -> int:
    """How many leading words are the request's head (0: none found)."""
    colon = raw.find(":")
    if colon > 0:
        before = len(_WORD.findall(raw[:colon]))
        if 1 <= before <= HEAD_MAX:
            return before
    for index, word in enumerate(words[: HEAD_MAX + 1]):
        if word in _MARKERS and index >= 1:
            return index
    return 0


def grams(word: str) -> tuple[str, ...]:
    """The character n-grams of a word with its boundaries marked, as feature keys."""
    if len(word) < NGRAM:
        return ()
    marked = f"<{word}>"
    return tuple("\x00" + marked[i : i + NGRAM] for i in range(len(marked) - NGRAM + 1))


@lru_cache(maxsize=65536)
def features(word: str) -> tuple[str, tuple[str, ...], float]:
    """A word's stem, its n-grams and each n-gram's share: worked out once per distinct word
    (examples and requests reuse a small vocabulary)."""
    pieces = grams(word)
    return stem(word), pieces, (NGRAM_SHARE / len(pieces) if pieces else 0.0)


def kept(words: Sequence[str]) -> list[str]:
    """The words that carry meaning: no function words, no single letters."""
    return [w for w in words if w not in STOP and (len(w) > 1 or w.isdigit())]


def terms(
    text: str, *, with_head: bool = False
) -> tuple[dict[str, float], dict[str, float], dict[str, str], tuple[str, ...]]:
    """(BM25 terms, stems, stem -> word, head words) of a text, each term's weight summed."""
    words = words_of(text)
    cut = head_of(words, text) if with_head else 0
    bm25: dict[str, float] = {}
    stems: dict[str, float] = {}
    shown: dict[str, str] = {}
    get = bm25.get
    for index, word in enumerate(words):
        if word in STOP or (len(word) == 1 and not word.isdigit()):
            continue
        boost = HEAD_BOOST if index < cut else 1.0
        root, pieces, share = features(word)
        shown.setdefault(root, word)
        bm25[root] = get(root, 0.0) + boost
        stems[root] = max(stems.get(root, 0.0), boost)
        share *= boost
        for piece in pieces:
            bm25[piece] = get(piece, 0.0) + share
    return bm25, stems, shown, tuple(words[:cut])


def document(words: Sequence[str], scale: float = 1.0) -> dict[str, float]:
    """The BM25 terms of many kept words together, counted by distinct word first (a lane's
    examples repeat their words: expanding each word's n-grams once is most of the saving)."""
    counts: dict[str, float] = {}
    for word in words:
        counts[word] = counts.get(word, 0.0) + scale
    out: dict[str, float] = {}
    get = out.get
    for word, count in counts.items():
        root, pieces, share = features(word)
        out[root] = get(root, 0.0) + count
        for piece in pieces:
            out[piece] = get(piece, 0.0) + count * share
    return out


@dataclass(slots=True)
class ExampleIndex:
    """The lanes' examples, indexed (see the module docstring)."""

    lanes: int
    # term -> [(lane, BM25 weight)]
    postings: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # stem -> [(example, idf / |example|)]
    stems: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    stem_idf: dict[str, float] = field(default_factory=dict)
    unseen_idf: float = 1.0
    owner: list[int] = field(default_factory=list)  # example -> lane
    texts: list[str] = field(default_factory=list)  # example -> its text
    vectors: list[dict[str, float]] = field(default_factory=list)  # example -> stem weights
    common: int = 64
    """Stems held by more examples than this do not pick nearest candidates (see nearest)."""

    @classmethod
    def of(cls, lanes: Sequence[Lane]) -> ExampleIndex:
        index = cls(lanes=len(lanes))
        documents: list[dict[str, float]] = []
        vectors: list[dict[str, float]] = []
        for number, lane in enumerate(lanes):
            every: list[str] = []
            for text in lane.examples:
                words = kept(words_of(text))
                every += words
                vectors.append({features(word)[0]: 1.0 for word in words})
                index.owner.append(number)
                index.texts.append(text)
            own = document(every)
            for term, weight in document(kept(words_of(lane.system)), DESCRIPTION_WEIGHT).items():
                own[term] = own.get(term, 0.0) + weight
            documents.append(own)
        index._bm25(documents)
        index._vectors(vectors)
        return index

    def _bm25(self, documents: list[dict[str, float]]) -> None:
        # Dicts keep insertion order, so postings and float sums come out the same on every
        # load of the same roster: no sorting needed for determinism.
        count = len(documents)
        lengths = [sum(d.values()) for d in documents]
        average = (sum(lengths) / count if count else 1.0) or 1.0
        df: dict[str, int] = {}
        for document in documents:
            for term in document:
                df[term] = df.get(term, 0) + 1
        log = math.log
        idf = {term: log(1 + (count - n + 0.5) / (n + 0.5)) for term, n in df.items()}
        postings = self.postings
        k1 = K1 + 1
        for lane, document in enumerate(documents):
            norm = K1 * (1 - B + B * lengths[lane] / average)
            for term, tf in document.items():
                weight = idf[term] * tf * k1 / (tf + norm)
                found = postings.get(term)
                if found is None:
                    postings[term] = [(lane, weight)]
                else:
                    found.append((lane, weight))

    def _vectors(self, vectors: list[dict[str, float]]) -> None:
        count = len(vectors)
        df: dict[str, int] = {}
        for vector in vectors:
            for term in vector:
                df[term] = df.get(term, 0) + 1
        self.stem_idf = idf = {t: math.log(1 + count / n) for t, n in df.items()}
        self.unseen_idf = math.log(1 + count) if count else 1.0
        stems = self.stems
        self.common = max(COMMON_MIN, count // COMMON_SHARE)
        for number, vector in enumerate(vectors):
            weights = [(t, w * idf[t]) for t, w in vector.items()]
            norm = math.sqrt(sum(w * w for _, w in weights)) or 1.0
            unit = {term: weight / norm for term, weight in weights}
            self.vectors.append(unit)
            for term, weight in unit.items():
                found = stems.get(term)
                if found is None:
                    stems[term] = [(number, weight)]
                else:
                    found.append((number, weight))

    def query(self, text: str) -> Query:
        bm25, stems, words, head = terms(text, with_head=True)
        return Query(bm25, stems, words, head)

    def bm25(self, query: Query) -> dict[int, float]:
        """Per lane: the request's BM25 score against the lane's document."""
        totals: dict[int, float] = {}
        get = totals.get
        postings = self.postings
        for term, weight in query.bm25.items():
            for lane, w in postings.get(term, ()):
                totals[lane] = get(lane, 0.0) + weight * w
        return totals

    def nearest(self, query: Query) -> dict[int, tuple[float, int]]:
        """Per lane: (cosine, example) of its example nearest the request's stems.

        Only stems held by at most `common` examples pick the candidates (a word in every
        tenth example says little about which one is nearest, and walking its postings
        would cost most of a route); each lane's best candidate then gets its exact cosine,
        the common stems included."""
        if not self.owner:
            return {}
        idf = self.stem_idf
        unseen = self.unseen_idf
        weights = {t: w * idf.get(t, unseen) for t, w in query.stems.items()}
        norm = math.sqrt(sum(w * w for w in weights.values()))
        if not norm:
            return {}
        dots: dict[int, float] = {}
        get = dots.get
        stems = self.stems
        common = self.common
        skipped = []
        for term, weight in weights.items():
            found = stems.get(term, ())
            if len(found) > common:
                skipped.append((term, weight))
                continue
            for example, w in found:
                dots[example] = get(example, 0.0) + weight * w
        best: dict[int, tuple[float, int]] = {}
        owner = self.owner
        for example, dot in dots.items():
            lane = owner[example]
            if lane not in best or dot > best[lane][0]:
                best[lane] = (dot, example)
        vectors = self.vectors
        out: dict[int, tuple[float, int]] = {}
        for lane, (dot, example) in best.items():
            vector = vectors[example]
            dot += sum(weight * vector.get(term, 0.0) for term, weight in skipped)
            out[lane] = (dot / norm, example)
        return out

    def words(self, query: Query, lanes: Sequence[int], top: int = 4) -> dict[int, list[str]]:
        """Per lane of `lanes`: the request's words that counted most for it in BM25."""
        postings = self.postings
        wanted = set(lanes)
        scored: dict[int, dict[str, float]] = {lane: {} for lane in lanes}
        for term, word in query.words.items():
            weight = query.bm25.get(term, 0.0)
            for owner, w in postings.get(term, ()):
                if owner in wanted:
                    by_word = scored[owner]
                    by_word[word] = by_word.get(word, 0.0) + weight * w
        out = {}
        for lane, by_word in scored.items():
            ranked = sorted(by_word.items(), key=lambda item: (-item[1], item[0]))
            out[lane] = [word for word, score in ranked[:top] if score > 0]
        return out
