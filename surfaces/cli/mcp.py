"""`tally mcp`: the MCP stdio server an IDE launches; forwards every call to the daemon.

The MCP SDK is imported only when `tally mcp` runs: `tally serve` prints the IDE block from
here without it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(commands: argparse._SubParsersAction[Any]) -> None:
    p = commands.add_parser("mcp", help="MCP server on stdio (for IDEs); forwards to the daemon")
    p.add_argument("--socket", type=Path, help="daemon socket (default: $TALLY_SOCKET or runtime)")
    p.add_argument("--autostart", action="store_true", help="start a daemon if none is running")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from surfaces.cli.memory import long_start, settled

    long_start()  # before the SDK's imports
    import anyio

    from surfaces.mcp import configure_logging, run_stdio

    settled()  # the SDK is loaded: what follows is the session
    configure_logging()
    anyio.run(lambda: run_stdio(args.socket, autostart=args.autostart))
    return 0


def mcp_config_block(python: str | None = None, socket_path: Path | None = None) -> str:
    """The `mcpServers` block to paste into an IDE's MCP config."""
    entry: dict[str, Any] = {"command": python or sys.executable, "args": ["-m", "surfaces", "mcp"]}
    if socket_path is not None:
        entry["env"] = {"TALLY_SOCKET": str(socket_path)}
    return json.dumps({"mcpServers": {"tally": entry}}, indent=2)
