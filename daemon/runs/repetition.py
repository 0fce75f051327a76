"""The repetition guard: where a model's text starts to loop, and the text cut there.

Small models loop: the same sentence again and again, or the same phrase back to back until
the token limit. Two signs, both linear in the text:
- a sentence (or line) of at least MIN_SENTENCE characters seen `times` times: the text is
  cut before its second occurrence;
- a span of MIN_SPAN..MAX_SPAN characters repeated back to back `times` times: the text is
  cut after its first occurrence.
Text with neither comes back unchanged.
"""

from __future__ import annotations

import re

MIN_SENTENCE = 20
MIN_SPAN = 12
MAX_SPAN = 200
_SENTENCE = re.compile(r"[^.!?\n]+[.!?\n]?")


def cut_loop(text: str, times: int = 3) -> tuple[str, bool]:
    """(the text up to where it loops, whether it looped)."""
    cut = min(_sentence_loop(text, times), _span_loop(text, times))
    if cut >= len(text):
        return text, False
    return text[:cut].rstrip(), True


def _sentence_loop(text: str, times: int) -> int:
    first: dict[str, int] = {}  # normalised sentence -> start of its second occurrence
    seen: dict[str, int] = {}
    for match in _SENTENCE.finditer(text):
        key = " ".join(match.group().split()).lower()
        if len(key) < MIN_SENTENCE:
            continue
        seen[key] = seen.get(key, 0) + 1
        if seen[key] == 2:
            first[key] = match.start()
        if seen[key] >= times:
            return first[key]
    return len(text)


def _span_loop(text: str, times: int) -> int:
    """The end of the first copy of a span repeated `times` times back to back, else len."""
    n = len(text)
    for span in range(MIN_SPAN, MAX_SPAN + 1):
        run = 0  # characters so far that equal the character `span` before them
        for i in range(span, n):
            run = run + 1 if text[i] == text[i - span] else 0
            if run >= span * (times - 1):
                start = i - span * times + 1
                return start + span
    return n
