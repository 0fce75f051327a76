"""Child process for the step-kill test: 64 tasks append (and checkpoint, so catch-ups run)
until the writer reaches the `nth` time a commit or catch-up step completes, then it dies there.

Run as `python -m tests.ledger.step_child STATE_DIR STEP NTH MODE`. MODE "exit": `os._exit` at
the step (the page cache keeps every write, as after a process crash). MODE "power": first drop
every byte written since its file's last successful fsync/fdatasync, as a power loss at that
instant may, then `os._exit`. MODE "torn": only the journal loses its unsynced records (the
record files keep what the page cache wrote: a power loss need not take every unsynced page,
so a batch's lines may survive where its journal record did not). Each acknowledged entry is
printed as "seq leaf-hash body-hash-or-none" on stdout.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading

from daemon.ledger import Ledger

synced: dict[int, int] = {}  # inode -> size at its last successful sync
journal_synced = [0]  # the journal's end at its last fdatasync
lock = threading.Lock()


def recording(real: object) -> object:
    def sync(fd: int) -> None:
        real(fd)  # type: ignore[operator]
        st = os.fstat(fd)
        with lock:
            synced[st.st_ino] = st.st_size

    return sync


def power_cut(ledger: Ledger, files: bool) -> None:
    """Drop what never reached the disk: the journal's records past its last fdatasync (its
    file is zero-filled ahead, so they are zeroed, not cut); with `files`, also the record
    files' bytes past their last fsync."""
    journal = ledger._journal
    if journal.end > journal_synced[0]:
        os.pwrite(journal.fd, bytes(journal.end - journal_synced[0]), journal_synced[0])
    for name in ("entries.jsonl", "bodies.pack") if files else ():
        path = ledger.dir / name
        st = os.stat(path)
        size = synced.get(st.st_ino)
        if size is not None and size < st.st_size:
            os.truncate(path, size)


async def worker(ledger: Ledger, n: int) -> None:
    i = 0
    while True:
        body = {"worker": n, "i": i, "pad": "x" * (i % 50)} if i % 3 else None
        entry = await ledger.append(actor=f"w{n}", kind="step", body=body)
        os.write(1, f"{entry.seq} {entry.hash} {entry.body or '-'}\n".encode())
        i += 1


async def checkpoints(ledger: Ledger) -> None:
    while True:
        await asyncio.sleep(0.01)
        await ledger.checkpoint()


async def main(state: str, step: str, nth: int, mode: str) -> None:
    os.fsync = recording(os.fsync)  # type: ignore[assignment]
    ledger = await Ledger.open(state, checkpoint_interval=None)
    real_fdatasync = os.fdatasync

    def fdatasync(fd: int) -> None:
        real_fdatasync(fd)
        if fd == ledger._journal.fd:
            journal_synced[0] = ledger._journal.end

    os.fdatasync = fdatasync  # type: ignore[assignment]
    seen = 0

    def hook(name: str) -> None:
        nonlocal seen
        if name != step:
            return
        seen += 1
        if seen == nth:
            if mode in ("power", "torn"):
                power_cut(ledger, files=mode == "power")
            os._exit(9)

    ledger.step_hook = hook
    os.write(1, b"ready\n")
    await asyncio.gather(checkpoints(ledger), *(worker(ledger, n) for n in range(64)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
