"""The shared record's rows of `bench_ledger` (PostgreSQL), beside the file ledger in the same run.

Run alone (bounded, about a minute): `python -m tests.bench.bench_ledger postgres`.
A real server from `tests.ledger_pg.server` (temp dir, unix socket, fsync and
synchronous_commit on), on the same disk as the file ledger's temp dir.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from daemon.ledger import Ledger
from daemon.ledger.merkle import verify_consistency, verify_inclusion
from daemon.ledger.shared import SharedLedger

ROUNDS = 3
APPENDS = {1: 200, 64: 6400}
SHARED_EACH = 3200  # per daemon, two daemons
PROOF_N = 20_000
ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import asyncio, sys, time
from pathlib import Path
from daemon.ledger.shared import SharedLedger

async def main(dsn, state, per, start):
    ledger = await SharedLedger.open_shared(dsn, Path(state), checkpoint_interval=None)
    async def writer(k):
        for i in range(per // 64):
            await ledger.append(actor=f"a{k}", kind="bench", body={"i": i, "k": k, "t": "y" * 100})
    await asyncio.sleep(max(0.0, start - time.time()))
    await asyncio.gather(*(writer(k) for k in range(64)))
    print(time.time(), flush=True)
    await ledger.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
"""


async def _appends(open_ledger: object, concurrency: int, total: int) -> float:
    ledger = await open_ledger()  # type: ignore[operator]
    per = total // concurrency

    async def appender(k: int) -> None:
        for i in range(per):
            await ledger.append(actor=f"a{k}", kind="bench", body={"i": i, "k": k, "t": "y" * 100})

    t0 = time.perf_counter()
    await asyncio.gather(*(appender(k) for k in range(concurrency)))
    rate = per * concurrency / (time.perf_counter() - t0)
    await ledger.close()
    return rate


def _two_daemons(dsn: str, base: Path) -> float:
    start = time.time() + 4.0  # both have connected by then
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, dsn, str(base / name), str(SHARED_EACH), str(start)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for name in ("d1", "d2")
    ]
    ends = [float(p.communicate(timeout=120)[0].split()[-1]) for p in procs]
    return 2 * SHARED_EACH / (max(ends) - start)


async def _proofs(ledger: Ledger, n: int) -> tuple[float, float]:
    rng = random.Random(7)
    inc, con = [], []
    root = bytes.fromhex(ledger.root())
    for _ in range(200):
        seq = rng.randrange(n)
        t0 = time.perf_counter()
        proof = await ledger.inclusion_proof(seq)
        inc.append(time.perf_counter() - t0)
        path = [bytes.fromhex(p) for p in proof.path]
        assert verify_inclusion(seq, n, bytes.fromhex(ledger.leaf_hash(seq)), path, root)
        old = rng.randrange(1, n)
        t0 = time.perf_counter()
        cons = await ledger.consistency_proof(old)
        con.append(time.perf_counter() - t0)
        cpath = [bytes.fromhex(p) for p in cons.path]
        assert verify_consistency(old, n, bytes.fromhex(cons.old_root), root, cpath)
    return statistics.median(inc) * 1e3, statistics.median(con) * 1e3


async def _filled(ledger: Ledger, n: int) -> Ledger:
    async def appender(k: int) -> None:
        for i in range(n // 64):
            await ledger.append(actor=f"a{k}", kind="bench", body={"i": i, "k": k})

    await asyncio.gather(*(appender(k) for k in range(64)))
    return ledger


def rows() -> list[tuple[str, str, str, str]]:
    from tests.ledger_pg.server import Server, started

    server: Server | None = started()
    if server is None:
        return [("shared record (PostgreSQL)", "not measured: initdb not found", "", "")]
    base = Path(tempfile.mkdtemp(prefix="tally-bench-pg-", dir=os.environ.get("TALLY_BENCH_DIR")))
    names = iter(range(1000))
    try:
        file_rate: dict[int, list[float]] = {c: [] for c in APPENDS}
        pg_rate: dict[int, list[float]] = {c: [] for c in APPENDS}
        for _ in range(ROUNDS):  # interleaved: both see the same disk weather
            for c, total in APPENDS.items():
                state = Path(tempfile.mkdtemp(dir=base))

                async def file_ledger(state: Path = state) -> Ledger:
                    return await Ledger.open(state, checkpoint_interval=None)

                file_rate[c].append(asyncio.run(_appends(file_ledger, c, total)))
                shutil.rmtree(state)
                dsn = server.create(f"bench{next(names)}")
                pg_state = Path(tempfile.mkdtemp(dir=base))

                async def pg_ledger(dsn: str = dsn, state: Path = pg_state) -> SharedLedger:
                    return await SharedLedger.open_shared(dsn, state, checkpoint_interval=None)

                pg_rate[c].append(asyncio.run(_appends(pg_ledger, c, total)))
        shared = [_two_daemons(server.create(f"bench{next(names)}"), base) for _ in range(ROUNDS)]

        async def proofs() -> tuple[tuple[float, float], tuple[float, float]]:
            f = await _filled(await Ledger.open(base / "pf", checkpoint_interval=None), PROOF_N)
            dsn = server.create(f"bench{next(names)}")
            p = await _filled(
                await SharedLedger.open_shared(dsn, base / "pp", checkpoint_interval=None),
                PROOF_N,
            )
            try:
                return await _proofs(f, f.size), await _proofs(p, p.size)
            finally:
                await f.close()
                await p.close()

        (f_inc, f_con), (p_inc, p_con) = asyncio.run(proofs())
    finally:
        server.remove()
        shutil.rmtree(base, ignore_errors=True)
    out = []
    for c in APPENDS:
        f, p = statistics.median(file_rate[c]), statistics.median(pg_rate[c])
        out.append((f"file ledger append, {c} concurrent", f"{f:,.0f} appends/s", "", ""))
        out.append(
            (
                f"PostgreSQL ledger append, {c} concurrent (synchronous_commit on)",
                f"{p:,.0f} appends/s",
                f"{p / f:.2f} × file",
                "",
            )
        )
    out.append(
        (
            f"PostgreSQL, two daemons sharing one record, 64 writers each ({SHARED_EACH} each)",
            f"{statistics.median(shared):,.0f} appends/s (both)",
            "",
            "",
        )
    )
    out += [
        (f"file ledger inclusion proof at {PROOF_N:,} (median)", f"{f_inc:.3f} ms", "", ""),
        (f"PostgreSQL inclusion proof at {PROOF_N:,} (median)", f"{p_inc:.3f} ms", "", ""),
        (f"file ledger consistency proof at {PROOF_N:,} (median)", f"{f_con:.3f} ms", "", ""),
        (f"PostgreSQL consistency proof at {PROOF_N:,} (median)", f"{p_con:.3f} ms", "", ""),
    ]
    return out


def print_table(found: list[tuple[str, str, str, str]]) -> None:
    print(f"medians of {ROUNDS} interleaved rounds; append counts {APPENDS}\n")
    print("| measure | result | ratio | target |")
    print("|---|---|---|---|")
    for row in found:
        print("| " + " | ".join(row) + " |")
