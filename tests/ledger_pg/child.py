"""A daemon's ledger in its own process, for the shared-record tests: 64 tasks append, and each
acknowledged entry is printed as `seq hash` (one write per line) once its commit returned.

`python -m tests.ledger_pg.child DSN STATE_DIR COUNT [gated]`: each task appends COUNT entries,
then the ledger closes (0 = append until killed). `gated`: the ledger opens only once a line
arrives on stdin (so the parent can start the next victim's interpreter early).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from daemon.ledger.shared import SharedLedger

WRITERS = 64


async def worker(ledger: SharedLedger, n: int, count: int) -> None:
    i = 0
    while count == 0 or i < count:
        body = {"writer": n, "i": i, "pad": "x" * (i % 50)} if i % 3 else None
        entry = await ledger.append(actor=f"w{n}", kind="load", body=body, run=f"r{n % 4}")
        os.write(1, f"{entry.seq} {entry.hash}\n".encode())
        i += 1


async def main(dsn: str, state: str, count: int, gated: bool) -> None:
    if gated:
        await asyncio.to_thread(sys.stdin.readline)
    ledger = await SharedLedger.open_shared(dsn, Path(state), checkpoint_interval=0.2)
    os.write(1, f"ready {ledger.name}\n".encode())
    await asyncio.gather(*(worker(ledger, n, count) for n in range(WRITERS)))
    await ledger.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:] == ["gated"]))
