"""roster_reload reads only the configured roster or a file in a roster directory, bounded."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from daemon.errors import Forbidden, InvalidRoster, NotFound
from daemon.service import Daemon
from daemon.tools.roster import ReloadIn, roster_reload
from daemon.tools.tool import ToolContext
from roster.loading import MAX_ROSTER_BYTES
from tests.runs.model_server import ScriptedServer, roster_toml, settings_for


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    server = ScriptedServer([], default="done")
    await server.start()
    extra = tmp_path / "extra"
    extra.mkdir()
    made = Daemon(settings_for(tmp_path, roster_toml(server.url), roster_dirs=(extra,)))
    await made.start()
    yield made
    await made.stop()
    await server.stop()


async def reload(daemon: Daemon, path: Path | str) -> object:
    return await roster_reload(daemon, ReloadIn(path=str(path)), ToolContext())


@pytest.mark.parametrize("outside", ["/dev/zero", "/etc/passwd", "/proc/self/environ", "/nope/x"])
async def test_paths_outside_the_roster_dirs_are_refused_unread(
    daemon: Daemon, outside: str
) -> None:
    with pytest.raises(Forbidden) as refused:  # unread: reading /dev/zero would never end
        await asyncio.wait_for(reload(daemon, outside), 30)
    assert "root:" not in str(refused.value)  # no content, and no existence oracle either
    assert "no roster file" not in str(refused.value)


async def test_a_symlink_in_a_roster_dir_that_points_outside_is_refused(
    daemon: Daemon, tmp_path: Path
) -> None:
    link = tmp_path / "extra" / "evil.toml"
    link.symlink_to("/etc/passwd")
    with pytest.raises(Forbidden):
        await reload(daemon, link)


async def test_special_and_oversized_files_in_a_roster_dir_are_refused_bounded(
    daemon: Daemon, tmp_path: Path
) -> None:
    fifo = tmp_path / "extra" / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(InvalidRoster, match="not a regular file"):
        await asyncio.wait_for(reload(daemon, fifo), 2.0)  # a FIFO must not hang the reader
    big = tmp_path / "extra" / "big.toml"
    big.write_bytes(b"#" * (MAX_ROSTER_BYTES + 1))
    with pytest.raises(InvalidRoster, match="larger than"):
        await reload(daemon, big)
    with pytest.raises(NotFound):
        await reload(daemon, tmp_path / "extra" / "missing.toml")


async def test_a_roster_in_a_roster_dir_loads_and_its_own_errors_are_located(
    daemon: Daemon, tmp_path: Path
) -> None:
    good = tmp_path / "extra" / "good.toml"
    good.write_text((tmp_path / "roster.toml").read_text())
    out = await reload(daemon, good)
    assert getattr(out, "lanes", None) == 3
    bad = tmp_path / "extra" / "bad.toml"
    bad.write_text("version = 1\n[policy\n")
    with pytest.raises(InvalidRoster) as located:
        await reload(daemon, bad)
    [problem] = located.value.details["errors"]
    assert problem["file"] == str(bad)
    assert problem["line"] == 2
