"""Child process for the crash test: 64 tasks append forever, writing each acknowledged entry.

Run as `python -m tests.ledger.crash_child`, a zygote: it imports the ledger once, then for
each line `STATE_DIR<TAB>ACKS_FILE` on its stdin forks a child that opens the ledger, writes
`ready` and then one `SEQ HASH` line per acknowledged entry to ACKS_FILE, until the parent
SIGKILLs it at random. The zygote prints the child's pid, and `exited` once it has reaped it.
(A fresh interpreter per round spent ~0.3 s, and ~2 s on a loaded machine, importing; a fork
starts the same code on the same imports in milliseconds, so the rounds are all crash.)

ACKS_FILE is a regular file opened O_APPEND: each line is one write(2), and a write that
returned is in the file when the writer is killed, as it would be in a pipe.
"""

from __future__ import annotations

import asyncio
import os
import sys

from daemon.ledger import Ledger


async def worker(ledger: Ledger, n: int) -> None:
    i = 0
    while True:
        body = {"worker": n, "i": i, "pad": "x" * (i % 200)} if i % 3 else None
        entry = await ledger.append(actor=f"w{n}", kind="crash", body=body, run=f"r{n % 4}")
        # One write per line: the parent must never see a partial acknowledgement.
        os.write(1, f"{entry.seq} {entry.hash}\n".encode())
        i += 1


async def main(state: str) -> None:
    ledger = await Ledger.open(state, checkpoint_interval=0.05)
    os.write(1, b"ready\n")
    await asyncio.gather(*(worker(ledger, n) for n in range(64)))


def zygote() -> None:
    for line in sys.stdin:
        state, acks = line.rstrip("\n").split("\t")
        pid = os.fork()
        if pid == 0:
            try:
                fd = os.open(acks, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
                os.dup2(fd, 1)
                asyncio.run(main(state))
            finally:
                os._exit(1)  # never back into the zygote's loop
        print(pid, flush=True)
        os.waitpid(pid, 0)
        print("exited", flush=True)


if __name__ == "__main__":
    zygote()
