"""Regular expressions a client sends (regex assertions), matched in linear time.

Python's `re` backtracks: `^(a+)+$` against "a"*27+"!" took 4.7 s on the event loop, doubling
with each character. RE2 (google-re2) guarantees time linear in the subject and bounded memory,
at the price of no backreferences and no lookaround; such patterns are refused when the plan is
submitted, not when the task runs. Patterns and subjects are capped as well.
"""

from __future__ import annotations

import functools
from typing import Any

import re2

MAX_PATTERN = 1000
"""Characters in a pattern."""
MAX_SUBJECT = 1024 * 1024
"""Characters of an output a pattern is matched against; the rest is not searched."""
MAX_MEM = 8 * 1024 * 1024
"""RE2's memory budget per compiled pattern: a huge repetition count fails to compile."""


class PatternError(ValueError):
    """A pattern RE2 cannot (or may not) compile; the message says why."""


@functools.lru_cache(maxsize=256)
def compile_pattern(pattern: str) -> re2._Regexp:
    if len(pattern) > MAX_PATTERN:
        raise PatternError(f"a pattern may have at most {MAX_PATTERN} characters")
    options = re2.Options()
    options.log_errors = False
    options.max_mem = MAX_MEM
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
        raise PatternError(
            f"not a valid RE2 pattern ({reason}); backreferences and lookaround are not supported"
        ) from None


def search(pattern: str, subject: str) -> bool:
    """Whether `pattern` matches somewhere in the first MAX_SUBJECT characters of `subject`."""
    return compile_pattern(pattern).search(subject[:MAX_SUBJECT]) is not None


def schema_patterns(schema: Any) -> list[str]:
    """Every `pattern` of a JSON schema, refusing `patternProperties`.

    jsonschema matches `patternProperties` (and, through them, `additionalProperties`) with
    Python's backtracking `re`, outside the `pattern` keyword that tally swaps for RE2; a
    schema can say the same with `propertyNames: {pattern: …}`, which goes through RE2.
    """
    found: list[str] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "patternProperties" in node:
                raise PatternError(
                    "patternProperties is not supported in assertion schemas (it would match "
                    "with a backtracking engine); use propertyNames with a pattern"
                )
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found
