"""`tally version`: the installed version."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser("version", help="print tally's version")
    parser.add_argument("--json", action="store_true", help='print {"version": "..."}')
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from daemon.version import package_version

    print(json.dumps({"version": package_version()}) if args.json else package_version())
    return 0
