"""`tally mcp`: the MCP stdio server an IDE launches; forwards every call to the daemon."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(commands: argparse._SubParsersAction[Any]) -> None:
    p = commands.add_parser("mcp", help="MCP server on stdio (for IDEs); forwards to the daemon")
    p.add_argument("--socket", type=Path, help="daemon socket (default: $TALLY_SOCKET or runtime)")
    p.add_argument("--autostart", action="store_true", help="start a daemon if none is running")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import anyio

    from surfaces.client import Endpoint
    from surfaces.mcp import configure_logging, run_stdio

    configure_logging()
    endpoint = Endpoint.from_env(args.socket)
    anyio.run(lambda: run_stdio(endpoint, autostart=args.autostart))
    return 0
