"""The journal is zero-filled ahead of its records a step at a time: opening a new ledger
writes no 16 MiB before the first answer, commits past the fill extend it by a step (one size
change per step), and a rotation fills it whole; the record survives a reopen either way."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from daemon.ledger import Ledger
from daemon.ledger.journal import FILL_STEP, JOURNAL, Journal
from daemon.ledger.writer import JOURNAL_SPACE


def journal_size(state_dir: Path) -> int:
    return os.path.getsize(state_dir / "ledger" / JOURNAL)


async def test_a_new_journal_is_filled_a_step_at_a_time(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fills: list[int] = []
    fill = Journal._fill

    def counted(self: Journal, upto: int) -> None:
        before = self.filled
        fill(self, upto)
        if self.filled > before:
            fills.append(self.filled - before)

    monkeypatch.setattr(Journal, "_fill", counted)
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    try:
        assert journal_size(state_dir) == FILL_STEP  # not JOURNAL_SPACE before the first answer
        for round_ in range(3):  # ~2 KiB of distinct body per entry: past the first step
            await asyncio.gather(
                *(
                    ledger.append(
                        actor="t", kind="k", body={"n": round_ * 300 + i, "x": "x" * 2000}
                    )
                    for i in range(300)
                )
            )
        grown = journal_size(state_dir)
        assert FILL_STEP < grown < JOURNAL_SPACE
        # Filled ahead in steps of at least FILL_STEP (the open's one, then one or two more),
        # not by every commit that passed the end.
        assert 2 <= len(fills) <= 4
        assert all(step >= FILL_STEP for step in fills)
        assert sum(fills) == grown
        await ledger.checkpoint()  # a catch-up rotates the journal: filled whole
        assert journal_size(state_dir) == JOURNAL_SPACE
        size = ledger.size
    finally:
        await ledger.close()
    again = await Ledger.open(state_dir, checkpoint_interval=None)
    try:
        assert again.size == size
        assert (await again.verify(deep=True)).ok
    finally:
        await again.close()
