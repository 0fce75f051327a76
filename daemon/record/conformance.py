"""Does each body in a ledger fit its kind's published schema? (`tally ledger verify --deep`)

Read-only: entries and bodies are read, nothing is written. Each present body is validated
against the JSON Schema `GET /v1/record/schema` publishes for its kind (jsonschema's 2020-12
validator, the dialect the schemas declare), so what is checked here is what a client checks
with the same document. A redacted, missing or tampered body is the hash check's to report;
a kind tally never wrote (a test's, a later tally's) is listed apart: there is no schema to
hold it to.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from jsonschema import Draft202012Validator
from pydantic import BaseModel

from daemon.record.body import Body

BATCH = 1000
MAX_REPORTED = 100  # mismatches listed in full; the count says how many there were


class EntryLike(Protocol):
    @property
    def seq(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def body(self) -> str | None: ...


class BodyLike(Protocol):
    @property
    def state(self) -> str: ...
    @property
    def value(self) -> Any: ...


class LedgerLike(Protocol):
    @property
    def size(self) -> int: ...

    async def entries(self, start: int = 0, limit: int = 100) -> Sequence[EntryLike]: ...

    async def read_bodies(self, hashes: Sequence[str | None]) -> Sequence[BodyLike]: ...


class Mismatch(BaseModel):
    seq: int
    kind: str
    errors: list[str]
    """What does not fit, each as `<where in the body>: <why>` (at most five)."""


class Conformance(BaseModel):
    """The bodies of a ledger against their kinds' schemas."""

    checked: int = 0
    """Present bodies of known kinds that were validated."""
    mismatches: int = 0
    first: list[Mismatch] = []
    """The first `MAX_REPORTED` mismatches, by seq."""
    unknown: dict[str, int] = {}
    """Entries of kinds the record does not know, by kind (not checked)."""

    @property
    def ok(self) -> bool:
        return self.mismatches == 0


def validators(kinds: Sequence[type[Body]]) -> dict[str, Draft202012Validator]:
    from daemon.record import schema

    return {model.KIND: Draft202012Validator(schema(model)) for model in kinds}


async def conformance(ledger: LedgerLike, kinds: Sequence[type[Body]]) -> Conformance:
    """Validate every present body of `ledger` against its kind's schema, in seq order."""
    checks = validators(kinds)
    report = Conformance()
    unknown: Counter[str] = Counter()
    start, end = 0, ledger.size
    while start < end:
        batch = await ledger.entries(start=start, limit=min(BATCH, end - start))
        if not batch:
            break
        known = [e for e in batch if e.body is not None and e.kind in checks]
        unknown.update(e.kind for e in batch if e.kind not in checks)
        bodies = await ledger.read_bodies([e.body for e in known])
        for entry, body in zip(known, bodies, strict=True):
            if body.state != "present":
                continue  # redacted, missing or tampered: the hash check reports those
            report.checked += 1
            errors = sorted(
                checks[entry.kind].iter_errors(body.value), key=lambda e: list(e.absolute_path)
            )
            if errors:
                report.mismatches += 1
                if len(report.first) < MAX_REPORTED:
                    said = [f"{e.json_path}: {e.message[:300]}" for e in errors[:5]]
                    report.first.append(Mismatch(seq=entry.seq, kind=entry.kind, errors=said))
        start = batch[-1].seq + 1
    report.unknown = dict(sorted(unknown.items()))
    return report
