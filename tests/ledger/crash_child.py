"""Child process for the crash test: 64 tasks append forever, printing each acknowledged entry.

Run as `python -m tests.ledger.crash_child STATE_DIR`; the parent SIGKILLs it at random.
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


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
