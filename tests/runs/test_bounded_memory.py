"""Run memory is bounded: old runs leave memory and are read back from the ledger, and the
snapshot holds no task results of a finished run."""

from __future__ import annotations

import json

from daemon.runs import snapshot as snapshots
from tests.runs.conftest import Factory


async def test_old_runs_leave_memory_and_are_read_back(fleet: Factory) -> None:
    daemon, _ = await fleet(
        [("backend", "an answer", 0.0)], policy={"keep_runs": 1, "keep_summaries": 1}
    )
    runs = []
    for i in range(4):
        view = await daemon.engine.submit(f"backend api {i}")
        runs.append(await daemon.engine.wait(view.id, timeout=20))
    # newest first: the last run in full, the one before as its summary, older ones gone
    assert [v.id for v in daemon.engine.list(limit=100)] == [runs[3].id, runs[2].id]
    summary = daemon.engine.get(runs[2].id)
    assert summary.summary
    assert [t.result for t in summary.tasks] == [None]
    assert (await daemon.engine.find(runs[2].id)).model_dump() == runs[2].model_dump()
    back = await daemon.engine.find(runs[0].id)
    assert back.state == "done"
    assert back.answer == runs[0].answer
    assert [t.result for t in back.tasks] == [t.result for t in runs[0].tasks]
    events = [e async for e in daemon.engine.events(runs[0].id)]
    assert events[0].kind == "run.request"
    assert daemon.engine.census.runs["done"] == 4  # the census still counts every run


async def test_the_snapshot_holds_no_task_results(fleet: Factory) -> None:
    daemon, _ = await fleet([("backend", "an answer", 0.0)])
    view = await daemon.engine.submit("backend api")
    done = await daemon.engine.wait(view.id, timeout=20)
    assert any(t.result for t in done.tasks)
    assert await daemon.write_snapshot()
    data = json.loads((daemon.settings.state_dir / snapshots.FILE).read_bytes())
    (saved,) = [v for v in data["views"] if v["id"] == view.id]
    assert saved["summary"]  # a finished run is written as its summary: no task results
    assert all(task["result"] is None for task in saved["tasks"])
    loaded = snapshots.load(daemon.settings.state_dir, daemon.ledger)
    assert loaded is not None
    assert loaded.size == daemon.ledger.size
