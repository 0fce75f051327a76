"""The shared record's rows of `bench_ledger` (PostgreSQL), beside the file ledger in the same run.

Run alone (bounded, a few minutes: the open rows fill 100k entries):
`python -m tests.bench.bench_ledger postgres`.
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
OPEN_N = (20_000, 100_000)
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
        opens = {n: _open_times(server.create(f"bench{next(names)}"), base, n) for n in OPEN_N}
        quorum_s, verify_ms = asyncio.run(_cosigning(server.create(f"bench{next(names)}"), base))
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
    for n, (owner, reader) in opens.items():
        out.append((f"PostgreSQL open at {n:,}: a daemon (its state dir)", f"{owner:.1f} ms", "",
                    "O(log n) reads"))  # fmt: skip
        out.append((f"PostgreSQL open at {n:,}: a reader (verify, export)", f"{reader:.1f} ms",
                    "", ""))  # fmt: skip
    out += [
        (
            "PostgreSQL cosigning: quorum of 2 (two daemons cosign a third's checkpoint)",
            f"{quorum_s * 1e3:.1f} ms",
            "",
            "",
        ),
        ("cosigned checkpoint verification, quorum 2 (median)", f"{verify_ms:.3f} ms", "", ""),
    ]
    return out


def _open_times(dsn: str, base: Path, n: int) -> tuple[float, float]:
    """Medians of opening a record of `n` entries: a daemon on its own state dir again, and a
    reader (no state dir). Filled through the ledger (64 writers), in a child process so the
    opens below start cold like a daemon's."""
    state = base / f"open{n}"

    async def fill() -> int:
        ledger = await SharedLedger.open_shared(dsn, state, checkpoint_interval=None)
        await _filled(ledger, n)
        await ledger.close()
        return ledger.size

    size = asyncio.run(fill())

    async def opened(readonly: bool) -> float:
        t0 = time.perf_counter()
        ledger = await SharedLedger.open_shared(
            dsn, None if readonly else state, readonly=readonly, checkpoint_interval=None
        )
        took = time.perf_counter() - t0
        assert ledger.size == size
        await ledger.abandon()
        return took

    owner = statistics.median(asyncio.run(opened(False)) for _ in range(5))
    reader = statistics.median(asyncio.run(opened(True)) for _ in range(5))
    return owner * 1e3, reader * 1e3


async def _cosigning(dsn: str, base: Path) -> tuple[float, float]:
    """(seconds from a checkpoint to its quorum of 2 cosignatures stored in the record, the
    two cosigners in turn; median ms to verify the cosigned note with a quorum of 2)."""
    from daemon.cosigning import Cosigner
    from daemon.ledger.cosign import verify_quorum

    a, b, c = [
        await SharedLedger.open_shared(dsn, base / f"cosign-{n}", checkpoint_interval=None)
        for n in "abc"
    ]
    try:
        took = []
        for i in range(ROUNDS):
            await a.append(actor="bench", kind="bench", body={"i": i})
            await a.checkpoint()
            t0 = time.perf_counter()
            for cosigner in (Cosigner(b, same_record=True), Cosigner(c, same_record=True)):
                got = await cosigner.cosign_shared()
                assert [r.status for r in got if r.member == a.name] == ["cosigned"], got
            took.append(time.perf_counter() - t0)
        note = await a.own_cosigned()
        assert note is not None
        keys = {b.name: str(b.vkey), c.name: str(c.vkey)}
        checks = []
        for _ in range(200):
            t0 = time.perf_counter()
            report = verify_quorum(note, keys, 2, origin_vkey=a.vkey)
            checks.append(time.perf_counter() - t0)
            assert report.ok, report
        return statistics.median(took), statistics.median(checks) * 1e3
    finally:
        for ledger in (a, b, c):
            await ledger.close()


def print_table(found: list[tuple[str, str, str, str]]) -> None:
    print(f"medians of {ROUNDS} interleaved rounds; append counts {APPENDS}\n")
    print("| measure | result | ratio | target |")
    print("|---|---|---|---|")
    for row in found:
        print("| " + " | ".join(row) + " |")
