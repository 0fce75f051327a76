"""Restarts: the run-state snapshot (bounded start-up), resume edge cases, the wall clock."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from daemon.ledger import Ledger
from daemon.runs import entries as k
from daemon.runs import snapshot as snapshots
from daemon.runs.replay import replay
from daemon.service import Daemon
from tests.runs.conftest import Factory

DAG = {
    "tasks": [
        {"id": "api", "lane": "backend", "instruction": "Design the API."},
        {"id": "doc", "lane": "docs", "instruction": "Document it.", "needs": ["api"]},
    ]
}


async def run_some(daemon: Daemon, n: int) -> list[str]:
    ids = [(await daemon.engine.submit(f"backend api {i}", plan=DAG)).id for i in range(n)]
    for run_id in ids:
        assert (await daemon.engine.wait(run_id, timeout=20)).state == "done"
    return ids


async def restarted(daemon: Daemon) -> Daemon:
    again = Daemon(daemon.settings)
    await again.start()
    return again


async def test_start_from_the_snapshot_equals_a_full_replay(fleet: Factory) -> None:
    daemon, _ = await fleet([("Combine", "combined", 0.0)])
    ids = await run_some(daemon, 3)
    await daemon.stop()
    covered = json.loads((daemon.settings.state_dir / snapshots.FILE).read_text())["size"]
    # entries after the snapshot: a finished run's tail and a run left in flight (a crash)
    async with await Ledger.open(daemon.settings.state_dir) as ledger:
        assert ledger.size == covered
        seq = (
            await ledger.append(actor="engine", kind=k.REQUEST, body={"request": "x"}, run="rX")
        ).seq
        await ledger.append(
            actor="engine",
            kind=k.ROUTE,
            body={"lane": "backend", "confidence_ppm": 1, "escalate": False},
            run="rX",
            parent=seq,
        )
    again = await restarted(daemon)
    try:
        assert again.restored_from == covered
        assert again.interrupted_on_start == ["rX"]
        assert again.engine.get("rX").state == "interrupted"
        full = await replay(again.ledger)
        # a finished run comes back compacted (what replay reads on demand is left out) and
        # `detail` reads it back whole; a run in flight comes back whole
        for run_id in ids:
            assert again.engine.get(run_id).model_dump() == full[run_id].compacted().model_dump()
            whole = await again.engine.find(run_id)
            assert whole.model_dump() == full[run_id].model_dump()
        assert again.engine.get("rX").model_dump() == full["rX"].model_dump()
        kinds = [e.kind for e in await again.ledger.entries(start=0, limit=100, run="rX")]
        assert kinds == [k.REQUEST, k.ROUTE, k.INTERRUPTED]
    finally:
        await again.stop()


async def test_a_snapshot_that_does_not_match_the_ledger_is_ignored(fleet: Factory) -> None:
    daemon, _ = await fleet([("Combine", "combined", 0.0)])
    ids = await run_some(daemon, 2)
    await daemon.stop()
    path = daemon.settings.state_dir / snapshots.FILE
    stale = json.loads(path.read_text())
    stale["leaf"] = "00" * 32
    stale["views"] = []
    path.write_text(json.dumps(stale))
    again = await restarted(daemon)
    try:
        assert again.restored_from is None  # fell back to the full replay
        assert [again.engine.get(i).state for i in ids] == ["done", "done"]
    finally:
        await again.stop()
    path.write_text("{not json")
    third = await restarted(daemon)
    try:
        assert third.restored_from is None
        assert third.engine.get(ids[0]).state == "done"
    finally:
        await third.stop()


async def test_a_run_interrupted_before_planning_is_routed_again_witnessed(
    fleet: Factory,
) -> None:
    # two lanes' words: the router escalates to the classifier, whose call hangs
    daemon, server = await fleet(
        [("You route a request", '{"lane": "docs"}', 30.0)], policy={"classifier": "capable"}
    )
    view = await daemon.engine.submit("backend docs")
    for _ in range(500):
        if server.in_flight():
            break
        await asyncio.sleep(0.01)
    await daemon.stop()
    assert server.aborted == 1
    server.rules = [("You route a request", '{"lane": "docs"}', 0.0)]
    again = await restarted(daemon)
    try:
        assert again.engine.get(view.id).state == "interrupted"
        await again.engine.resume(view.id)
        done = await again.engine.wait(view.id, timeout=20)
        assert done.state == "done", done.error
        assert done.lane == "docs"
        entries = await again.ledger.entries(start=0, limit=1000, run=view.id)
        kinds = [e.kind for e in entries]
        resume = next(e for e in entries if e.kind == k.RESUME)
        body = (await again.ledger.body(resume.body)).value
        assert body["stage"] == "route"
        assert body["reused"] == []
        assert body["redo"] == []
        assert kinds.count(k.ROUTE) == 2  # routed again, witnessed
        assert kinds.index(k.RESUME) < len(kinds) - 1 - kinds[::-1].index(k.ROUTE)
    finally:
        await again.stop()


async def test_the_wall_clock_budget_carries_over_a_restart(fleet: Factory) -> None:
    daemon, server = await fleet([("Design the API", "never", 60.0)])
    view = await daemon.engine.submit("api", plan=DAG, budget={"wall_s": 2.0})
    await asyncio.sleep(1.0)
    await daemon.stop()  # drain 0.2 s, then interrupted: about 1.2 s of the 2 s spent
    interrupted = next(
        e for e in await daemon_entries(daemon, view.id) if e["kind"] == k.INTERRUPTED
    )
    spent = interrupted["body"]["spent_wall_ms"]
    assert 900 <= spent <= 1900
    await asyncio.sleep(0.5)  # time the daemon is down is not the run's
    again = await restarted(daemon)
    try:
        assert again.engine.get(view.id).spent.wall_ms == spent
        started = time.monotonic()
        await again.engine.resume(view.id)
        done = await again.engine.wait(view.id, timeout=20)
        took = time.monotonic() - started
        assert done.state == "budget_exhausted"
        assert took < 1.8, took  # only what was left of the 2 s, not a fresh 2 s
        stop = next(e for e in await daemon_entries(again, view.id) if e["kind"] == k.BUDGET)
        assert stop["body"]["limit"] == "wall"
        assert 1900 <= stop["body"]["spent"]["wall_ms"] <= 3000
        assert len(server.requests) == 2
    finally:
        await again.stop()


async def daemon_entries(daemon: Daemon, run_id: str) -> list[dict[str, Any]]:
    if daemon._ledger is None:  # stopped: read the files
        async with await Ledger.open(daemon.settings.state_dir, readonly=True) as ledger:
            return [
                {"kind": e.kind, "body": (await ledger.body(e.body)).value if e.body else None}
                for e in await ledger.entries(start=0, limit=10_000, run=run_id)
            ]
    return [
        {"kind": e.kind, "body": (await daemon.ledger.body(e.body)).value if e.body else None}
        for e in await daemon.ledger.entries(start=0, limit=10_000, run=run_id)
    ]


async def test_a_redaction_after_the_snapshot_means_a_full_replay(fleet: Factory) -> None:
    daemon, _ = await fleet([("Combine", "combined", 0.0)])
    [run_id] = await run_some(daemon, 1)
    await daemon.stop()
    async with await Ledger.open(daemon.settings.state_dir) as ledger:
        [request] = await ledger.entries(start=0, limit=1, kind=k.REQUEST, run=run_id)
        assert request.body is not None
        await ledger.redact(request.body, actor="test", reason="personal data")
    again = await restarted(daemon)
    try:
        assert again.restored_from is None  # the snapshot still held the redacted request
        full = await replay(again.ledger)
        assert again.engine.get(run_id).model_dump() == full[run_id].model_dump()
        assert again.engine.get(run_id).request == ""
    finally:
        await again.stop()


async def test_runs_found_in_flight_are_interrupted_in_one_group_commit(fleet: Factory) -> None:
    daemon, _ = await fleet([])
    await daemon.stop()
    names = ["rA", "rB", "rC"]
    async with await Ledger.open(daemon.settings.state_dir) as ledger:
        requests = {
            name: (
                await ledger.append(
                    actor="engine", kind=k.REQUEST, body={"request": name}, run=name
                )
            ).seq
            for name in names
        }
    again = await restarted(daemon)
    try:
        assert again.interrupted_on_start == names
        found = await again.ledger.entries(start=0, limit=100, kind=k.INTERRUPTED)
        assert [(e.run, e.parent) for e in found] == [(name, requests[name]) for name in names]
        assert [e.seq for e in found] == list(range(found[0].seq, found[0].seq + 3))
        # The file ledger stamps a batch with one time: appends made in turn would differ.
        assert len({e.ts for e in found}) == 1
        assert all(again.engine.get(name).state == "interrupted" for name in names)
    finally:
        await again.stop()
