"""A real full disk: `tally serve` with its state dir on a small tmpfs (bubblewrap mounts it in a
private mount namespace, so neither root nor a mount on the host is needed), filled from the
outside through `/proc/PID/root`, then freed. The daemon must degrade (503 + Retry-After,
`degraded` health, the metrics gauge, a mapped checkpoint error), resume with no restart, and
keep exactly what it acknowledged: checked after a graceful stop with `tally ledger verify`."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDictProxy

from daemon.ledger import Ledger
from tests.runs.model_server import roster_toml

ROOT = Path(__file__).resolve().parents[2]
DISK_BYTES = 4 << 20
TALLY = str(Path(sys.executable).with_name("tally"))


def bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        message = "bubblewrap is missing: `apt-get install -y bubblewrap` (make install does it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    """`tally serve` on a tmpfs in its own mount namespace; copies its state out when it stops."""

    def __init__(self, tmp_path: Path) -> None:
        self.disk = tmp_path / "disk"  # the tmpfs mount point (inside the namespace)
        self.out = tmp_path / "out"  # where the state is copied after a clean stop
        self.disk.mkdir()
        self.out.mkdir()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        roster = tmp_path / "roster.toml"
        roster.write_text(roster_toml("http://127.0.0.1:9/v1"))  # no model is ever leased
        state = self.disk / "state"
        serve = [
            TALLY, "serve",
            "--state", str(state),
            "--socket", str(tmp_path / "tally.sock"),
            "--tcp", f"127.0.0.1:{self.port}",
            "--roster", str(roster),
        ]  # fmt: skip
        # The shell outlives the daemon just long enough to copy the state out of the tmpfs.
        script = 'trap \'kill -TERM "$pid"\' TERM; "$@" & pid=$!; wait "$pid"; wait "$pid"; '
        script += f'cp -a "{state}" "{self.out}/"'
        read, write = os.pipe()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
        argv = [
            bwrap(), "--dev-bind", "/", "/",
            "--size", str(DISK_BYTES), "--tmpfs", str(self.disk),
            "--die-with-parent", "--info-fd", str(write),
            "--", "sh", "-c", script, "sh", *serve,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            pass_fds=(write,),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        os.close(write)
        with os.fdopen(read, "rb") as info:
            self.pid = int(json.loads(info.readline() + info.read(4096))["child-pid"])
        self.inside = Path(f"/proc/{self.pid}/root") / self.disk.relative_to("/")
        self.token = self._wait_for_token()

    def _wait_for_token(self) -> str:
        token = self.inside / "state" / "http.token"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.stderr()
            if token.exists() and token.read_text().strip():
                return token.read_text().strip()
            time.sleep(0.05)
        raise AssertionError(f"no token: {self.stderr()}")

    def stderr(self) -> str:
        if self.process.poll() is None:
            return "(running)"
        assert self.process.stderr is not None
        return self.process.stderr.read().decode(errors="replace")[-4000:]

    def fill(self) -> Path:
        """Write a file until the tmpfs is full; returns it."""
        filler = self.inside / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            chunk = bytes(65536)
            while chunk:
                try:
                    os.write(fd, chunk)
                except OSError as err:
                    if err.errno != errno.ENOSPC:
                        raise
                    chunk = chunk[: len(chunk) // 2]
        finally:
            os.close(fd)
        return filler

    def stop(self) -> None:
        children = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
        for child in children:
            os.kill(int(child), signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path)
    try:
        yield d
    finally:
        if d.process.poll() is None:
            d.process.kill()
            d.process.wait()


async def call(
    http: aiohttp.ClientSession, d: Daemon, tool: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any], CIMultiDictProxy[str]]:
    async with http.post(f"{d.url}/v1/tools/{tool}", json=body) as r:
        return r.status, await r.json(), r.headers


async def get(http: aiohttp.ClientSession, d: Daemon, path: str) -> tuple[int, str]:
    async with http.get(f"{d.url}{path}") as r:
        return r.status, await r.text()


async def wait_ready(http: aiohttp.ClientSession, d: Daemon) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if (await get(http, d, "/healthz"))[0] == 200:
                return
        except aiohttp.ClientConnectionError:
            pass
        assert d.process.poll() is None, d.stderr()
        await asyncio.sleep(0.05)
    raise AssertionError("the daemon did not answer")


@pytest.mark.slow
async def test_a_full_disk_degrades_then_appends_resume_without_a_restart(daemon: Daemon) -> None:
    d = daemon
    headers = {"Authorization": f"Bearer {d.token}"}
    acked: list[str] = []
    async with aiohttp.ClientSession(headers=headers) as http:
        await wait_ready(http, d)
        pad = "p" * 3000  # each `route` witnesses its text: pages fill fast
        for i in range(3):
            status, _, _ = await call(http, d, "route", {"text": f"before {i} {pad}"})
            assert status == 200
            acked.append(f"before {i} {pad}")
        filler = d.fill()
        # Partly filled pages still take a few appends; then the disk is really full.
        for i in range(2000):
            text = f"filling {i} {pad}"
            status, out, refused = await call(http, d, "route", {"text": text})
            if status != 200:
                break
            acked.append(text)
        else:
            raise AssertionError("the ledger never noticed the full disk")
        assert status == 503, out
        assert out["error"]["code"] == "ledger_unwritable"
        assert out["error"]["details"]["reason"] == "disk_full"
        assert int(refused["Retry-After"]) >= 1
        # Degraded everywhere, and still failing fast (the checkpoint too), not a 500.
        status, text = await get(http, d, "/healthz")
        health = json.loads(text)
        assert (status, health["status"]) == (200, "degraded"), health
        assert "No space left on device" in health["reason"]
        status, out, _ = await call(http, d, "health", {})
        assert (status, out["status"], out["ledger_writable"]) == (200, "degraded", False)
        assert "No space left on device" in out["reason"]
        _, metrics = await get(http, d, "/metrics")
        assert "\ntally_ledger_writable 0\n" in metrics
        status, out, refused = await call(http, d, "ledger_checkpoint", {"create": True})
        assert status == 503, out
        assert out["error"]["code"] == "ledger_unwritable"
        assert "Retry-After" in refused
        status, out, _ = await call(http, d, "route", {"text": "while full"})
        assert status == 503
        # Space comes back: appends resume with no restart.
        filler.unlink()
        deadline = time.monotonic() + 30
        while json.loads((await get(http, d, "/healthz"))[1])["status"] != "ok":
            assert time.monotonic() < deadline, "the ledger never recovered"
            await asyncio.sleep(0.05)
        for i in range(5):
            text = f"after {i} {pad}"
            status, out, _ = await call(http, d, "route", {"text": text})
            assert status == 200, out
            acked.append(text)
        _, metrics = await get(http, d, "/metrics")
        assert "\ntally_ledger_writable 1\n" in metrics
        status, out, _ = await call(http, d, "ledger_checkpoint", {"create": True})
        assert status == 200, out
        assert out["checkpoint"]["size"] >= len(acked)
    await asyncio.to_thread(d.stop)
    state = d.out / "state"
    assert (state / "ledger" / "entries.jsonl").exists(), d.stderr()
    # The record, after a graceful stop: exactly what was acknowledged, verified.
    verify = await asyncio.to_thread(
        subprocess.run,
        [TALLY, "ledger", "verify", "--deep", "--json", "--state", str(state)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("TALLY_")},
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert json.loads(verify.stdout)["ok"] is True
    ledger = await Ledger.open(state, readonly=True)
    try:
        routed = await ledger.entries(0, 100_000, kind="route.preview")
        texts = [(await ledger.body(e.body)).value["text"] for e in routed]
    finally:
        await ledger.close()
    assert texts == acked
