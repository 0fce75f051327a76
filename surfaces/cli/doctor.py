"""`tally doctor [--roster FILE]`: check every pool member before anything needs it.

Reachable, model present, context size, slots, and a one-token completion with its latency.
Spawned members are started for the check (in-process, then stopped) unless `--no-spawn`.
Each finding is one line that says how to fix it, labelled `problem:` (the member fails the
check; the exit code is 1) or `warning:` (it works; the exit code stays 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser("doctor", help="check every model member of a roster")
    parser.add_argument("--roster", type=Path, help="default: $TALLY_ROSTER or packaged")
    parser.add_argument(
        "--no-spawn",
        action="store_true",
        help="do not start spawned members (check their command and model file only)",
    )
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds per request")
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import tempfile

    from daemon.slots.checkup import check_roster
    from roster import RosterError, load_roster
    from surfaces.cli.roster import roster_path

    path = roster_path(str(args.roster) if args.roster else None)
    try:
        roster = load_roster(path)
    except RosterError as err:
        print(f"tally doctor: the roster does not load:\n{err}", file=sys.stderr)
        return 1
    if args.timeout <= 0:
        print("tally doctor: --timeout must be positive", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tally-doctor-") as state:
        checkup = asyncio.run(
            check_roster(
                roster,
                roster_dir=path.parent,
                state_dir=Path(state),
                spawn=not args.no_spawn,
                timeout_s=args.timeout,
            )
        )
    checkup = _with_agent_clis(checkup, roster, args.timeout)
    if args.json:
        members = [{**m.model_dump(mode="json"), "ok": m.ok} for m in checkup.members]
        print(json.dumps({"ok": checkup.ok, "roster": str(path), "members": members}, indent=2))
        return 0 if checkup.ok else 1
    print(f"roster: {path}")
    print(_table(checkup.members))
    problems = [(m.name, f) for m in checkup.members for f in m.findings if f.level == "error"]
    warnings = [(m.name, f) for m in checkup.members for f in m.findings if f.level != "error"]
    if problems:
        print("\nproblems (each fails the check), with their fixes:")
        for name, f in problems:
            print(f"  problem: {name}: {f.problem} — {f.fix}")
    if warnings:
        print("\nwarnings (the members work, but), with their fixes:")
        for name, f in warnings:
            print(f"  warning: {name}: {f.problem} — {f.fix}")
    failed = [m.name for m in checkup.members if not m.ok]
    if (embedding := roster.policy.embeddings) is not None:
        print(
            f"\nrouting: embeddings on {embedding} ({'ok' if embedding not in failed else 'DOWN'}"
            "): lanes are also scored by a request's likeness to their examples; while it is "
            "down, routes use the keyword scores alone and say so (`tally status` shows its "
            "example vectors)"
        )
    if failed:
        print(f"\nFAILED: {', '.join(failed)}")
    else:
        counted = f" ({len(warnings)} warning{'s' if len(warnings) != 1 else ''})"
        print(f"\nall members ok{counted if warnings else ''}")
    return 1 if failed else 0


def _with_agent_clis(checkup: Any, roster: Any, timeout_s: float) -> Any:
    """The checkup with each agent-cli member probed in the sandbox (`agentcli.probe`), in
    roster order: its program found, executable and shown, and `--version` answering."""
    import asyncio

    from daemon.config import Settings
    from daemon.runs.agentcli import probe
    from daemon.runs.sandbox import Confinement
    from daemon.slots.checkup import Checkup

    clis = [m for m in roster.models if m.agent_cli]
    if not clis:
        return checkup
    settings = Settings.from_env()
    confinement = Confinement(hidden=(settings.state_dir, settings.runtime_dir, Path.home()))

    async def probe_all() -> list[Any]:
        policy = roster.policy.command
        return list(await asyncio.gather(*(probe(m, policy, confinement, timeout_s) for m in clis)))

    found = {r.name: r for r in [*checkup.members, *asyncio.run(probe_all())]}
    return Checkup(members=[found[m.name] for m in roster.models if m.name in found])


def _table(members: list[Any]) -> str:
    rows = [("MEMBER", "KIND", "OK", "REACH", "MODEL", "CTX", "SLOTS", "1 TOKEN", "WHERE")]
    for m in members:
        token = "-"
        if m.latency_ms is not None:
            token = f"{m.latency_ms} ms"
            if m.kind == "spawned" and m.ready_ms is not None:
                token += f" (up in {m.ready_ms / 1000:.1f} s)"
        rows.append(
            (
                m.name,
                m.kind,
                "ok" if m.ok else "FAIL",
                _yes(m.reachable),
                _yes(m.model_present),
                str(m.n_ctx or "-"),
                str(m.slots or "-"),
                token,
                m.where if len(m.where) <= 60 else "…" + m.where[-59:],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[-1]])
        for row in rows
    )


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")
