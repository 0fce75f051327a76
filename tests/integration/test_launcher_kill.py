"""Model servers never outlive the daemon: SIGKILL `tally serve` while its embedded model
server (the xllamacpp launcher) is starting, at 10 delays spread evenly over its first 1.1 s;
no launcher survives, and its port is free again. (It ran each of the same 10 delays twice:
the second pass proved nothing the first did not, for 25 s of the suite.)"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from daemon import layout
from daemon.slots.digest import DigestCache
from roster import resolve_model_path
from surfaces.client import DaemonClient, Endpoint
from tests.integration.embedded import MODEL
from tests.integration.processes import ROOT, TALLY, alive
from tests.polling import until_sync

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KILLS = 10


def _launchers(parent: int) -> dict[int, int]:
    """pid -> port of the launcher children of `parent`."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(stat[1]) == parent and b"daemon.slots.launcher" in argv:
            found[int(entry.name)] = int(argv[argv.index(b"--port") + 1])
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds it
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _gone(pid: int, port: int) -> bool:
    return not alive(pid) and _port_free(port)


def _kill_once(i: int, run: Path, base: dict[str, str], digests: Path) -> list[str]:
    """Start serve, make it start a model server, SIGKILL it `i`-dependent time into that
    start-up; the launchers that survived (killed here so the next round starts clean)."""
    env = base | {"TALLY_STATE_DIR": str(run / "state"), "TALLY_RUNTIME_DIR": str(run / "run")}
    sock = run / "run" / "tally.sock"
    run.mkdir(parents=True)
    # The model's sha256 is known already (the state dir's cache, keyed by path, size and
    # mtime): each round still checks it, without hashing 98 MB again before its launcher.
    (run / "state").mkdir(mode=0o700)
    shutil.copy(digests, run / "state" / layout.MODEL_DIGESTS)
    with (run / "serve.log").open("w") as log:
        serve = subprocess.Popen([str(TALLY), "serve"], env=env, cwd=ROOT, stdout=log, stderr=log)
    survivors: list[str] = []
    try:
        until_sync(sock.exists, 60, what=lambda: (run / "serve.log").read_text())
        # the pool is lazy: a submit makes it start the tiny model's server (asked over the
        # socket from here: a `tally submit` process per round only added its own start-up)
        asyncio.run(_submit(sock))
        launchers: dict[int, int] = {}
        until_sync(lambda: launchers.update(_launchers(serve.pid)) or launchers, 30)
        time.sleep(i * 1.1 / (KILLS - 1))  # 0 to 1.1 s into the model server's start-up
        serve.send_signal(signal.SIGKILL)
        serve.wait(10)
        for pid, port in launchers.items():
            try:
                until_sync(functools.partial(_gone, pid, port), 5)
            except AssertionError:
                survivors.append(f"kill {i}: launcher {pid} alive={alive(pid)} port {port}")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    return survivors


async def _submit(sock: Path) -> None:
    async with DaemonClient(Endpoint(socket_path=sock), timeout=60) as client:
        await client.call("submit", {"request": "say hi", "lane": "docs"})


@pytest.mark.skipif(not TALLY.exists(), reason="run `make install` for the tally command")
def test_sigkill_during_model_server_start_leaves_no_launcher(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    base.pop("NOTIFY_SOCKET", None)
    seed = tmp_path / "seed"
    DigestCache(seed).sha256(resolve_model_path(MODEL))
    digests = seed / layout.MODEL_DIGESTS
    survivors = [s for i in range(KILLS) for s in _kill_once(i, tmp_path / f"r{i}", base, digests)]
    assert survivors == []
