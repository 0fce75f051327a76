"""The writers the other tests reach only in subprocess daemons, run in process.

`client.add`, `client.revoke`, `redaction`, `policy.unsandboxed` and the slot kinds of a
failing or idle member are written by a `tally serve` the surface tests start as a child
process, where the session's watch (`tests/conftest.py`) cannot see them. Here a real
`Daemon` (real ledger, real pool; the fake model server is the only stand-in) writes each
through its real path: the tools over the real HTTP app, the start-up witness, and the pool's
events of real spawned servers that fail to start or sit idle. Each body read back from the
ledger must fit its kind's model byte for byte; the watch checks the writers too.

`tests/record/corpus.jsonl` holds these kinds' bodies from here:
`pytest -p tests.record.corpus --record-corpus=FILE tests/record/test_writers.py` (the
`redaction` entry is built inside the ledger, below the watch: its line is the stored body).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from daemon import record
from daemon.ledger.canonical import canonicalize
from daemon.service import Daemon
from daemon.slots import Pool, PoolBusy
from surfaces.http import HttpOptions, create_app
from tests.polling import until
from tests.runs.model_server import roster_toml, settings_for
from tests.slots.conftest import FAST, REPO, roster_of, spawned
from tests.slots.fake_server import FakeServer

TOKEN = "writers-token"
GAPS = (
    "client.add",
    "client.revoke",
    "redaction",
    "policy.unsandboxed",
    "slot.failed",
    "slot.cooldown",
    "slot.cooldown_ended",
    "slot.unloaded",
)


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    server = FakeServer(slots=2, n_ctx=4096)
    await server.start()
    roster = roster_toml(f"http://127.0.0.1:{server.port}/v1") + (
        '\n[policy.command]\nsandbox = "none"\n'  # witnessed at start: policy.unsandboxed
    )
    made = Daemon(settings_for(tmp_path, roster))
    await made.start()
    try:
        yield made
    finally:
        await made.stop()
        await server.stop()


async def _tool(client: TestClient[Any, Any], name: str, args: dict[str, Any]) -> Any:
    response = await client.post(f"/v1/tools/{name}", json=args)
    assert response.status == 200, await response.text()
    return await response.json()


async def test_the_writers_of_subprocess_daemons_write_their_kinds(
    daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(daemon, HttpOptions(token=TOKEN, keepalive_s=0.2))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with TestClient(TestServer(app), headers=headers) as client:
        await _tool(client, "client_add", {"name": "ci", "scope": "submit"})
        limits = {"rpm": 60, "tokens_per_day": 100000}
        await _tool(client, "client_add", {"name": "metered", "scope": "read", "limits": limits})
        await _tool(client, "client_revoke", {"name": "ci"})
        added = await daemon.ledger.entries(start=0, limit=10, kind="client.add")
        reason = "a token pasted into a ticket"
        await _tool(client, "ledger_redact", {"body_hash": added[0].body, "reason": reason})

    # The pool's events of real spawned servers, each through the daemon's own event hook
    # (what `Daemon.start` hands its pool): a member whose model file is missing fails and
    # cools down, its cooldown ends; an idle one is unloaded.
    monkeypatch.chdir(REPO)  # spawned fake servers run `python -m tests.slots.fake_server`
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    members = (
        spawned("missing", "--model", "{model}", model="/nonexistent/model.gguf"),
        spawned("idle", idle_unload_s=0.3),
    )
    pool = Pool(
        roster_of(*members), tmp_path / "pool", on_event=daemon._on_slot_event, options=FAST
    )
    try:
        with pytest.raises(PoolBusy):
            await pool.acquire("missing")
        async with pool.lease("idle") as held:
            await held.chat([{"role": "user", "content": "hi"}], max_tokens=1)

        async def kinds() -> set[str]:
            entries = await daemon.ledger.entries(start=0, limit=1000)
            return {e.kind for e in entries}

        async def written() -> bool:
            return set(GAPS) <= await kinds()

        await until(written, what="the slot kinds of a failing and an idle member")
    finally:
        await pool.stop()

    entries = await daemon.ledger.entries(start=0, limit=1000)
    found = {e.kind for e in entries}
    assert set(GAPS) <= found, sorted(set(GAPS) - found)
    bodies = await daemon.ledger.read_bodies([e.body for e in entries])
    for entry, (state, body) in zip(entries, bodies, strict=True):
        if entry.kind not in GAPS or state != "present":
            continue
        model = record.model_for(entry.kind)
        assert model is not None, entry.kind
        stored = canonicalize(body)
        assert canonicalize(model.read(body).written()) == stored, entry.kind
        assert entry.actor in model.ACTORS or record.CLIENT in model.ACTORS, entry.kind
    redaction = next(e for e in entries if e.kind == "redaction")
    ((_, said),) = await daemon.ledger.read_bodies([redaction.body])
    assert said == {"redacted": added[0].body, "reason": reason}
