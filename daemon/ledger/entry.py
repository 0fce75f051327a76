"""The ledger entry: its fields, its one-line canonical encoding and its identity (leaf hash)."""

from __future__ import annotations

import json
from json.encoder import encode_basestring as _encode_basestring
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from daemon.ledger.canonical import MAX_SAFE_INT, canonical_bytes
from daemon.ledger.merkle import leaf_hash

SafeInt = Annotated[int, Field(strict=True, ge=-MAX_SAFE_INT, le=MAX_SAFE_INT)]
Seq = Annotated[int, Field(strict=True, ge=0, le=MAX_SAFE_INT)]
Hex32 = Annotated[str, Field(strict=True, pattern=r"^[0-9a-f]{64}$")]

VERSION = 1
GENESIS_PREV = "0" * 64
"""`prev` of entry 0: there is no earlier leaf."""


BodyState = Literal["present", "redacted", "missing", "tampered", "none"]


class Body(NamedTuple):
    """An entry's body as read back: `value` is the JSON value only when `state` is "present"
    (a stored JSON null is present with value None). "redacted": its record was zeroed by a
    witnessed redaction; "missing": no record of it; "tampered": the stored bytes do not hash
    to it; "none": the entry has no body."""

    state: BodyState
    value: Any = None


NO_BODY = Body("none")


class Entry(BaseModel):
    """One ledger entry. `hash` (its RFC 9162 leaf hash) is derived, never part of the line."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    v: Annotated[int, Field(strict=True, ge=1, le=1)] = VERSION
    seq: Seq
    ts: Seq
    actor: Annotated[str, Field(strict=True, min_length=1)]
    kind: Annotated[str, Field(strict=True, min_length=1)]
    run: Annotated[str, Field(strict=True)] | None = None
    parent: Seq | None = None
    body: Hex32 | None = None
    prev: Hex32
    hash: Hex32 = Field(exclude=True)

    def line(self) -> bytes:
        """The entry's canonical JSON, exactly as stored (without the newline)."""
        return canonical_bytes(self.model_dump())

    @classmethod
    def from_line(cls, line: bytes) -> Entry:
        """Parse a stored line, insisting it is the canonical encoding of a valid entry."""
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("entry is not a JSON object")
        entry = cls.model_validate({**data, "hash": leaf_hash(line).hex()})
        if entry.line() != line:
            raise ValueError("entry line is not canonical JSON")
        return entry


def line_template(
    actor: str, kind: str, run: str | None, parent: int | None, body: str | None
) -> tuple[str, str]:
    """The parts of an entry's line that do not depend on its place in the log.

    The line is `head + prev + tail + seq + ',"ts":' + ts + '}'`-shaped (see `fill_line`), so
    `append` encodes the caller's fields once and the writer only splices in seq, ts and prev.
    """
    run_json = "null" if run is None else _encode_basestring(run)
    parent_json = "null" if parent is None else str(parent)
    body_json = "null" if body is None else f'"{body}"'
    head = (
        f'{{"actor":{_encode_basestring(actor)},"body":{body_json},'
        f'"kind":{_encode_basestring(kind)},"parent":{parent_json},"prev":"'
    )
    return head, f'","run":{run_json},"seq":'


def fill_line(head: str, tail: str, seq: int, ts: int, prev: str) -> bytes:
    """Complete a `line_template` into the canonical line."""
    return f'{head}{prev}{tail}{seq},"ts":{ts},"v":{VERSION}}}'.encode()


def encode_line(
    *,
    seq: int,
    ts: int,
    actor: str,
    kind: str,
    run: str | None,
    parent: int | None,
    body: str | None,
    prev: str,
) -> bytes:
    """The canonical line for already-validated fields (the writer's hot path).

    Keys in sorted order, strings through the stdlib's own JSON string encoder: byte-equal to
    `canonical_bytes(fields)` (a test holds it to that) at a fraction of its cost.
    """
    head, tail = line_template(actor=actor, kind=kind, run=run, parent=parent, body=body)
    return fill_line(head, tail, seq, ts, prev)
