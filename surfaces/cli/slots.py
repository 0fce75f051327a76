"""`tally slots [--json]`: the running daemon's pool status (`slots_status`).

`tally slots --roster FILE` instead starts that roster's pool in-process, waits until every
member is ready (or found down: an external server that is not there says so at once), prints
the status and each member's problem, and stops: a smoke check of a roster without a daemon.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.errors import TallyError

if TYPE_CHECKING:
    from daemon.slots import PoolStatus
    from roster import Roster


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser("slots", help="show the daemon's model pool (slots, queues)")
    parser.add_argument(
        "--roster",
        type=Path,
        default=None,
        help="smoke-check this roster's pool in-process instead of asking the daemon",
    )
    parser.add_argument("--socket", type=Path, help="daemon socket (default: $TALLY_SOCKET)")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for ready")
    parser.add_argument("--state-dir", type=Path, default=None, help="logs go here (temp dir)")
    parser.set_defaults(run=run)


def _load(path: Path) -> Roster:
    """Through `load_roster`, so TOML and model errors are located as `file:line:col field: …`."""
    from roster import load_roster

    return load_roster(path)


async def _check(
    roster: Roster, state_dir: Path, timeout_s: float, base: Path
) -> tuple[PoolStatus, dict[str, str]]:
    """Lease every member at once; the status, and why each member that failed did."""
    import asyncio

    from daemon.slots import Pool, PoolOptions

    pool = Pool(roster, state_dir, options=PoolOptions(roster_dir=base))
    await pool.start()
    deadline = time.monotonic() + timeout_s

    async def one(name: str) -> str | None:
        try:
            async with pool.lease(name, deadline=deadline):
                return None
        except TallyError as err:
            return err.message

    try:
        names = [m.name for m in roster.models]
        found = await asyncio.gather(*(one(name) for name in names))
        return pool.status(), {n: why for n, why in zip(names, found, strict=True) if why}
    finally:
        await pool.stop()


def _table(status: PoolStatus) -> str:
    lines = [
        f"{'MEMBER':<16} {'INST':>4} {'STATE':<9} {'PORT':>6} {'BUSY':>9} {'CTX':>6} {'QUEUE':>5}"
        "  URL"
    ]
    for m in status.members:
        for i in m.instances:
            busy = f"{i.slots_busy}/{i.slots_total}"
            lines.append(
                f"{m.name:<16} {i.index:>4} {i.state:<9} {i.port or '-':>6} "
                f"{busy:>9} {i.n_ctx or '-':>6} {m.queue:>5}  {i.url or '-'}"
            )
        if not m.instances:  # not started yet (servers start on first lease) or unloaded
            lines.append(
                f"{m.name:<16} {'-':>4} {m.state:<9} {'-':>6} {'-':>9} {'-':>6} {m.queue:>5}"
            )
        if m.restarts:
            lines.append(f"  restarts: {m.restarts}")
        if not m.healthy and m.state == "unhealthy":
            probe = f", next probe in {m.next_probe_ms / 1000:.1f} s" if m.next_probe_ms else ""
            lines.append(f"  unreachable for {m.unhealthy_ms / 1000:.1f} s{probe}")
        if m.recoveries:
            lines.append(f"  went down {m.downs}x, recovered {m.recoveries}x")
        if m.last_error:
            lines.append(f"  last error: {m.last_error}")
    for t in status.tiers:
        line = f"tier {t.name} ({', '.join(t.members)}): {t.queue} waiting"
        if len(t.healthy) < len(t.members):
            line += f", healthy: {', '.join(t.healthy) or 'none'}"
        if t.failovers:
            line += f", {t.failovers} leases served by a higher tier"
        if t.in_flight_failovers:
            line += f", {t.in_flight_failovers} calls moved off a member that failed mid-call"
        lines.append(line)
    return "\n".join(lines)


async def _ask(args: argparse.Namespace) -> int:
    from daemon.slots import PoolStatus
    from surfaces.client import DaemonClient, Endpoint

    async with DaemonClient(Endpoint.from_env(args.socket)) as client:
        body = await client.call("slots_status")
    if args.json:
        print(json.dumps(body, indent=2))
    else:
        shown = {key: body.get(key, []) for key in ("members", "tiers")}
        print(_table(PoolStatus.model_validate(shown)))
        print(
            f"busy {body.get('busy', 0)}  idle {body.get('idle', 0)}  queue {body.get('queue', 0)}"
            f"  command tasks: {body.get('command_sandbox', '?')}"
        )
    return 0


def run(args: argparse.Namespace) -> int:
    if args.roster is None:
        from surfaces.client import run_client

        return run_client(_ask(args))
    import asyncio

    from roster import RosterError

    try:
        roster = _load(args.roster)
    except RosterError as err:
        print(f"tally slots: cannot load the roster:\n{err}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tally-slots-") as tmp:
        state = args.state_dir or Path(tmp)
        status, problems = asyncio.run(_check(roster, state, args.timeout, args.roster.parent))
    if args.json:
        print(status.model_dump_json(indent=2))
    else:
        print(_table(status))
    for name, why in problems.items():
        print(f"tally slots: {name}: {why}", file=sys.stderr)
    if problems:
        print("tally slots: `tally doctor --roster FILE` says how to fix each", file=sys.stderr)
    return 0 if not problems and all(m.state == "ready" for m in status.members) else 1
