"""The example index: how much a request reads like the requests each lane is for.

Keywords catch the words a lane's author thought of; users write in their own words, with
typos and other word forms. So each lane also carries example requests (`[[lanes]]
examples`), and a request is scored against them in two ways, both deterministic:

* **BM25 over lane documents.** A lane's document is its examples, its keywords and phrases,
  and (at `DESCRIPTION_WEIGHT`) its system prompt, the lane's description. Terms are the
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
its terms weigh `HEAD_BOOST` times more here and in the keyword score (see daemon.routing).

Everything is built once per roster (`ExampleIndex.of`); a route touches only the postings of
the request's own terms: at most one entry per lane for BM25, and one per example holding the
stem for the nearest example.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from roster.models import Lane

NGRAM = 4
NGRAM_SHARE = 0.6
DESCRIPTION_WEIGHT = 0.3
K1 = 1.2
B = 0.4
HEAD_BOOST = 1.6
HEAD_MAX = 6
"""The head ends at a marker within its first HEAD_MAX words, or there is no head."""
_MARKERS = frozenset({"about", "on", "regarding", "for", "of", "re", "concerning"})

_WORD = re.compile(r"[^\W_]+(?:\+\+|#)?")
_APOSTROPHES = re.compile(r"['’`]")
_STOP = frozenset(
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


def terms(
    text: str, stem: Callable[[str], str], *, with_head: bool = False
) -> tuple[dict[str, float], dict[str, float], dict[str, str], tuple[str, ...]]:
    """(BM25 terms, stems, stem -> word, head words) of a text, each term's weight summed."""
    words = words_of(text)
    cut = head_of(words, text) if with_head else 0
    bm25: dict[str, float] = {}
    stems: dict[str, float] = {}
    shown: dict[str, str] = {}
    for index, word in enumerate(words):
        if word in _STOP or (len(word) == 1 and not word.isdigit()):
            continue
        boost = HEAD_BOOST if index < cut else 1.0
        root = stem(word)
        shown.setdefault(root, word)
        bm25[root] = bm25.get(root, 0.0) + boost
        stems[root] = max(stems.get(root, 0.0), boost)
        pieces = grams(word)
        if pieces:
            share = NGRAM_SHARE * boost / len(pieces)
            for piece in pieces:
                bm25[piece] = bm25.get(piece, 0.0) + share
    return bm25, stems, shown, tuple(words[:cut])


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
    stem: Callable[[str], str] = str

    @classmethod
    def of(cls, lanes: Sequence[Lane], stem: Callable[[str], str]) -> ExampleIndex:
        index = cls(lanes=len(lanes), stem=stem)
        documents: list[dict[str, float]] = []
        vectors: list[dict[str, float]] = []
        for number, lane in enumerate(lanes):
            document: dict[str, float] = {}
            for text in lane.examples:
                _add(document, terms(text, stem)[0], 1.0)
            _add(document, terms(lane.system, stem)[0], DESCRIPTION_WEIGHT)
            documents.append(document)
            for text in lane.examples:
                vectors.append(terms(text, stem)[1])
                index.owner.append(number)
                index.texts.append(text)
        index._bm25(documents)
        index._vectors(vectors)
        return index

    def _bm25(self, documents: list[dict[str, float]]) -> None:
        count = len(documents)
        lengths = [sum(d.values()) for d in documents]
        average = sum(lengths) / count if count else 1.0
        df: dict[str, int] = {}
        for document in documents:
            for term in document:
                df[term] = df.get(term, 0) + 1
        for lane, document in enumerate(documents):
            norm = K1 * (1 - B + B * lengths[lane] / (average or 1.0))
            for term, tf in sorted(document.items()):
                idf = math.log(1 + (count - df[term] + 0.5) / (df[term] + 0.5))
                weight = idf * tf * (K1 + 1) / (tf + norm)
                self.postings.setdefault(term, []).append((lane, weight))

    def _vectors(self, vectors: list[dict[str, float]]) -> None:
        count = len(vectors)
        df: dict[str, int] = {}
        for vector in vectors:
            for term in vector:
                df[term] = df.get(term, 0) + 1
        self.stem_idf = {t: math.log(1 + count / n) for t, n in df.items()}
        self.unseen_idf = math.log(1 + count) if count else 1.0
        for number, vector in enumerate(vectors):
            weights = {t: w * self.stem_idf[t] for t, w in vector.items()}
            norm = math.sqrt(sum(w * w for w in weights.values())) or 1.0
            for term, weight in sorted(weights.items()):
                self.stems.setdefault(term, []).append((number, weight / norm))

    def query(self, text: str) -> Query:
        bm25, stems, words, head = terms(text, self.stem, with_head=True)
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
        """Per lane: (cosine, example) of its example nearest the request's stems."""
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
        for term, weight in weights.items():
            for example, w in stems.get(term, ()):
                dots[example] = get(example, 0.0) + weight * w
        best: dict[int, tuple[float, int]] = {}
        owner = self.owner
        for example, dot in dots.items():
            lane = owner[example]
            cosine = dot / norm
            if lane not in best or cosine > best[lane][0]:
                best[lane] = (cosine, example)
        return best

    def words(self, query: Query, lane: int, top: int = 4) -> list[str]:
        """The request's words that counted most for `lane` in BM25, best first."""
        postings = self.postings
        by_word: dict[str, float] = {}
        for term, weight in query.bm25.items():
            for owner, w in postings.get(term, ()):
                if owner == lane and not term.startswith("\x00"):
                    word = query.words.get(term, term)
                    by_word[word] = by_word.get(word, 0.0) + weight * w
        ranked = sorted(by_word.items(), key=lambda item: (-item[1], item[0]))
        return [word for word, score in ranked[:top] if score > 0]


def _add(document: dict[str, float], found: dict[str, float], scale: float) -> None:
    for term, weight in found.items():
        document[term] = document.get(term, 0.0) + weight * scale
