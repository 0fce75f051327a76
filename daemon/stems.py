"""The stemmer the router and the example index share: a small, predictable English suffix
stripper, below both (the router reads the example index, and the index stems as the router
does, so a lane's keywords and its examples meet on the same terms)."""

from __future__ import annotations

from functools import lru_cache

# Words the suffix rules would damage; kept exactly as written.
_UNSTEMMED = frozenset(
    {
        "bed", "embed", "exceed", "feed", "need", "proceed", "seed", "speed", "red", "shed",
        "bring", "during", "nothing", "ping", "ring", "sing", "spring", "string", "thing",
        "something", "everything", "anything", "morning", "evening", "king",
        "canned", "news", "always", "sometimes", "perhaps", "series", "species", "lens", "canvas",
        "physics", "mathematics", "analytics", "statistics", "graphics", "ethics",
        "kubernetes", "redis", "postgres", "jenkins", "atlas", "alias", "bias", "gas",
    }
)  # fmt: skip
_SUFFIXES: tuple[tuple[str, str], ...] = (
    ("ization", "iz"),
    ("isation", "iz"),
    ("ation", "at"),
    ("ies", "y"),
    ("ing", ""),
    ("ed", ""),
    ("s", ""),
)
_KEEP_FINAL_S = ("ss", "us", "is")
_VOWELS = frozenset("aeiouy")
_NO_UNDOUBLE = frozenset("lsz")


@lru_cache(maxsize=65536)
def stem(word: str) -> str:
    """A small, predictable English suffix stripper ("tests"/"testing"/"tested" -> "test").

    Only lowercase ASCII alphabetic words longer than three letters are touched; anything
    with digits or symbols ("k8s", "c++", "utf8") or non-ASCII letters is returned as is.
    One suffix rule applies (first match in `_SUFFIXES`, and only if what remains is at
    least three letters with a vowel, any three letters for a plural "s" so "jwts" meets
    "jwt"; after a plural "s" one more rule may apply, so "settings" meets "setting" and
    "set"), then a doubled final consonant left by -ing/-ed is
    undoubled ("running" -> "run") and a final "e" is dropped ("cache" and "caching" ->
    "cach"), so the verb, noun and plural forms of a word meet.
    """
    if len(word) <= 3 or not (word.isascii() and word.isalpha()) or word in _UNSTEMMED:
        return word
    return _strip(word, _SUFFIXES)


def _strip(word: str, rules: tuple[tuple[str, str], ...]) -> str:
    for suffix, replacement in rules:
        if not word.endswith(suffix):
            continue
        if suffix == "s" and word.endswith(_KEEP_FINAL_S):
            break
        if suffix == "ed" and word.endswith("eed"):
            break
        base = word[: -len(suffix)]
        if len(base) + len(replacement) < 3:
            break
        # a plural "s" comes off an acronym too ("JWTs", "LLMs", "SDKs" meet "jwt", "llm",
        # "sdk"); the other rules need a vowel left so "sing" or "shed" keep their letters
        if suffix != "s" and not _VOWELS.intersection(base):
            break
        word = base + replacement
        if suffix == "s" and word not in _UNSTEMMED:
            # plural of a derived form ("settings", "docstrings"): strip once more
            return _strip(word, rules[:-1])
        if suffix in ("ing", "ed") and _doubled(word):
            word = word[:-1]
        break
    if len(word) > 3 and word.endswith("e"):
        word = word[:-1]
    return word


def _doubled(word: str) -> bool:
    last = word[-1]
    return len(word) > 3 and word[-2] == last and last not in _VOWELS and last not in _NO_UNDOUBLE
