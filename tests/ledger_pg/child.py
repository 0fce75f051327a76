"""A daemon's ledger in its own process, for the shared-record tests: 64 tasks append, and each
acknowledged entry is printed as `seq hash` (one write per line) once its commit returned.

`python -m tests.ledger_pg.child DSN STATE_DIR COUNT [gated] [halves]`: each task appends COUNT
entries, then the ledger closes (0 = append until killed). `gated`: the ledger opens only once a
line arrives on stdin (so the parent can start the next victim's interpreter early). `halves`:
once every task has appended half its entries the child prints `half NAME` and waits for a line
on stdin before the second halves, so two children's appends interleave however they are
scheduled (each half of the record holds both children's entries).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from daemon.ledger.shared import SharedLedger

WRITERS = 64


async def worker(
    ledger: SharedLedger, n: int, count: int, halfway: asyncio.Barrier | None, go: asyncio.Event
) -> None:
    i = 0
    while count == 0 or i < count:
        if halfway is not None and i == count // 2:
            await halfway.wait()
            await go.wait()
        body = {"writer": n, "i": i, "pad": "x" * (i % 50)} if i % 3 else None
        entry = await ledger.append(actor=f"w{n}", kind="load", body=body, run=f"r{n % 4}")
        os.write(1, f"{entry.seq} {entry.hash}\n".encode())
        i += 1


async def main(dsn: str, state: str, count: int, gated: bool, halves: bool) -> None:
    if gated:
        await asyncio.to_thread(sys.stdin.readline)
    ledger = await SharedLedger.open_shared(dsn, Path(state), checkpoint_interval=0.2)
    os.write(1, f"ready {ledger.name}\n".encode())
    go = asyncio.Event()
    halfway = asyncio.Barrier(WRITERS + 1) if halves else None

    async def release() -> None:
        assert halfway is not None
        await halfway.wait()
        os.write(1, f"half {ledger.name}\n".encode())
        await asyncio.to_thread(sys.stdin.readline)
        go.set()

    waits = [release()] if halves else []
    await asyncio.gather(*waits, *(worker(ledger, n, count, halfway, go) for n in range(WRITERS)))
    await ledger.close()


if __name__ == "__main__":
    flags = sys.argv[4:]
    dsn, state, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    asyncio.run(main(dsn, state, count, "gated" in flags, "halves" in flags))
