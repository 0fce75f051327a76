"""Run memory is bounded: old runs leave memory and are read back from the ledger, and the
snapshot holds no task results of a finished run."""

from __future__ import annotations

import json
from typing import Any

import pytest

from daemon.errors import NotFound
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
    await daemon.write_snapshot()
    data = json.loads((daemon.settings.state_dir / snapshots.FILE).read_bytes())
    (saved,) = [v for v in data["views"] if v["id"] == view.id]
    assert saved["summary"]  # a finished run is written as its summary: no task results
    assert all(task["result"] is None for task in saved["tasks"])
    loaded = snapshots.load(daemon.settings.state_dir, daemon.ledger)
    assert loaded is not None
    assert loaded.size == daemon.ledger.size


async def test_a_summary_is_read_back_from_its_request_on(
    fleet: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon, _ = await fleet(
        [("backend", "an answer", 0.0)], policy={"keep_runs": 1, "keep_summaries": 5}
    )
    await daemon.ledger.append(actor="t", kind="note", body={"before": "the runs"})
    first = await daemon.engine.wait((await daemon.engine.submit("backend api 0")).id, 20)
    second = await daemon.engine.wait((await daemon.engine.submit("backend api 1")).id, 20)
    assert daemon.engine.get(first.id).summary
    # a redaction after the run's request does not stop the read-back (nothing is continued)
    [answer] = await daemon.ledger.entries(start=0, limit=1, kind="run.request", run=second.id)
    await daemon.ledger.redact(answer.body or "", actor="t", reason="x")
    starts: list[int] = []
    real = daemon.ledger.entries

    async def spy(start: int = 0, *args: Any, **kwargs: Any) -> Any:
        starts.append(start)
        return await real(start, *args, **kwargs)

    monkeypatch.setattr(daemon.ledger, "entries", spy)
    back = await daemon.engine.find(first.id)
    assert back.model_dump() == first.model_dump()
    assert first.request_seq > 0
    assert min(starts) == first.request_seq  # no scan of what came before the run


async def test_an_unknown_run_is_not_found_and_a_malformed_id_is_not_scanned_for(
    fleet: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon, _ = await fleet([("backend", "an answer", 0.0)])
    with pytest.raises(NotFound):
        await daemon.engine.find("r" + "0" * 15)
    scans: list[Any] = []
    monkeypatch.setattr(daemon.ledger, "entries", lambda *a, **k: scans.append(a))
    for hostile in ("x" * 128, "r" + "0" * 15 + '"', "../r0"):
        with pytest.raises(NotFound):
            await daemon.engine.find(hostile)
    assert scans == []
