"""Child process for the step-kill test: 64 tasks append (and checkpoint, so catch-ups run)
until the writer reaches the `nth` time a commit or catch-up step completes, then it dies there.

Run as `python -m tests.ledger.step_child STATE_DIR STEP NTH MODE`. MODE "exit": `os._exit` at
the step (the page cache keeps every write, as after a process crash). MODE "power": first cut
every ledger file back to the size it had at its last successful fsync/fdatasync, as a power
loss at that instant may, then `os._exit`. MODE "torn": only the journal is cut back so (the
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
lock = threading.Lock()


def recording(real: object) -> object:
    def sync(fd: int) -> None:
        real(fd)  # type: ignore[operator]
        st = os.fstat(fd)
        with lock:
            synced[st.st_ino] = st.st_size

    return sync


def power_cut(directory: str, names: tuple[str, ...]) -> None:
    """Drop what never reached the disk: each named file back to its last synced size."""
    for name in names:
        path = os.path.join(directory, name)
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
    os.fdatasync = recording(os.fdatasync)  # type: ignore[assignment]
    ledger = await Ledger.open(state, checkpoint_interval=None)
    seen = 0

    def hook(name: str) -> None:
        nonlocal seen
        if name != step:
            return
        seen += 1
        if seen == nth:
            if mode == "power":
                power_cut(os.path.join(state, "ledger"), ("wal", "entries.jsonl", "bodies.pack"))
            elif mode == "torn":
                power_cut(os.path.join(state, "ledger"), ("wal",))
            os._exit(9)

    ledger.step_hook = hook
    os.write(1, b"ready\n")
    await asyncio.gather(checkpoints(ledger), *(worker(ledger, n) for n in range(64)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
