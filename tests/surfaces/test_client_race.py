"""`tally client add` (a real process, editing the client file directly) racing the daemon's
own writes of it (the `client_add` tool, one thread per call, witnessed): no client is lost,
the file is never torn, and the daemon knows every token at the end."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from daemon.clients import OWNER, ClientFile
from daemon.service import Daemon
from daemon.tools import TOOLS
from daemon.tools.clients import ClientAddIn
from daemon.tools.tool import ToolContext

ROOT = Path(__file__).resolve().parents[2]
DAEMON_ADDS = 24
CLI_ADDS = 8


async def _cli_add(state: Path, name: str, nowhere: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "surfaces", "client", "add", name, "--scope", "read",
        "--state", str(state), "--socket", str(nowhere), "--json",
        env=env, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert b"not running" in err  # it took the offline path, beside the running daemon
    return str(json.loads(out)["token"])


async def test_cli_and_daemon_writes_of_the_client_file_lose_nothing(
    daemon: Daemon, tmp_path: Path
) -> None:
    state = daemon.settings.state_dir
    tool = TOOLS["client_add"]
    context = ToolContext(client=OWNER)

    async def daemon_add(i: int) -> str:
        out = await tool.handler(daemon, ClientAddIn(name=f"d{i}", scope="read"), context)
        return str(out.token)

    results = await asyncio.gather(
        *(daemon_add(i) for i in range(DAEMON_ADDS)),
        *(_cli_add(state, f"c{i}", tmp_path / "no.sock") for i in range(CLI_ADDS)),
    )
    data = ClientFile.model_validate_json((state / "clients.json").read_bytes())  # not torn
    names = sorted(r.name for r in data.clients)
    expected = sorted([f"d{i}" for i in range(DAEMON_ADDS)] + [f"c{i}" for i in range(CLI_ADDS)])
    assert names == expected
    for token in results:  # the daemon sees the CLI's clients too
        assert daemon.clients.lookup(token) is not None
    adds = await daemon.ledger.entries(kind="client.add", limit=100)
    assert len(adds) == DAEMON_ADDS  # the daemon's own are witnessed
