"""Checking a task's output: declared assertions, and the run-level intent check.

Assertions are data declared with the task before it runs; checking them is code, not a
model grading itself. Each failure is a short sentence that goes into the verdict and into
the next attempt's prompt, so a retry knows what to fix.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from daemon import patterns
from daemon.runs.guard import parse_json

_WORD = re.compile(r"[a-z0-9][a-z0-9+#_-]*")
_STOP = frozenset(
    [
        "a",
        "about",
        "above",
        "after",
        "again",
        "all",
        "also",
        "am",
        "an",
        "and",
        "any",
        "are",
        "as",
        "at",
        "be",
        "because",
        "been",
        "before",
        "being",
        "below",
        "between",
        "both",
        "but",
        "by",
        "can",
        "could",
        "did",
        "do",
        "does",
        "doing",
        "down",
        "during",
        "each",
        "few",
        "for",
        "from",
        "further",
        "had",
        "has",
        "have",
        "having",
        "he",
        "her",
        "here",
        "hers",
        "him",
        "his",
        "how",
        "i",
        "if",
        "in",
        "into",
        "is",
        "it",
        "its",
        "itself",
        "just",
        "let",
        "me",
        "more",
        "most",
        "my",
        "no",
        "nor",
        "not",
        "now",
        "of",
        "off",
        "on",
        "once",
        "only",
        "or",
        "other",
        "our",
        "out",
        "over",
        "own",
        "please",
        "same",
        "she",
        "should",
        "so",
        "some",
        "such",
        "than",
        "that",
        "the",
        "their",
        "them",
        "then",
        "there",
        "these",
        "they",
        "this",
        "those",
        "through",
        "to",
        "too",
        "under",
        "until",
        "up",
        "very",
        "was",
        "we",
        "were",
        "what",
        "when",
        "where",
        "which",
        "while",
        "who",
        "whom",
        "why",
        "will",
        "with",
        "would",
        "you",
        "your",
        "yours",
        "write",
        "make",
        "give",
        "tell",
        "show",
        "explain",
        "describe",
        "using",
        "use",
        "need",
        "want",
        "get",
        "new",
        "one",
        "two",
    ]
)


def _assertion_fields(assertion: Any) -> dict[str, Any]:
    if isinstance(assertion, dict):
        return assertion
    dumped: dict[str, Any] = assertion.model_dump(by_alias=True)
    return dumped


def check(assertions: Sequence[Any], output: str, exit_code: int | None = None) -> list[str]:
    """All failed assertions as sentences; [] when every assertion holds."""
    failures: list[str] = []
    for assertion in assertions:
        a = _assertion_fields(assertion)
        kind = a.get("type")
        if kind == "contains":
            if a["text"] not in output:
                failures.append(f"the output must contain {a['text']!r}")
        elif kind == "regex":
            try:
                if not patterns.search(a["pattern"], output):
                    failures.append(f"the output must match the pattern {a['pattern']!r}")
            except patterns.PatternError as exc:
                failures.append(f"the pattern {a['pattern']!r} is invalid: {exc}")
        elif kind == "max_length":
            if len(output) > a["chars"]:
                failures.append(
                    f"the output must be at most {a['chars']} characters (it was {len(output)})"
                )
        elif kind == "exit_code":
            if exit_code != a["code"]:
                failures.append(f"the command must exit with {a['code']} (it exited {exit_code})")
        elif kind == "json_schema":
            failures.extend(_check_schema(a.get("schema") or a.get("schema_") or {}, output))
        elif kind == "run":
            continue  # runs in the task's view, after the task (daemon.runs.views)
        else:
            failures.append(f"unknown assertion type {kind!r}")
    return failures


@functools.cache
def _re2_validator() -> Any:
    """Draft 2020-12 with `pattern` matched by RE2 (linear time), not Python's `re`.

    jsonschema loads with the first schema check (see daemon.plans); plans with
    `patternProperties` are refused at submit (daemon.patterns.schema_patterns).
    """
    import jsonschema
    from jsonschema.exceptions import ValidationError

    def pattern(validator: Any, regex: str, instance: Any, schema: Any) -> Any:
        if validator.is_type(instance, "string") and not patterns.search(regex, instance):
            yield ValidationError(f"{instance[:80]!r} does not match {regex!r}")

    draft = jsonschema.Draft202012Validator
    return jsonschema.validators.extend(draft, {"pattern": pattern})  # type: ignore[no-untyped-call]


def _check_schema(schema: dict[str, Any], output: str) -> list[str]:
    try:
        value, _ = parse_json(output)
    except ValueError:
        return ["the output must be a JSON value matching the schema (no JSON found)"]
    validator = _re2_validator()(schema)
    errors = sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
    return [
        f"the JSON output does not match the schema at /{'/'.join(map(str, e.absolute_path))}: "
        f"{e.message}"
        for e in errors[:5]
    ]


def _stem(word: str) -> str:
    for suffix in ("ing", "ed", "es", "s"):
        if len(word) > len(suffix) + 3 and word.endswith(suffix):
            word = word[: -len(suffix)]
            break
    # "parse", "parsing" and "parses" should meet: drop a final e as well
    return word[:-1] if len(word) > 4 and word.endswith("e") else word


def key_words(text: str, limit: int = 24) -> list[str]:
    """The request's key vocabulary: content words, stemmed, in first-seen order."""
    seen: dict[str, None] = {}
    for word in _WORD.findall(text.lower()):
        if len(word) < 3 or word in _STOP:
            continue
        seen.setdefault(_stem(word), None)
    return list(seen)[:limit]


def intent(request: str, answer: str) -> dict[str, Any]:
    """How much of the request's key vocabulary the answer covers (ppm), and what it misses."""
    keys = key_words(request)
    present = {_stem(w) for w in _WORD.findall(answer.lower())}
    missing = [w for w in keys if w not in present]
    coverage = 1_000_000 if not keys else (len(keys) - len(missing)) * 1_000_000 // len(keys)
    return {"coverage_ppm": coverage, "keys": keys, "missing": missing}
