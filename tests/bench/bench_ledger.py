"""Ledger benchmark: durable appends beside two bare references, verify, open, RSS, proofs.

All numbers come from one run on one disk (a temp dir; set TALLY_BENCH_DIR to pick the disk).
Appends are medians of interleaved rounds so the references see the same disk weather.
forum-engine 1.17 (the `bench` extra) runs beside ours where it has an equivalent: durable
appends (its own file storage, fsync per append) and deep verify.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon.ledger import Ledger
from daemon.ledger.bulk import build
from daemon.ledger.merkle import verify_consistency, verify_inclusion

ROUNDS = 5
LINE = b'{"k":"' + b"x" * 290 + b'"}\n'  # ~300-byte records, as in the notes' measurements
APPENDS = {1: 200, 8: 2000, 64: 16000}
FORUM_APPENDS = {1: 200, 64: 640}  # its appends take turns: a few hundred say its rate


def plain_fsync_loop(base: Path, n: int = 200) -> float:
    """Reference (a): one write + one fsync per record."""
    path = base / "plain.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    t0 = time.perf_counter()
    for _ in range(n):
        os.write(fd, LINE)
        os.fsync(fd)
    rate = n / (time.perf_counter() - t0)
    os.close(fd)
    path.unlink()
    return rate


async def _one_at_a_time(
    queue: list[asyncio.Future[None] | None], cond: threading.Condition, n: int
) -> None:
    """A reference's writer: `n` records, each queued for the commit thread and awaited."""
    loop = asyncio.get_running_loop()
    for _ in range(n):
        future = loop.create_future()
        with cond:
            queue.append(future)
            cond.notify()
        await future


def _stop(thread: threading.Thread, queue: list[Any], cond: threading.Condition) -> None:
    """End a reference's commit thread: None in its queue is its last item."""
    with cond:
        queue.append(None)
        cond.notify()
    thread.join()


async def bare_one_hop(base: Path, n: int = 200) -> float:
    """Reference (a1): the floor of the one-hop design with one writer and no ledger work at
    all. Each record is handed to a thread that pwrites it to a preallocated file and
    fdatasyncs it (cheaper than (a)'s fsync of a growing file), then settles the caller's
    future with `call_soon_threadsafe`. The ratio (a1) / (a) is the most any one-writer
    append through a thread can reach on this machine."""
    path = base / "hop.wal"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, bytes(len(LINE) * n))
    os.fsync(fd)
    loop = asyncio.get_running_loop()
    queue: list[asyncio.Future[None] | None] = []
    cond = threading.Condition()

    def commit() -> None:
        offset = 0
        while True:
            with cond:
                while not queue:
                    cond.wait()
                future = queue.pop()
            if future is None:
                return
            os.pwrite(fd, LINE, offset)
            offset += len(LINE)
            os.fdatasync(fd)
            loop.call_soon_threadsafe(future.set_result, None)

    thread = threading.Thread(target=commit)
    thread.start()
    t0 = time.perf_counter()
    await _one_at_a_time(queue, cond, n)
    rate = n / (time.perf_counter() - t0)
    _stop(thread, queue, cond)
    os.close(fd)
    path.unlink()
    return rate


async def bare_group_commit(base: Path, writers: int = 64, total: int = 16000) -> float:
    """Reference (b): `writers` tasks each awaiting its own record, one thread taking every
    record queued while it was busy, one write + one fsync of one file per batch, the batch's
    futures settled with one `call_soon_threadsafe`: the floor of any durable asyncio group
    commit, with nothing of the ledger's (no encoding, hashing, tree, bodies)."""
    path = base / "group.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    loop = asyncio.get_running_loop()
    queue: list[asyncio.Future[None] | None] = []
    cond = threading.Condition()

    def settle(batch: list[asyncio.Future[None]]) -> None:
        for future in batch:
            future.set_result(None)

    def commit() -> None:
        while True:
            with cond:
                while not queue:
                    cond.wait()
                batch = queue[:]
                queue.clear()
            futures = [f for f in batch if f is not None]
            if futures:
                os.write(fd, LINE * len(futures))
                os.fsync(fd)
                loop.call_soon_threadsafe(settle, futures)
            if len(futures) < len(batch):
                return

    thread = threading.Thread(target=commit)
    thread.start()
    t0 = time.perf_counter()
    await asyncio.gather(*(_one_at_a_time(queue, cond, total // writers) for _ in range(writers)))
    rate = total // writers * writers / (time.perf_counter() - t0)
    _stop(thread, queue, cond)
    os.close(fd)
    path.unlink()
    return rate


def cpu_ceiling(base: Path, total: int = 16000) -> float:
    """64 concurrent appends with fsync and fdatasync stubbed out: the Python cost alone."""
    real = os.fsync, os.fdatasync
    os.fsync = os.fdatasync = lambda fd: None
    try:
        return asyncio.run(durable_appends(base, 64, total))
    finally:
        os.fsync, os.fdatasync = real


async def durable_appends(base: Path, concurrency: int, total: int) -> float:
    state = Path(tempfile.mkdtemp(dir=base))
    ledger = await Ledger.open(state, checkpoint_interval=None)
    per = total // concurrency

    async def appender(k: int) -> None:
        for i in range(per):
            await ledger.append(actor=f"a{k}", kind="bench", body={"i": i, "k": k, "t": "y" * 100})

    t0 = time.perf_counter()
    await asyncio.gather(*(appender(k) for k in range(concurrency)))
    rate = per * concurrency / (time.perf_counter() - t0)
    await ledger.close()
    shutil.rmtree(state)
    return rate


async def forum_appends(base: Path, concurrency: int, total: int) -> float | None:
    """forum-engine's durable appends with the same bodies: its `FileStorage` fsyncs every
    append (the payload file, then the entries file) on the calling thread, so its writers,
    async handlers as in its daemon, take turns on the loop. None without the `bench` extra."""
    try:
        from forum.ledger import Ledger as ForumLedger
        from forum.storage import FileStorage
    except ImportError:
        return None
    path = Path(tempfile.mkdtemp(dir=base))
    ledger = ForumLedger(FileStorage(str(path / "forum")))
    per = total // concurrency

    async def appender(k: int) -> None:
        for i in range(per):
            ledger.append(actor=f"a{k}", kind="bench", payload={"i": i, "k": k, "t": "y" * 100})
            await asyncio.sleep(0)  # a handler's turn ends, as between two requests

    t0 = time.perf_counter()
    await asyncio.gather(*(appender(k) for k in range(concurrency)))
    rate = per * concurrency / (time.perf_counter() - t0)
    shutil.rmtree(path)
    return rate


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def median_time(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def big_ledger(base: Path, n: int, full: bool) -> dict[str, float]:
    state = base / f"big-{n}"
    t0 = time.perf_counter()
    build(state, n)
    out = {"build_s": time.perf_counter() - t0}
    warm = await Ledger.open(state, checkpoint_interval=None)  # creates the key, checkpoints
    await warm.close()
    verify_times = []
    opens = []
    for _ in range(3 if full else 1):
        before = rss_bytes()
        t0 = time.perf_counter()
        ledger = await Ledger.open(state, checkpoint_interval=None)
        opens.append(time.perf_counter() - t0)
        out["rss_per_entry"] = (rss_bytes() - before) / n
        t0 = time.perf_counter()
        report = await ledger.verify()
        verify_times.append(time.perf_counter() - t0)
        assert report.ok, report
        out["rss_after_verify_per_entry"] = (rss_bytes() - before) / n
        if full:
            out.update(await proof_times(ledger, n))
        await ledger.close()
        if not full:
            break
    out["verify_eps"] = n / statistics.median(verify_times)
    out["open_s"] = statistics.median(opens)
    shutil.rmtree(state)
    return out


async def proof_times(ledger: Ledger, n: int) -> dict[str, float]:
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
    return {
        "inclusion_ms": statistics.median(inc) * 1e3,
        "consistency_ms": statistics.median(con) * 1e3,
    }


DEEP_N = 100_000
DEEP_ROUNDS = 9  # deep verify is the noisiest row: three CPU-bound parts on two cores
DEEP_TARGET = 400_000  # entries/s


def payload(seq: int) -> dict[str, str]:
    """The body of entry `seq` in the deep-verify ledgers (forum-engine's bench payload shape:
    about 80 bytes of canonical JSON, a distinct body per entry)."""
    return {"body": f"{seq:016d}:" + "x" * 47}


def sha256_files(paths: list[Path]) -> None:
    """Reference: read the files and SHA-256 their bytes, 4 MiB at a time."""
    for path in paths:
        digest = hashlib.sha256()
        with path.open("rb", buffering=0) as f:
            while block := f.read(1 << 22):
                digest.update(block)


FORUM_MISSING = "not installed (pip install -e '.[bench]')"


def forum_ledger(base: Path, n: int) -> Callable[[], bool] | None:
    """forum-engine's file ledger with the same payloads (its deep verify is `verify(deep=True)`
    over what `FileStorage` loaded); None when the `bench` extra is not installed."""
    try:
        from forum.ledger import Ledger as ForumLedger
        from forum.storage import FileStorage
    except ImportError:
        return None
    path = base / "forum"
    storage = FileStorage(str(path), fsync_each=False)
    ledger = ForumLedger(storage, clock=iter(range(1, n + 2)).__next__)
    for seq in range(n):
        ledger.append(actor="bench", kind="payload", payload=payload(seq))
    ledger.sync()
    # Loaded back from its files, as `forum ledger verify` does, before the timed verifies.
    loaded = ForumLedger(FileStorage(str(path), fsync_each=False))
    return lambda: bool(loaded.verify(deep=True))


async def deep_verify(base: Path) -> list[tuple[str, str, str, str]]:
    """Deep verify of DEEP_N entries (each with a body, and with none) beside forum-engine's and
    beside a SHA-256 of the same files, interleaved rounds."""
    with_bodies, bare = base / "deep-bodies", base / "deep-bare"
    build(with_bodies, DEEP_N, payload)
    build(bare, DEEP_N)
    forum = forum_ledger(base, DEEP_N)
    ledgers = [await Ledger.open(p, checkpoint_interval=None) for p in (with_bodies, bare)]
    files = [with_bodies / "ledger" / name for name in ("entries.jsonl", "bodies.pack")]
    times: dict[str, list[float]] = {"deep": [], "bare": [], "shallow": [], "ref": [], "forum": []}
    vs_forum, vs_ref = [], []
    for _ in range(DEEP_ROUNDS):
        for name, ledger, deep in (
            ("deep", ledgers[0], True),
            ("bare", ledgers[1], True),
            ("shallow", ledgers[0], False),
        ):
            t0 = time.perf_counter()
            report = await ledger.verify(deep=deep)
            times[name].append(time.perf_counter() - t0)
            assert report.ok, report
        t0 = time.perf_counter()
        sha256_files(files)
        times["ref"].append(time.perf_counter() - t0)
        vs_ref.append(times["ref"][-1] / times["deep"][-1])
        if forum is not None:
            t0 = time.perf_counter()
            assert forum()
            times["forum"].append(time.perf_counter() - t0)
            vs_forum.append(times["forum"][-1] / times["deep"][-1])
    for ledger in ledgers:
        await ledger.close()

    def rate(name: str) -> str:
        return f"{DEEP_N / statistics.median(times[name]):,.0f} entries/s"

    deep_eps = DEEP_N / statistics.median(times["deep"])
    vs_target = f"{deep_eps / DEEP_TARGET:.2f} × target"
    if forum is not None:
        vs_target += f", {statistics.median(vs_forum):.2f} × forum"
    rows = [
        (
            f"deep verify {DEEP_N // 1000}k, a body per entry",
            rate("deep"),
            vs_target,
            f"≥ {DEEP_TARGET:,}/s and ≥ 1.5 × forum",
        ),
        (f"deep verify {DEEP_N // 1000}k, no bodies", rate("bare"), "", ""),
        (f"verify {DEEP_N // 1000}k (chain + Merkle root), same ledger", rate("shallow"), "", ""),
        (
            "ref: SHA-256 of its entries.jsonl + bodies.pack",
            rate("ref"),
            f"deep = {statistics.median(vs_ref):.2f} × ref",
            "",
        ),
    ]
    if forum is None:
        rows.append(("forum-engine deep verify", FORUM_MISSING, "", ""))
    else:
        rows.append(
            (
                f"forum-engine 1.17 deep verify {DEEP_N // 1000}k (in memory, after load)",
                rate("forum"),
                f"tally = {statistics.median(vs_forum):.2f} × forum",
                "≥ 1.5 × forum",
            )
        )
    return rows


def main() -> None:
    base = Path(tempfile.mkdtemp(prefix="tally-bench-", dir=os.environ.get("TALLY_BENCH_DIR")))
    try:
        plain, hop, group, ceiling = [], [], [], []
        durable: dict[int, list[float]] = {c: [] for c in APPENDS}
        vs_ref: dict[int, list[float]] = {c: [] for c in APPENDS}
        forum: dict[int, list[float]] = {c: [] for c in FORUM_APPENDS}
        vs_forum: dict[int, list[float]] = {c: [] for c in FORUM_APPENDS}
        for _ in range(ROUNDS):
            plain.append(plain_fsync_loop(base))
            hop.append(asyncio.run(bare_one_hop(base)) / plain[-1])
            group.append(asyncio.run(bare_group_commit(base)))
            for c, total in APPENDS.items():
                durable[c].append(asyncio.run(durable_appends(base, c, total)))
                vs_ref[c].append(durable[c][-1] / (plain[-1] if c == 1 else group[-1]))
            for c, total in FORUM_APPENDS.items():
                rate = asyncio.run(forum_appends(base, c, total))
                if rate is not None:
                    forum[c].append(rate)
                    vs_forum[c].append(durable[c][-1] / rate)
            ceiling.append(cpu_ceiling(base))
        deep_rows = asyncio.run(deep_verify(base))
        small = asyncio.run(big_ledger(base, 100_000, full=False))
        large = asyncio.run(big_ledger(base, 1_000_000, full=True))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    g = statistics.median(group)
    p = statistics.median(plain)
    cpu = statistics.median(ceiling)
    rows = [
        ("ref (a): bare write + fsync per record, one file", f"{p:,.0f} appends/s", "", ""),
        (
            "ref (a1): one hop to a thread, pwrite + fdatasync, no ledger work (1 writer's floor)",
            "",
            f"{statistics.median(hop):.2f} × (a)",
            "",
        ),
        (
            "ref (b): bare group commit, one file, 64 writers",
            f"{g:,.0f} appends/s",
            "",
            "",
        ),
    ]
    targets = {1: "≥ 0.8 × (a)", 64: "≥ 10,000/s and ≥ 0.5 × (b)"}
    for c in APPENDS:
        d = statistics.median(durable[c])
        ref = "(a)" if c == 1 else "(b)"
        rows.append(
            (
                f"ledger.append, {c} concurrent",
                f"{d:,.0f} appends/s",
                f"{statistics.median(vs_ref[c]):.2f} × {ref}",
                targets.get(c, ""),
            )
        )
    for c in FORUM_APPENDS:
        if not forum[c]:
            rows.append((f"forum-engine append, {c} concurrent", FORUM_MISSING, "", ""))
            continue
        rows.append(
            (
                f"forum-engine 1.17 append, {c} concurrent (fsync per append, on the loop)",
                f"{statistics.median(forum[c]):,.0f} appends/s",
                f"tally = {statistics.median(vs_forum[c]):.2f} × forum",
                "",
            )
        )
    rows += [
        (
            "ledger.append, 64 concurrent, fsync stubbed (CPU only)",
            f"{cpu:,.0f} appends/s",
            f"{cpu / g:.2f} × (b)",
            "",
        ),
        (
            "verify 100k (chain + Merkle root)",
            f"{small['verify_eps']:,.0f} entries/s",
            "",
            "≥ 400,000/s",
        ),
        (
            "verify 1M (chain + Merkle root)",
            f"{large['verify_eps']:,.0f} entries/s",
            "",
            "≥ 400,000/s",
        ),
        *deep_rows,
        ("open (recovery) 1M", f"{large['open_s'] * 1e3:.1f} ms", "", "≤ 500 ms"),
        ("RSS growth held open, 1M", f"{large['rss_per_entry']:.2f} B/entry", "", "≤ 64 B"),
        (
            "RSS growth after a full verify, 1M",
            f"{large['rss_after_verify_per_entry']:.2f} B/entry",
            "",
            "",
        ),
        ("inclusion proof at 1M (median)", f"{large['inclusion_ms']:.3f} ms", "", "≤ 5 ms"),
        ("consistency proof at 1M (median)", f"{large['consistency_ms']:.3f} ms", "", "≤ 5 ms"),
        ("bulk build 1M (fixture, 1 fsync)", f"{large['build_s']:.1f} s", "", ""),
    ]
    print(
        f"medians of {ROUNDS} interleaved rounds (deep verify: {DEEP_ROUNDS}); "
        f"append counts {APPENDS}\n"
    )
    print("| measure | result | ratio | target |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("\n### the shared record (PostgreSQL)\n")
    postgres()


def postgres() -> None:
    """The shared record's rows alone: `python -m tests.bench.bench_ledger postgres`."""
    from tests.bench.shared_record import print_table, rows

    print_table(rows())


if __name__ == "__main__":
    import sys

    postgres() if sys.argv[1:] == ["postgres"] else main()
