"""`tally plan FILE.json`: validate a plan and print its waves, or every problem."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from surfaces.cli.roster import roster_path

if TYPE_CHECKING:
    from daemon.plans import PlanProblem


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "plan", help="validate a plan (JSON) and print its waves or its problems"
    )
    parser.add_argument("file", help="the plan as JSON, or - for stdin")
    parser.add_argument(
        "--max-parallel",
        type=_positive,
        metavar="N",
        help="split each level into waves of at most N tasks (default: the roster's policy)",
    )
    parser.add_argument("--roster", metavar="FILE", help="lanes come from this roster")
    parser.add_argument(
        "--any-lane", action="store_true", help="do not check lanes (and load no roster)"
    )
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from daemon.plans import report, waves
    from roster import RosterError, load_roster

    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    except OSError as exc:
        print(f"tally plan: cannot read {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as exc:
        print(
            f"tally plan: {args.file} is not UTF-8 text ({exc.reason} at byte {exc.start})",
            file=sys.stderr,
        )
        return 2
    lanes: list[str] | None = None
    max_parallel: int | None = args.max_parallel
    if not args.any_lane:
        try:
            roster = load_roster(roster_path(args.roster))
        except RosterError as exc:
            print(f"tally plan: the roster is not usable (or pass --any-lane):\n{exc}")
            return 1
        lanes = [lane.name for lane in roster.lanes]
        if max_parallel is None:
            max_parallel = roster.policy.max_parallel
    plan, found = report(text, lanes)  # every problem at once: schema, lanes, needs, cycles
    if plan is None or found:
        _print_problems(found, as_json=args.json)
        return 1
    result = waves(plan, max_parallel)
    if args.json:
        print(result.model_dump_json())
        return 0
    for number, wave in enumerate(result.waves, 1):
        print(f"wave {number}: {', '.join(wave)}")
    print(
        f"{len(result.waves)} waves, critical path {result.critical_path}, "
        f"{result.total_tasks} tasks"
    )
    return 0


def _print_problems(problems: list[PlanProblem], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"errors": [p.model_dump() for p in problems]}))
        return
    for problem in problems:
        print(problem.message)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
