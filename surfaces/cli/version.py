"""`tally version`: the installed version."""

from __future__ import annotations

import argparse
from importlib.metadata import version as dist_version
from typing import Any


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser("version", help="print tally's version")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print(dist_version("tallyd"))
    return 0
