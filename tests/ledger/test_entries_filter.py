"""entries() filters on the raw canonical line, without parsing entries it skips."""

from __future__ import annotations

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
