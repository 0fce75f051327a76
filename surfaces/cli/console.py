"""`tally console [--open] [--admin] [--client NAME]`: a one-time login URL for the console.

It starts nothing: the running daemon (asked over its socket, as its owner) mints a code good
once for two minutes, and the URL names its TCP listener (`tally serve --tcp 127.0.0.1:PORT`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(commands: argparse._SubParsersAction[Any]) -> None:
    p = commands.add_parser("console", help="print (or --open) a one-time console login URL")
    p.add_argument("--open", action="store_true", help="open the URL in a browser")
    p.add_argument("--admin", action="store_true", help="a session with scope admin (not read)")
    p.add_argument("--client", help="bind the session to this named client and its scope")
    p.add_argument("--socket", type=Path, help="daemon socket (default: $TALLY_SOCKET or runtime)")
    p.set_defaults(run=run)


async def _login(args: argparse.Namespace) -> int:
    import sys

    from surfaces.client import DaemonClient, Endpoint

    body: dict[str, Any] = {"admin": args.admin}
    if args.client:
        body["client"] = args.client
    async with DaemonClient(Endpoint.from_env(args.socket)) as client:
        answer = await client.post("/v1/console/code", body)
    url = str(answer["url"])
    print(url)
    print(
        f"one use, within {answer['expires_in_s']} s; the session is client "
        f"{answer['client']!r} with scope {answer['scope']!r}",
        file=sys.stderr,
    )
    if args.open:
        import webbrowser

        webbrowser.open(url)
    return 0


def run(args: argparse.Namespace) -> int:
    from surfaces.client import run_client

    return run_client(_login(args))
