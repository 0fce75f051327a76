"""`tally roster check | show | lanes`: validate and inspect a roster file."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from roster import Roster


def roster_path(given: str | None) -> Path:
    """The roster to use: the one given, else $TALLY_ROSTER, else the packaged default."""
    if given:
        return Path(given)
    env = os.environ.get("TALLY_ROSTER")
    if env:
        return Path(env)
    from roster import default_roster_path

    return default_roster_path()


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser("roster", help="check and inspect the roster")
    sub = parser.add_subparsers(dest="roster_command", metavar="SUBCOMMAND", required=True)

    check = sub.add_parser("check", help="validate a roster; print every located problem")
    check.add_argument("file", nargs="?", help="default: $TALLY_ROSTER or the packaged roster")
    check.add_argument("--json", action="store_true", help="print a JSON object")
    check.set_defaults(run=run_check)

    show = sub.add_parser("show", help="print the roster as loaded (TOML, or JSON)")
    show.add_argument("--roster", metavar="FILE", help="default: $TALLY_ROSTER or packaged")
    show.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    show.set_defaults(run=run_show)

    lanes = sub.add_parser("lanes", help="print the lanes as a table")
    lanes.add_argument("--roster", metavar="FILE", help="default: $TALLY_ROSTER or packaged")
    lanes.add_argument("--json", action="store_true", help="one JSON object per lane, in a list")
    lanes.set_defaults(run=run_lanes)


def _load(given: str | None) -> Roster | None:
    from roster import RosterError, load_roster

    try:
        return load_roster(roster_path(given))
    except RosterError as exc:
        print(exc, file=sys.stderr)
        return None


def run_check(args: argparse.Namespace) -> int:
    from roster import RosterError, load_roster

    path = roster_path(args.file)
    try:
        roster = load_roster(path)
    except RosterError as exc:
        if args.json:
            print(json.dumps({"ok": False, "file": str(path), **exc.details}))
        else:
            print(exc)
        return 1
    lanes, tiers, members = len(roster.lanes), len(roster.tiers.members), len(roster.models)
    if args.json:
        counts = {"lanes": lanes, "tiers": tiers, "members": members}
        print(json.dumps({"ok": True, "file": str(path), **counts}))
    else:
        counted = [count(lanes, "lane"), count(tiers, "tier"), count(members, "member")]
        print(f"ok: {', '.join(counted)}")
    return 0


def count(n: int, noun: str) -> str:
    """`1 lane`, `2 lanes`, `0 lanes`."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def run_show(args: argparse.Namespace) -> int:
    roster = _load(args.roster)
    if roster is None:
        return 1
    data = roster.model_dump(mode="json", exclude_none=True)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        import tomli_w

        sys.stdout.write(tomli_w.dumps(data))
    return 0


def run_lanes(args: argparse.Namespace) -> int:
    roster = _load(args.roster)
    if roster is None:
        return 1
    if args.json:
        fields = {"name", "tier", "keywords", "phrases", "negative", "max_concurrency"}
        print(json.dumps([lane.model_dump(mode="json", include=fields) for lane in roster.lanes]))
        return 0
    rows = [
        (lane.name, lane.tier, str(len(lane.keywords)), _first(lane.keywords))
        for lane in roster.lanes
    ]
    header = ("lane", "tier", "keywords", "first keywords")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].rjust(widths[2])]
        print("  ".join([*cells, row[3]]).rstrip())
    return 0


def _first(words: list[str], limit: int = 48) -> str:
    text = ", ".join(words[:5])
    return text if len(text) <= limit else text[: limit - 1] + "…"
