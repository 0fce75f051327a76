"""entries() filters on the raw canonical line, without parsing entries it skips."""

from __future__ import annotations

import asyncio
from pathlib import Path

from daemon.ledger import Ledger


async def test_in_run_keeps_only_entries_of_some_run(state_dir: Path) -> None:
    ledger = await Ledger.open(state_dir)
    try:
        await ledger.append(actor="pool", kind="slot.ready", body={"n": 1})
        a = await ledger.append(actor="engine", kind="run.request", body={"t": "x"}, run="r1")
        await ledger.append(actor="x", kind="note", body={"run": None})
        b = await ledger.append(actor="engine", kind="run.answer", run="r2", parent=a.seq)
        found = await ledger.entries(in_run=True)
        assert [e.seq for e in found] == [a.seq, b.seq]
        assert [e.seq for e in await ledger.entries(in_run=True, kind="run.answer")] == [b.seq]
        assert [e.seq for e in await ledger.entries(start=a.seq + 1, in_run=True)] == [b.seq]
        assert len(await ledger.entries()) == 4
    finally:
        await ledger.close()


async def test_filters_match_the_fields_not_look_alikes_inside_strings(state_dir: Path) -> None:
    """The scan jumps between occurrences of the first filter's bytes: an actor or kind
    whose text spells another field's filter (escaped quotes) never matches it, limits and
    starts hold across 4,096-line blocks, and the result equals a filter over every entry."""
    ledger = await Ledger.open(state_dir)
    tricky = ['"run":"r1",', 'x"kind":"note",', "r1", '"actor":"a",']
    try:
        for chunk in range(0, 9000, 500):  # appended at once: group commits
            await asyncio.gather(*(append(ledger, i, tricky) for i in range(chunk, chunk + 500)))
        every = await ledger.entries(limit=10_000)
        assert len(every) == 9000
        for kind, run, actor in [
            ("note", "r1", None),
            (None, "r1", None),
            ("other", None, "a"),
            (None, None, '"run":"r1",'),
            ("note", "r0", 'x"kind":"note",'),
        ]:
            want = [
                e.seq
                for e in every
                if (kind is None or e.kind == kind)
                and (run is None or e.run == run)
                and (actor is None or e.actor == actor)
            ]
            got = await ledger.entries(limit=10_000, kind=kind, run=run, actor=actor)
            assert [e.seq for e in got] == want, (kind, run, actor)
            some = await ledger.entries(start=4000, limit=7, kind=kind, run=run, actor=actor)
            assert [e.seq for e in some] == [s for s in want if s >= 4000][:7]
    finally:
        await ledger.close()


async def append(ledger: Ledger, i: int, tricky: list[str]) -> None:
    await ledger.append(
        actor=tricky[i % 4] if i % 7 == 0 else "a",
        kind="note" if i % 3 else "other",
        run=None if i % 5 == 0 else f"r{i % 2}",
    )
