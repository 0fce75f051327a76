"""Kill the writer between every write and sync of a group commit and of a catch-up (see
`daemon.ledger.journal` and the durability invariant in `daemon.ledger.writer`), as a process
crash and as a power loss, and check what reopening finds: every acknowledged entry and body,
nothing unacknowledged half-present, and a deep verify that passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from daemon.ledger import Ledger
from daemon.ledger.journal import JOURNAL, scan

ROOT = Path(__file__).resolve().parents[2]
STEPS = [
    "journal written",
    "pack written",
    "entries written",
    "journal synced",
    "entries synced",
    "pack synced",
    "journal rotated",
]


def run_until_step(state_dir: Path, step: str, nth: int, mode: str) -> dict[int, tuple[str, str]]:
    child = subprocess.run(
        [sys.executable, "-m", "tests.ledger.step_child", str(state_dir), step, str(nth), mode],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert child.returncode == 9, child.stderr.decode()[-3000:]
    lines = child.stdout.decode().splitlines()
    assert lines[0] == "ready"
    acked = {}
    for line in lines[1:]:
        seq, leaf, body = line.split()
        acked[int(seq)] = (leaf, body)
    return acked


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exit", "power", "torn"])
@pytest.mark.parametrize("step", STEPS)
async def test_a_kill_at_any_step_keeps_every_acknowledged_entry_and_nothing_half(
    state_dir: Path, step: str, mode: str
) -> None:
    acked: dict[int, tuple[str, str]] = {}
    for nth in (3, 17):  # twice on one state dir: the second run starts from a recovery
        acked.update(run_until_step(state_dir, step, nth, mode))
        records = scan((state_dir / "ledger" / JOURNAL).read_bytes())
        ledger = await Ledger.open(state_dir, checkpoint_interval=None)
        try:
            # Exactly what the journal holds whole survives: every batch it acknowledged (and
            # one whose record was complete when the process died), none whose record was not.
            assert ledger.size == records[-1].next_seq
            assert acked, "the child acknowledged nothing before the step"
            for seq, (leaf, body) in acked.items():
                assert seq < ledger.size, f"{step}/{mode}: acknowledged seq {seq} lost"
                assert ledger.leaf_hash(seq) == leaf
                if body != "-":
                    assert (await ledger.body(body)).state == "present"
            everything = await ledger.entries(0, ledger.size)
            bodies = await ledger.read_bodies([e.body for e in everything])
            assert all(b.state in ("present", "none") for b in bodies)
            report = await ledger.verify(deep=True)
            assert report.ok, report
        finally:
            await ledger.close()
