"""`tally version`: the installed version."""

from __future__ import annotations

import argparse
from typing import Any

from daemon.tools import package_version


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser("version", help="print tally's version")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print(package_version())
    return 0
