"""`tally compare`, `tally replay --at`, `tally ledger summary` as real processes against a real
daemon over its socket (the fake model server is the only stand-in)."""

from __future__ import annotations

import asyncio
import json
import sys

from daemon.runs import entries as k
from tests.console.conftest import ROOT, Served
from tests.slots.fake_server import FakeServer
from tests.surfaces.conftest import two_tasks


async def _tally(served: Served, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "surfaces",
        *args,
        "--socket",
        str(served.socket),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def _two_runs(served: Served) -> tuple[str, str]:
    engine = served.daemon.engine
    a = await engine.submit("the api", plan=two_tasks())
    one = {"tasks": [{"id": "T1", "lane": "backend", "instruction": "the api, at once"}]}
    b = await engine.submit("the api", plan=one)
    for run in (a, b):
        assert (await engine.wait(run.id, timeout=30)).state == "done"
    return a.id, b.id


async def test_compare_prints_a_table_and_json(served: Served) -> None:
    a, b = await _two_runs(served)
    code, out, err = await _tally(served, "compare", a, b)
    assert code == 0, err
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    assert a in out.splitlines()[0]
    assert b in out.splitlines()[0]
    assert rows["tasks"].split()[1:] == ["2", "1"]
    code, out, _ = await _tally(served, "compare", a, b, "--json")
    body = json.loads(out)
    assert body["a"]["tasks"] == 2
    assert body["b"]["tasks"] == 1
    # two task calls + a synthesis call against one task (its answer is the task's output)
    assert body["a"]["model_calls"] > body["b"]["model_calls"] >= 1
    assert body["a"]["verdicts_ok"] == 2
    assert body["b"]["verdicts_failed"] == 0
    code, out, err = await _tally(served, "compare", a, "no-such-run")
    assert code == 1
    assert "not_found" in err
    assert "Traceback" not in err


async def test_replay_at_a_seq_shows_the_run_as_it_stood(served: Served, model: FakeServer) -> None:
    a, b = await _two_runs(served)
    ledger = served.daemon.ledger
    plan = (await ledger.entries(run=a, kind=k.PLAN, limit=1))[0]
    first_verdict = (await ledger.entries(run=a, kind=k.TASK_VERDICT, limit=1))[0]
    calls = len(model.requests)
    code, out, err = await _tally(served, "replay", a, "--at", str(plan.seq), "--json")
    assert code == 0, err
    then = json.loads(out)
    assert then["state"] == "running"
    assert [t["state"] for t in then["tasks"]] == ["pending", "pending"]
    assert then["answer"] is None
    code, out, _ = await _tally(served, "replay", a, "--at", str(first_verdict.seq), "--json")
    assert [t["state"] for t in json.loads(out)["tasks"]] == ["done", "pending"]
    code, out, _ = await _tally(served, "replay", a)
    assert code == 0
    assert out.startswith(f"{a} done")
    assert "answer: " in out
    request = (await ledger.entries(run=a, kind=k.REQUEST, limit=1))[0]
    code, _, err = await _tally(served, "replay", b, "--at", str(request.seq))
    assert code == 1  # the run did not exist yet
    assert "not_found" in err
    assert len(model.requests) == calls  # replay asked no model


async def test_ledger_summary_through_the_daemon(served: Served) -> None:
    a, _ = await _two_runs(served)
    code, out, err = await _tally(served, "ledger", "summary", "--run", a, "--json")
    assert code == 0, err
    body = json.loads(out)
    assert body["run"] == a
    assert body["by_kind"][k.TASK_VERDICT] == 2
    code, out, _ = await _tally(served, "ledger", "summary", "--client", "owner")
    assert code == 0
    assert "client owner: 2 runs" in out
