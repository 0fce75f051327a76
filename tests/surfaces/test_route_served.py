"""`tally route TEXT` with a daemon serving its own roster (`tally serve --roster FILE`) routes
with that roster, the one its submit uses: it once routed with the packaged roster, naming
lanes the user's daemon does not have. Nothing is witnessed (no route tool call)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.interpreter import FAR_ROSTER as ROSTER
from tests.interpreter import ROOT
from tests.interpreter import tally_env as _env
from tests.interpreter import tally_run as _tally


def test_route_uses_the_running_daemons_roster(tmp_path: Path) -> None:
    roster = tmp_path / "roster.toml"
    roster.write_text(ROSTER.replace('keywords = ["x"]', 'keywords = ["zebrafish"]'))
    sock = tmp_path / "run" / "tally.sock"
    before = _tally(tmp_path, "route", "--json", "feed the zebrafish")
    assert before.returncode == 0, before.stderr
    assert json.loads(before.stdout)["lane"] != "general"  # no daemon: the packaged roster
    daemon = subprocess.Popen(
        [sys.executable, "-m", "surfaces", "serve", "--roster", str(roster)],
        env=_env(tmp_path),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while _tally(tmp_path, "status").returncode != 0:
            assert daemon.poll() is None, "the daemon exited"
            assert time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.2)
        size = json.loads(_tally(tmp_path, "status", "--json").stdout)["ledger"]["size"]
        routed = _tally(tmp_path, "route", "--json", "feed the zebrafish")
        assert routed.returncode == 0, routed.stderr
        assert json.loads(routed.stdout)["lane"] == "general"
        assert json.loads(routed.stdout)["decision"]["lane"] == "general"
        given = _tally(tmp_path, "route", "--json", "--roster", str(roster), "feed the zebrafish")
        assert json.loads(given.stdout)["lane"] == "general"
        assert json.loads(_tally(tmp_path, "status", "--json").stdout)["ledger"]["size"] == size
        assert sock.exists()
    finally:
        if daemon.poll() is None:
            daemon.terminate()
            daemon.wait(30)
