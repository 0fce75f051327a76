"""Bytes from outside the process: read with a byte cap, parsed with a bound on nesting.

Every body a pool member, a remote tally daemon or a probed server sends is hostile until
parsed: it may be huge (an honest Content-Length of 400 MiB), never end, or nest 100k deep.
- `read_body` reads a response incrementally and stops one byte past its cap: it never holds
  more than `cap + 1` bytes, and a Content-Length over the cap is refused before any read.
  The rest of the body is left unread; leaving the response closes its connection.
- `loads` parses JSON whose nesting is at most `MAX_DEPTH` (checked before parsing, on the
  brackets outside strings, so nothing downstream can recurse past it) and refuses NaN and
  Infinity (no ledger body holds them). Every failure is a `Malformed`, a ValueError.
  It also bounds how many values the text holds (`MAX_VALUES`, counted before parsing): a
  body small in bytes can be huge in memory (16 MiB of `[],` is 5.6M lists, 400 MB parsed).

A caller turns `TooLarge` and `Malformed` into its own error: the slot pool's `BadReply`
(the member's fault), a `failed` remote check, a server that "answered something that is
not JSON".
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

MAX_DEPTH = 64
"""No OpenAI, llama.cpp or tally answer nests deeper than a dozen levels."""

MAX_VALUES = 1 << 20
"""The most containers and separated items a body may hold, or one per VALUE_BYTES of it if
that is more (a member allowed a larger reply): about 72 MB parsed at worst, or 4.5 times
the body, where 16 MiB of `[],` is 400 MB. An honest reply is far below: 4096 tokens of
logprobs with 20 alternatives is about 500k values, an embedding's float about 20 bytes."""
VALUE_BYTES = 16

SMALL_BODY = 1 << 20
"""The cap of an answer that is not a model's output: /health, /props, /v1/models, /slots."""

_CHUNK = 1 << 16
# A JSON string, escapes included (the unrolled form: no backtracking per character).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class TooLarge(ValueError):
    """A body past its cap; `cap` is the cap, `what` names the body."""

    def __init__(self, what: str, cap: int, declared: int | None = None) -> None:
        said = f" (its Content-Length says {declared})" if declared is not None else ""
        super().__init__(f"{what} is over its limit of {cap} bytes{said}")
        self.cap = cap
        self.what = what


class Malformed(ValueError):
    """Not JSON, JSON nested past `MAX_DEPTH`, or JSON holding NaN or Infinity."""


class _Content(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


class _Response(Protocol):
    @property
    def content_length(self) -> int | None: ...
    @property
    def content(self) -> _Content: ...


async def read_body(resp: _Response, cap: int, what: str) -> bytes:
    """The whole body of `resp`, or TooLarge as soon as it is known to be over `cap` bytes."""
    declared = resp.content_length
    if declared is not None and declared > cap:
        raise TooLarge(what, cap, declared)
    parts: list[bytes] = []
    size = 0
    while True:
        # read(n) returns what is buffered (at most n), b"" only at the end of the body
        chunk = await resp.content.read(min(_CHUNK, cap + 1 - size))
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
        if size > cap:
            raise TooLarge(what, cap)
    return b"".join(parts)


def depth(data: bytes) -> int:
    """How deep the JSON text nests (an upper bound if it is not valid JSON)."""
    opened = data.count(b"[") + data.count(b"{")
    if opened <= MAX_DEPTH:
        return opened  # it cannot nest deeper than it has brackets
    return _depth_of(_STRING.sub(b"", data))


def _depth_of(bare: bytes) -> int:
    """How deep text with its strings removed nests."""
    level = deepest = 0
    for byte in bare.translate(None, _NOT_BRACKETS):
        if byte in b"[{":
            level += 1
            if level > deepest:
                deepest = level
                if deepest > MAX_DEPTH:
                    return deepest
        else:
            level -= 1
    return deepest


def _items(data: bytes) -> int:
    return data.count(b",") + data.count(b"[") + data.count(b"{")


def values(data: bytes) -> int:
    """An upper bound on how many JSON values the text holds: its containers and the commas
    between items, outside strings (each value past a container's first follows a comma)."""
    rough = _items(data)
    if rough <= MAX_VALUES:
        return rough  # strings only add to the rough count
    return _items(_STRING.sub(b"", data))


def _bounded(raw: bytes, what: str) -> None:
    """Malformed if `raw` nests past MAX_DEPTH or holds past MAX_VALUES values; the strings
    are stripped (the slow part) at most once, and only when the cheap counts cannot decide."""
    limit = max(MAX_VALUES, len(raw) // VALUE_BYTES)
    opened = raw.count(b"[") + raw.count(b"{")
    rough = opened + raw.count(b",")
    if opened <= MAX_DEPTH and rough <= limit:
        return
    # Each string is a value, and only its two unescaped quotes count: past the bound on
    # quotes alone, refused before the strip (which is slow for millions of short strings).
    if (raw.count(b'"') - raw.count(b'\\"')) // 2 > limit:
        raise Malformed(f"{what} holds more than {limit} JSON values")
    bare = _STRING.sub(b"", raw) if b'"' in raw else raw
    # the count first: the walk for the depth is a Python loop over every bracket
    if rough > limit and _items(bare) > limit:
        raise Malformed(f"{what} holds more than {limit} JSON values")
    if opened > MAX_DEPTH and _depth_of(bare) > MAX_DEPTH:
        raise Malformed(f"{what} nests deeper than {MAX_DEPTH} levels")


def _constant(name: str) -> Any:
    raise Malformed(f"{name} is not a JSON number a ledger can hold")


def loads(data: bytes | str, what: str = "the answer") -> Any:
    """Parse untrusted JSON; Malformed (a ValueError) names `what` and why."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    _bounded(raw, what)
    try:
        return json.loads(raw, parse_constant=_constant)
    except Malformed:
        raise
    except RecursionError:  # cannot happen below MAX_DEPTH; kept so no caller ever sees one
        raise Malformed(f"{what} nests too deep to parse") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, too many int digits
        raise Malformed(f"{what} is not valid JSON: {str(err)[:200]}") from None
