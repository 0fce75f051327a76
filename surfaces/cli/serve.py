"""`tally serve` (the daemon in the foreground), `tally token` and `tally unit` (systemd)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from daemon.errors import TallyError


def register(commands: argparse._SubParsersAction[Any]) -> None:
    p = commands.add_parser("serve", help="run the daemon in the foreground (HTTP on a socket)")
    p.add_argument("--tcp", metavar="127.0.0.1:PORT", help="also listen on loopback TCP (token)")
    p.add_argument("--state", type=Path, help="state directory (ledger, keys, token)")
    p.add_argument("--socket", type=Path, help="unix socket path")
    p.add_argument("--roster", type=Path, help="roster TOML file (default: the packaged one)")
    p.add_argument(
        "--coordinator",
        metavar="TIER",
        help="plan requests with this tier or member (roster: [policy] coordinator)",
    )
    p.add_argument(
        "--judge",
        metavar="TIER",
        help="judge chat output with this tier or member (roster: [policy] judge)",
    )
    p.add_argument(
        "--workspace-root",
        metavar="DIR",
        type=Path,
        action="append",
        help="allow runs to work on projects inside DIR (repeatable; roster: "
        "[policy.workspace] roots)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(run=run_serve)

    t = commands.add_parser("token", help="print the bearer token for the TCP listener")
    t.add_argument("--state", type=Path, help="state directory")
    t.add_argument("--json", action="store_true")
    t.set_defaults(run=run_token)

    u = commands.add_parser("unit", help="print or install the systemd unit for this install")
    u.add_argument("--system", action="store_true", help="the hardened system-unit variant")
    u.add_argument(
        "--install", action="store_true", help="write ~/.config/systemd/user/tallyd.service"
    )
    u.set_defaults(run=run_unit)


def settings_from(args: argparse.Namespace) -> Any:
    from daemon.config import Settings

    overrides: dict[str, Any] = {}
    for key, attr in (
        ("state_dir", "state"),
        ("socket_path", "socket"),
        ("tcp", "tcp"),
        ("roster_path", "roster"),
        ("coordinator", "coordinator"),
        ("judge", "judge"),
    ):
        value = getattr(args, attr, None)
        if value is not None:
            overrides[key] = value
    roots = getattr(args, "workspace_root", None)
    if roots:
        overrides["workspace_roots"] = tuple(Path(root).resolve() for root in roots)
    return Settings.from_env(**overrides)


def run_serve(args: argparse.Namespace) -> int:
    from surfaces.cli import long_start, settled

    long_start()  # before the imports: they are most of the start's objects
    import asyncio
    import logging

    from daemon.service import Daemon
    from surfaces.auth import load_or_create_token
    from surfaces.cli.mcp import mcp_config_block
    from surfaces.http import HttpOptions, Listen, log_to_stderr, parse_tcp, serve

    log_to_stderr(logging.DEBUG if args.verbose else logging.INFO)
    try:
        if args.tcp:
            parse_tcp(args.tcp)
        settings = settings_from(args)
    except (ValueError, TallyError) as exc:
        print(f"tally serve: {exc}", file=sys.stderr)
        return 2
    token = load_or_create_token(Path(settings.state_dir)) if settings.tcp else None
    socket_path = Path(settings.socket_path) if settings.socket_path else None

    def announce(where: list[str]) -> None:
        settled()  # listening, the ledger recovered: what is loaded now stays loaded
        print(f"tally: listening on {', '.join(where)}", file=sys.stderr)
        print(f"tally: state in {settings.state_dir}", file=sys.stderr)
        if token:
            print("tally: TCP needs `Authorization: Bearer $(tally token)`", file=sys.stderr)
        print("tally: MCP config for your IDE (mcpServers):", file=sys.stderr)
        print(mcp_config_block(sys.executable, socket_path), file=sys.stderr)

    from surfaces.connections import ConnectionLimits

    try:
        limits = ConnectionLimits.from_env(os.environ)  # TALLY_MAX_CONNECTIONS, ...
    except ValueError as exc:
        print(f"tally serve: {exc}", file=sys.stderr)
        return 2
    options = HttpOptions(
        token=token, body_limit=int(getattr(settings, "body_limit", 1 << 20)), limits=limits
    )
    try:
        asyncio.run(
            serve(Daemon(settings), Listen(socket_path, settings.tcp), options, announce=announce)
        )
    except TallyError as exc:
        print(f"tally serve: {exc.message}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"tally serve: {exc}", file=sys.stderr)
        return 1
    return 0


def run_token(args: argparse.Namespace) -> int:
    from surfaces.auth import load_or_create_token

    state = args.state or Path(settings_from(args).state_dir)
    token = load_or_create_token(Path(state))
    print(json.dumps({"token": token}) if args.json else token)
    return 0


def run_unit(args: argparse.Namespace) -> int:
    from surfaces.units import system_unit, user_unit

    exe = shutil.which("tally") or str(Path(sys.executable).with_name("tally"))
    exe = os.path.abspath(exe)
    text = system_unit(exe) if args.system else user_unit(exe)
    if not args.install:
        print(text, end="")
        return 0
    if args.system:
        print(
            "tally unit: install the system unit as root: "
            "tally unit --system > /etc/systemd/system/tallyd.service",
            file=sys.stderr,
        )
        return 2
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    target = base / "systemd" / "user" / "tallyd.service"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    print(
        f"wrote {target}\nnow: systemctl --user daemon-reload && "
        "systemctl --user enable --now tallyd",
        file=sys.stderr,
    )
    return 0
