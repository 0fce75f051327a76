"""Each entry point loads only what it uses (start-up time; tests/bench/bench_start.py times it).

Each case runs in a fresh interpreter and reports which heavy packages it loaded: the MCP SDK
only in `tally mcp`, and nothing beyond argparse for `tally --help`.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.interpreter import run_fresh

HEAVY = ("mcp", "mcp_types", "aiohttp", "pydantic", "jsonschema", "cryptography", "anyio")

REPORT = f"""
import json, sys
print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r}))))
"""


def loaded(code: str, tmp_path: Path) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    """Run `code` then REPORT in a fresh interpreter: the heavy packages it left loaded."""
    done = run_fresh(code + REPORT, home=tmp_path)
    return json.loads(done.stdout.splitlines()[-1]), done


def test_help_loads_none_of_them(tmp_path: Path) -> None:
    code = """
import contextlib, io
from surfaces.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
    main(["--help"])
assert "serve" in out.getvalue() and "route" in out.getvalue()
"""
    assert loaded(code, tmp_path)[0] == []


def test_version_loads_none_of_them(tmp_path: Path) -> None:
    code = """
from surfaces.cli import main
assert main(["version"]) == 0
"""
    assert loaded(code, tmp_path)[0] == []


def test_route_loads_no_http_and_no_mcp(tmp_path: Path) -> None:
    code = """
from surfaces.cli import main
assert main(["route", "--json", "fix the slow sql query"]) == 0
"""
    heavy, done = loaded(code, tmp_path)
    assert heavy == ["pydantic"]  # the roster's models, nothing else
    assert json.loads(done.stdout.splitlines()[0])["lane"] == "database"


def test_serve_prints_the_ide_block_without_the_mcp_sdk(tmp_path: Path) -> None:
    """The real `tally serve` until it listens, then SIGTERM; the report comes from its process."""
    sock = tmp_path / "tally.sock"
    code = f"""
import os, signal, sys, threading, time
from surfaces.cli import main

def stop_when_listening():
    while not os.path.exists({str(sock)!r}):
        time.sleep(0.01)
    crypto = any(m.split(".")[0] == "cryptography" for m in list(sys.modules))
    sys.stderr.write(f"signature library when listening: {{crypto}}\\n")  # one write: whole
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=stop_when_listening, daemon=True).start()
assert main(["serve", "--state", {str(tmp_path / "state")!r}, "--socket", {str(sock)!r}]) == 0
print("tool registry loaded:", "daemon.tools" in sys.modules, file=sys.stderr)
"""
    heavy, done = loaded(code, tmp_path)
    assert '"mcpServers"' in done.stderr  # the IDE block was printed
    assert '"TALLY_SOCKET"' in done.stderr
    assert "mcp" not in heavy
    assert "mcp_types" not in heavy
    assert "jsonschema" not in heavy  # loaded with the first schema check, not at start
    assert "tool registry loaded: False" in done.stderr  # loaded by the first tool request
    # The checkpoint key loads after the start (warm-up, first checkpoint: here the last one).
    assert "signature library when listening: False" in done.stderr
    assert "cryptography" in heavy
    assert "aiohttp" in heavy  # the report is real: the daemon ran


@pytest.mark.parametrize("argv", [["plan", "-", "--any-lane"], ["roster", "check"]])
def test_offline_commands_load_no_http_and_no_mcp(argv: list[str], tmp_path: Path) -> None:
    code = f"""
import io, sys
sys.stdin = io.StringIO('{{"tasks": [{{"id": "T1", "lane": "x", "instruction": "y"}}]}}')
from surfaces.cli import main
assert main({argv!r}) == 0
"""
    heavy = loaded(code, tmp_path)[0]
    assert "aiohttp" not in heavy
    assert "mcp" not in heavy
