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

ROOT = Path(__file__).resolve().parents[2]


def run_child_and_kill(state_dir: Path, rng: random.Random) -> dict[int, str]:
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.ledger.crash_child", str(state_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,  # unbuffered: communicate() must see everything after the first line
    )
    assert child.stderr is not None
    assert child.stdout is not None
    ready = child.stdout.readline()
    assert ready == b"ready\n", child.stderr.read() if child.stderr else ready
    time.sleep(rng.uniform(0.0, 0.35))
    os.kill(child.pid, signal.SIGKILL)
    out, err = child.communicate()
    acked: dict[int, str] = {}
    for line in out.decode().splitlines():
        assert len(line.split()) == 2, f"child wrote {line!r}; stderr: {err[-3000:]!r}"
        seq, digest = line.split()
        acked[int(seq)] = digest
    return acked


@pytest.mark.slow
async def test_sigkill_never_loses_an_acknowledged_entry(state_dir: Path) -> None:
    rng = random.Random(int.from_bytes(os.urandom(4), "big"))
    acked_all: dict[int, str] = {}
    pinned: tuple[int, str] | None = None  # (size, root) of the checkpoint seen last round
    rounds = 0
    deadline = time.monotonic() + 15
    while rounds < 20 or (rounds < 40 and time.monotonic() < deadline):
        acked_all.update(run_child_and_kill(state_dir, rng))
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
    assert len(acked_all) > 100
