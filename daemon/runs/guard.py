"""The structured-output guard: ask for a JSON schema, rescue what comes back, retry briefly.

Small local models often ignore `response_format`, wrap JSON in a markdown fence, or add a
sentence around it. The guard parses the reply directly, then rescues a fenced block, then
the first balanced JSON object; a reply that still fails (or fails validation) is answered
with a short corrective message, at most `attempts` times. Each attempt is witnessed by the
caller's `on_attempt`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.DOTALL)


class GuardFailed(Exception):
    """No attempt produced a valid structure."""

    def __init__(self, purpose: str, errors: list[str]) -> None:
        super().__init__(f"{purpose}: no valid structured reply after {len(errors)} attempts")
        self.purpose = purpose
        self.errors = errors


def _balanced_spans(text: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """One pass over `text`: the outermost `{…}` spans whose braces balance, and the spans
    nested in them, each as (start, end) in start order. Strings and escapes are respected
    inside braces; text between objects is skipped, so its quotes cannot swallow the next."""
    outer: list[tuple[int, int]] = []
    inner: list[tuple[int, int]] = []
    opened: list[int] = []
    in_string = escaped = False
    i = text.find("{")
    while i != -1 and i < len(text):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "{":
            opened.append(i)
        elif ch == "}":
            start = opened.pop()
            (inner if opened else outer).append((start, i + 1))
            if not opened:  # back outside any object: jump to the next one
                i = text.find("{", i + 1)
                continue
        i += 1
    inner.sort()
    return outer, inner


def first_balanced_object(text: str) -> str | None:
    """The first `{…}` span whose braces balance and that parses as JSON, outermost first.

    Linear in `len(text)`: one scan finds the spans; the outermost ones are disjoint, and the
    nested ones (tried only when no outermost one parses) share a parse budget of twice the
    text, so a reply of 2,000 unmatched `{` costs one pass, not 2,000.
    """
    outer, inner = _balanced_spans(text)
    budget = 2 * len(text)
    for n, (start, end) in enumerate((*outer, *inner)):
        if n >= len(outer):
            budget -= end - start
            if budget < 0:
                break
        candidate = text[start:end]
        try:
            json.loads(candidate)
        except (ValueError, RecursionError):  # RecursionError: nesting past json's limit
            continue
        return candidate
    return None


def parse_json(text: str) -> tuple[Any, str]:
    """Parse `text` as JSON, rescuing it if needed. Returns (value, how); raises ValueError."""
    stripped = text.strip()
    try:
        return json.loads(stripped), "parsed"
    except (ValueError, RecursionError):  # a model's reply may nest past json's limit
        pass
    for match in _FENCE.finditer(text):
        try:
            return json.loads(match.group(1).strip()), "rescued_fenced"
        except (ValueError, RecursionError):
            continue
    span = first_balanced_object(text)
    if span is not None:
        return json.loads(span), "rescued_object"
    raise ValueError("no JSON object in the reply")


def response_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI-compatible `response_format` asking for `schema` (llama.cpp honours it)."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@dataclass(frozen=True)
class Attempt:
    purpose: str
    attempt: int
    outcome: str
    error: str | None
    reply_seq: int | None


@dataclass
class Guarded(Generic[T]):
    value: T
    reply_seq: int | None
    attempts: int


Ask = Callable[[list[dict[str, Any]], int], Awaitable[tuple[str, int | None]]]
"""(messages, attempt) -> (reply text, the seq of the witnessed reply or None)."""


async def structured(
    purpose: str,
    messages: list[dict[str, Any]],
    ask: Ask,
    validate: Callable[[Any], T],
    *,
    attempts: int = 3,
    on_attempt: Callable[[Attempt], Awaitable[None]] | None = None,
) -> Guarded[T]:
    """Ask until `validate(parsed)` accepts, at most `attempts` times; raise GuardFailed."""
    history = list(messages)
    errors: list[str] = []
    for n in range(1, attempts + 1):
        text, seq = await ask(history, n)
        outcome = "invalid"
        error: str | None = None
        value: T | None = None
        try:
            parsed, outcome = parse_json(text)
            value = validate(parsed)
        except Exception as exc:  # validation errors of every kind become feedback
            error = _short(exc)
            outcome = "invalid"
        if on_attempt is not None:
            await on_attempt(Attempt(purpose, n, outcome, error, seq))
        if error is None:
            return Guarded(value=value, reply_seq=seq, attempts=n)  # type: ignore[arg-type]
        errors.append(error)
        history = [
            *messages,
            {"role": "assistant", "content": text[:2000]},
            {
                "role": "user",
                "content": f"That reply was not valid: {error}. Reply with only one JSON "
                "object that matches the schema, no prose and no code fence.",
            },
        ]
    raise GuardFailed(purpose, errors)


def _short(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"
