"""The Daemon over the real ledger and slot pool, against a scripted model server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from daemon.config import Settings
from daemon.runs import entries as k
from daemon.service import Daemon
from tests.runs.model_server import ScriptedServer, roster_toml, settings_for

CHAIN = {
    "tasks": [
        {"id": "api", "lane": "backend", "instruction": "Design the API."},
        {"id": "doc", "lane": "docs", "instruction": "Document it.", "needs": ["api"]},
        {"id": "test", "lane": "testing", "instruction": "Test it.", "needs": ["doc"]},
    ]
}
ROOT = Path(__file__).resolve().parents[2]


def settings(tmp_path: Path, url: str) -> Settings:
    return settings_for(tmp_path, roster_toml(url), drain_s=0.5)


async def kinds_of(daemon: Daemon, run_id: str) -> list[str]:
    return [e.kind for e in await daemon.ledger.entries(start=0, limit=10_000, run=run_id)]


async def test_daemon_runs_a_dag_through_the_pool(tmp_path: Path) -> None:
    server = ScriptedServer(
        [("Combine", "the final answer", 0.0), ("Design", "GET /items", 0.0)], default="done"
    )
    await server.start()
    daemon = Daemon(settings(tmp_path, server.url))
    await daemon.start()
    try:
        view = await daemon.engine.submit("build the backend", plan=CHAIN)
        view = await daemon.engine.wait(view.id, timeout=20)
        assert view.state == "done", view.error
        assert view.answer is not None
        assert "final answer" in view.answer
        calls = [
            (await daemon.ledger.body(e.body)).value
            for e in await daemon.ledger.entries(limit=10_000, kind=k.MODEL_CALL, run=view.id)
        ]
        assert len(calls) == 4
        assert all(isinstance(c["slot"], int) for c in calls)
        chain = [e.kind for e in await daemon.ledger.causal_chain(view.answer_seq or 0)]
        assert chain[:3] == [k.REQUEST, k.ROUTE, k.PLAN]
        assert chain[-1] == k.ANSWER
        assert (await daemon.ledger.verify()).ok
    finally:
        await daemon.stop()
        await server.stop()


async def test_a_bad_roster_reload_keeps_the_last_good_one(tmp_path: Path) -> None:
    server = ScriptedServer([])
    await server.start()
    daemon = Daemon(settings(tmp_path, server.url))
    await daemon.start()
    try:
        bad = tmp_path / "bad.toml"
        bad.write_text("version = 1\n[policy]\nmax_parallel = 'x'\n")
        before = daemon.roster
        with pytest.raises(Exception, match="max_parallel"):
            await daemon.reload_roster(bad)
        assert daemon.roster is before
    finally:
        await daemon.stop()
        await server.stop()


CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from daemon.config import Settings
    from daemon.service import Daemon

    async def main() -> None:
        s = Settings.from_env(state_dir=Path(sys.argv[1]), runtime_dir=Path(sys.argv[2]),
                              roster_path=Path(sys.argv[3]), checkpoint_interval_s=3600)
        daemon = Daemon(s)
        await daemon.start()
        view = await daemon.engine.submit("build the backend", plan=json.loads(sys.argv[4]))
        await daemon.write_snapshot()  # the restart replays only what came after it
        print(view.id, flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)


@pytest.mark.slow
async def test_sigkill_mid_run_then_interrupted_and_resumed(tmp_path: Path) -> None:
    server = ScriptedServer(
        [("Combine", "combined answer", 0.0), ("Test it", "tests pass", 60.0)], default="done"
    )
    await server.start()
    s = settings(tmp_path, server.url)
    assert s.roster_path is not None
    child = subprocess.Popen(  # noqa: ASYNC220 - killed with SIGKILL on purpose
        [
            sys.executable,
            "-c",
            CHILD,
            str(s.state_dir),
            str(s.runtime_dir),
            str(s.roster_path),
            json.dumps(CHAIN),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
        run_id = line.decode().strip()
        for _ in range(300):  # until the third task's model request is in flight
            if any("Test it" in json.dumps(r["messages"]) for r in server.requests):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the third task never reached the model server")
        before = len(server.requests)
        os.kill(child.pid, signal.SIGKILL)
        await asyncio.to_thread(child.wait)
    finally:
        if child.poll() is None:
            child.kill()

    server.rules = [("Combine", "combined answer", 0.0), ("Test it", "tests pass", 0.0)]
    daemon = Daemon(s)
    await daemon.start()
    try:
        assert daemon.restored_from is not None
        assert daemon.restored_from > 0
        assert run_id in daemon.interrupted_on_start
        view = daemon.engine.get(run_id)
        assert view.state == "interrupted"
        assert k.INTERRUPTED in await kinds_of(daemon, run_id)
        await daemon.engine.resume(run_id)
        view = await daemon.engine.wait(run_id, timeout=20)
        assert view.state == "done", view.error
        # only the task not yet done, and the synthesis, went to a model
        assert len(server.requests) - before == 2
        assert view.answer is not None
        assert "combined answer" in view.answer
        assert (await daemon.ledger.verify()).ok
    finally:
        await daemon.stop()
        await server.stop()
