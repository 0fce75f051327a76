from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.ledger import Ledger, verify_note
from daemon.ledger.merkle import verify_consistency
from tests.polling import until_sync

ROOT = Path(__file__).resolve().parents[2]


class Children:
    """The zygote (tests/ledger/crash_child.py) that forks each round's appending child."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.rounds = 0
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.ledger.crash_child"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run_and_kill(self, state_dir: Path, rng: random.Random) -> dict[int, str]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.rounds += 1
        acks = self.tmp / f"acks-{self.rounds}"
        self.proc.stdin.write(f"{state_dir}\t{acks}\n")
        self.proc.stdin.flush()
        pid = int(self.proc.stdout.readline())
        until_sync(lambda: acks.exists() and acks.read_bytes().startswith(b"ready\n"), 60,
                   what=f"round {self.rounds}: the child opened the ledger")  # fmt: skip
        time.sleep(rng.uniform(0.0, 0.35))
        os.kill(pid, signal.SIGKILL)
        assert self.proc.stdout.readline() == "exited\n"  # reaped: its writes are all in
        acked: dict[int, str] = {}
        for line in acks.read_text().splitlines()[1:]:
            assert len(line.split()) == 2, f"child wrote {line!r}"
            seq, digest = line.split()
            acked[int(seq)] = digest
        return acked

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.mark.slow
async def test_sigkill_never_loses_an_acknowledged_entry(state_dir: Path, tmp_path: Path) -> None:
    children = Children(tmp_path)
    rng = random.Random(int.from_bytes(os.urandom(4), "big"))
    acked_all: dict[int, str] = {}
    pinned: tuple[int, str] | None = None  # (size, root) of the checkpoint seen last round
    rounds = 0
    # 20 kills at random points always; more while the machine is quick (a round is a fork,
    # not a fresh interpreter, so 20 take a few seconds)
    deadline = time.monotonic() + 8
    while rounds < 20 or (rounds < 40 and time.monotonic() < deadline):
        acked_all.update(children.run_and_kill(state_dir, rng))
        rounds += 1
        ledger = await Ledger.open(state_dir, checkpoint_interval=None)
        try:
            for seq, digest in acked_all.items():
                assert seq < ledger.size, f"round {rounds}: acknowledged seq {seq} lost"
                assert ledger.leaf_hash(seq) == digest, f"round {rounds}: seq {seq} changed"
            sample = rng.sample(sorted(acked_all), min(20, len(acked_all)))
            for seq in sample:
                assert (await ledger.get(seq)).hash == acked_all[seq]
            report = await ledger.verify(deep=rounds % 5 == 0)
            assert report.ok, report
            latest = ledger.latest_checkpoint()
            if latest is not None:
                assert ledger.vkey is not None
                verify_note(latest.note, ledger.vkey)
            if pinned is not None:
                old, old_root = pinned
                proof = await ledger.consistency_proof(old)
                assert verify_consistency(
                    old,
                    proof.new_size,
                    bytes.fromhex(old_root),
                    bytes.fromhex(proof.new_root),
                    [bytes.fromhex(p) for p in proof.path],
                )
            if latest is not None:
                pinned = (latest.size, latest.root)
        finally:
            # Alternate: a clean close (checkpoint + derived sync) or an abandoned handle,
            # so recovery is exercised both from a synced index and from a stale one.
            if rounds % 2:
                await ledger.close()
            else:
                await ledger.abandon()
    children.close()
    assert len(acked_all) > 100
