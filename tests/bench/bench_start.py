"""Start-up benchmark: how long until each entry point is usable, beside bare references.

Every row is a fresh process, timed from spawn:
- references: `python -c pass` until it exits (the interpreter), and until a line printed after
  `import aiohttp` (the HTTP stack any aiohttp daemon loads) or after the MCP SDK's server
  modules (what any SDK adapter loads) arrives: the ready rows are timed to a line or an answer
  too, not to an exit;
- `tally --help` and `tally route TEXT` until the process exits (`route` routes offline with the
  packaged roster: it needs no daemon). Target ≤ 150 ms each;
- daemon ready: `tally serve` until its unix socket accepts and `GET /healthz` answers 200, on an
  empty state dir and on a 1M-entry ledger whose run snapshot is current (as after any clean
  stop). Target ≤ 350 ms. The 1M ledger is built once with `daemon.ledger.bulk` and cached in
  bench-out/start/ (keyed by the ledger code, so a format change rebuilds it). One more row, with
  no target: the same ledger without a run snapshot, i.e. the full replay a lost or stale
  snapshot costs;
- MCP adapter: `tally mcp` until a raw JSON-RPC `initialize` is answered on stdout (target
  ≤ 600 ms), and until the `tools/list` that follows is answered (no target: the tool registry
  loads then).

Rounds are interleaved (each round runs every row once, after one unmeasured warm-up round);
a row's time is its median, its ratio the median of its per-round ratios to its reference.
Children get this environment without TALLY_* and without PYTHONDONTWRITEBYTECODE, so modules
load from cached bytecode as after an install.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "bench-out" / "start"
ROUNDS = 7
BIG = 1_000_000
READY_TIMEOUT_S = 60.0
ROUTE_TEXT = "fix the slow sql query in the orders table"
SNAPSHOT = "runs.snapshot.json"  # daemon.runs.snapshot.FILE


def child_env() -> dict[str, str]:
    drop = {"PYTHONDONTWRITEBYTECODE"}
    return {k: v for k, v in os.environ.items() if not k.startswith("TALLY_") and k not in drop}


def tally() -> list[str]:
    script = Path(sys.executable).with_name("tally")
    return [str(script)] if script.exists() else [sys.executable, "-m", "surfaces"]


def line_time(code: str) -> float:
    """`python -c CODE; print()` until the line arrives (the exit is not waited for)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", f"{code}; print(flush=True)"],
        env=child_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    proc.stdout.readline()
    elapsed = time.perf_counter() - t0
    proc.wait()
    proc.stdout.close()
    return elapsed


def exit_time(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        argv, env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True
    )
    return time.perf_counter() - t0


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("tally", timeout=2.0)
        self._path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def healthy(path: Path) -> bool:
    connection = _UnixConnection(path)
    try:
        connection.request("GET", "/healthz")
        response = connection.getresponse()
        response.read()
        return response.status == 200
    except OSError:  # not listening yet (no socket file, refused, reset)
        return False
    finally:
        connection.close()


def ready_time(state: Path) -> float:
    """Spawn `tally serve` on `state`, time it to a 200 from /healthz, stop it cleanly."""
    run_dir = Path(tempfile.mkdtemp(prefix="tally-bench-start-"))
    sock = run_dir / "tally.sock"
    log = (run_dir / "serve.log").open("wb")
    argv = [*tally(), "serve", "--state", str(state), "--socket", str(sock)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, env=child_env(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        while not healthy(sock):
            if proc.poll() is not None or time.perf_counter() - t0 > READY_TIMEOUT_S:
                log.flush()
                tail = (run_dir / "serve.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"tally serve never became ready ({proc.returncode}):\n{tail}")
            time.sleep(0.002)
        elapsed = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return elapsed


def empty_ready() -> float:
    base = Path(tempfile.mkdtemp(prefix="tally-bench-state-"))
    try:
        return ready_time(base / "state")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def big_state(n: int = BIG) -> Path:
    """The cached n-entry state dir, built (and started once, to write its snapshot) if absent."""
    sources = sorted((ROOT / "daemon" / "ledger").glob("*.py"))
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]
    state = CACHE / f"ledger-{n}-{key}"
    done = state.with_name(state.name + ".built")
    if done.exists():
        return state
    for old in CACHE.glob(f"ledger-{n}-*"):
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    from daemon.ledger.bulk import build

    print(f"building a {n:,}-entry ledger in {state} (once) …", file=sys.stderr, flush=True)
    state.mkdir(parents=True)
    build(state, n)
    ready_time(state)  # the first start replays everything and writes the run snapshot
    done.touch()
    return state


def mcp_time(requests: list[dict[str, object]]) -> float:
    """Spawn `tally mcp`, send `requests`, time it until the last one is answered."""
    missing = Path(tempfile.gettempdir()) / "tally-bench-no-daemon.sock"
    argv = [*tally(), "mcp", "--socket", str(missing)]
    wanted = [r["id"] for r in requests if "id" in r]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        proc.stdin.write(b"".join(json.dumps(r).encode() + b"\n" for r in requests))
        proc.stdin.flush()
        while wanted:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"tally mcp closed stdout with {wanted} unanswered")
            answer = json.loads(line)
            if "error" in answer:
                raise RuntimeError(f"tally mcp answered an error: {answer}")
            if answer.get("id") in wanted:
                wanted.remove(answer["id"])
        elapsed = time.perf_counter() - t0
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()
    return elapsed


INITIALIZE: dict[str, object] = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "bench_start", "version": "0"},
    },
}
INITIALIZED: dict[str, object] = {"jsonrpc": "2.0", "method": "notifications/initialized"}
LIST_TOOLS: dict[str, object] = {"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}


@dataclass
class Row:
    name: str
    measure: Callable[[], float]
    reference: str | None = None  # the name of the row it is divided by
    target_ms: float | None = None
    times: list[float] = field(default_factory=list)


def rows(big: Path) -> list[Row]:
    py = sys.executable
    sdk = "import mcp.server, mcp.server.stdio"
    aiohttp_ref = "ref: `import aiohttp`, to a line"
    sdk_ref = "ref: `import mcp.server, mcp.server.stdio`, to a line"

    def stale_big() -> float:
        (big / SNAPSHOT).unlink(missing_ok=True)
        return ready_time(big)

    return [
        Row("ref: `python -c pass`", lambda: exit_time([py, "-c", "pass"])),
        Row(aiohttp_ref, lambda: line_time("import aiohttp")),
        Row(sdk_ref, lambda: line_time(sdk)),
        Row(
            "`tally --help`",
            lambda: exit_time([*tally(), "--help"]),
            "ref: `python -c pass`",
            150,
        ),
        Row(
            "`tally route TEXT` (offline, packaged roster)",
            lambda: exit_time([*tally(), "route", ROUTE_TEXT]),
            "ref: `python -c pass`",
            150,
        ),
        Row(
            "daemon ready, empty state",
            empty_ready,
            aiohttp_ref,
            350,
        ),
        Row(
            f"daemon ready, {BIG:,} entries, no run snapshot (full replay)",
            stale_big,
            aiohttp_ref,
        ),
        Row(
            f"daemon ready, {BIG:,} entries",
            lambda: ready_time(big),
            aiohttp_ref,
            350,
        ),
        Row(
            "MCP adapter: `initialize` answered",
            lambda: mcp_time([INITIALIZE]),
            sdk_ref,
            600,
        ),
        Row(
            "MCP adapter: `initialize`, then `tools/list` answered",
            lambda: mcp_time([INITIALIZE, INITIALIZED, LIST_TOOLS]),
            sdk_ref,
        ),
    ]


def main() -> None:
    table = rows(big_state())
    by_name = {row.name: row for row in table}
    for row in table:  # warm-up: bytecode caches, page cache, the snapshot of the big ledger
        row.measure()
    for _ in range(ROUNDS):
        for row in table:
            row.times.append(row.measure())
    print(f"{ROUNDS} interleaved rounds; python {sys.version.split()[0]}; ms = median wall time")
    print()
    print("| measure | ms | ratio | target | met |")
    print("|---|---|---|---|---|")
    for row in table:
        ms = statistics.median(row.times) * 1000
        ratio = ""
        if row.reference is not None:
            ref = by_name[row.reference]
            per_round = [t / r for t, r in zip(row.times, ref.times, strict=True)]
            ratio = f"{statistics.median(per_round):.2f} × {row.reference.removeprefix('ref: ')}"
        target = "" if row.target_ms is None else f"≤ {row.target_ms:.0f} ms"
        met = "" if row.target_ms is None else ("yes" if ms <= row.target_ms else "NO")
        print(f"| {row.name} | {ms:.0f} | {ratio} | {target} | {met} |")


if __name__ == "__main__":
    main()
