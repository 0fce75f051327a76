"""`tally serve` (the daemon in the foreground), `tally token` and `tally unit` (systemd)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from daemon import layout
from daemon.errors import TallyError


def serve_options(p: argparse.ArgumentParser) -> None:
    """The daemon's options. `tally unit` takes every option of `serve` (it copies the serve
    parser's actions, so an option added here or beside it reaches the unit's ExecStart)."""
    p.add_argument(
        "--tcp",
        metavar="ADDR:PORT",
        help="also listen on TCP (a token per client); beyond loopback only with --tls "
        "(or --insecure-http)",
    )
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
    p.add_argument(
        "--ledger",
        metavar="URL",
        help="keep the record on PostgreSQL, shared with other daemons (postgresql://…; "
        "$TALLY_LEDGER); default: the file ledger in the state dir",
    )


def register(commands: argparse._SubParsersAction[Any]) -> None:
    p = commands.add_parser("serve", help="run the daemon in the foreground (HTTP on a socket)")
    serve_options(p)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_tls_options(p)
    p.set_defaults(run=run_serve)

    c = commands.add_parser("cert", help="print the TCP listener's TLS certificate and fingerprint")
    c.add_argument("--state", type=Path, help="state directory (its self-signed certificate)")
    c.add_argument("--tls-cert", type=Path, metavar="FILE", help="this certificate instead")
    c.add_argument("--fingerprint", action="store_true", help="print only the sha256: pin")
    c.add_argument("--json", action="store_true")
    c.set_defaults(run=run_cert)

    t = commands.add_parser("token", help="print the bearer token for the TCP listener")
    t.add_argument("--state", type=Path, help="state directory")
    t.add_argument("--json", action="store_true")
    t.set_defaults(run=run_token)

    u = commands.add_parser(
        "unit",
        help="print or install the systemd unit for this install, with serve's options",
        description="Print (or --install) a systemd unit that runs `tally serve` with the "
        "serve options given here (--roster, --tcp, …), paths made absolute.",
    )
    u.add_argument("--system", action="store_true", help="the hardened system-unit variant")
    u.add_argument(
        "--install", action="store_true", help="write ~/.config/systemd/user/tallyd.service"
    )
    carried = [a for a in p._actions if a.dest not in UNIT_SKIPS]
    for action in carried:  # every serve option, however it was added (argparse's own API)
        u._add_action(action)
    u.set_defaults(run=run_unit, serve_actions=carried)


UNIT_SKIPS = frozenset({"help", "verbose"})
"""Serve options a unit does not carry (-v: the unit's log level is the default)."""


def add_tls_options(p: argparse.ArgumentParser) -> None:
    """Serving beyond loopback (`serve`'s; `tally unit` takes the same)."""
    p.add_argument(
        "--tls", action="store_true", help="serve --tcp over HTTPS (TLS 1.2+; see --tls-cert)"
    )
    p.add_argument(
        "--tls-cert",
        type=Path,
        metavar="FILE",
        help="certificate chain (PEM); without it --tls makes a self-signed one in the state dir",
    )
    p.add_argument("--tls-key", type=Path, metavar="FILE", help="the --tls-cert's key (PEM)")
    p.add_argument(
        "--host-name",
        action="append",
        metavar="NAME",
        help="a name clients reach the daemon by (Host check, certificate); repeatable",
    )
    p.add_argument(
        "--insecure-http",
        action="store_true",
        help="allow plain HTTP on a non-loopback --tcp (witnessed in the ledger)",
    )


def _tls_settings(args: argparse.Namespace) -> dict[str, Any]:
    from daemon.tls import check_host_name

    found: dict[str, Any] = {}
    if getattr(args, "tls", False):
        found["tls"] = True
    if getattr(args, "insecure_http", False):
        found["insecure_http"] = True
    for key in ("tls_cert", "tls_key"):
        if getattr(args, key, None) is not None:
            found[key] = getattr(args, key)
    names = getattr(args, "host_name", None)
    if names:
        found["host_names"] = tuple(dict.fromkeys(check_host_name(n) for n in names))
    return found


def tls_paths(settings: Any) -> tuple[Path, Path] | None:
    """The listener's (certificate, key), made in the state dir if none is given; None = plain
    HTTP. ValueError for options that do not go together."""
    from daemon.tls import ensure_self_signed

    given = (settings.tls_cert, settings.tls_key)
    if not settings.tls:
        if given != (None, None):
            raise ValueError("--tls-cert/--tls-key need --tls")
        return None
    if settings.tcp is None:
        raise ValueError("--tls serves the TCP listener: give --tcp ADDR:PORT too")
    if settings.insecure_http:
        raise ValueError("--tls and --insecure-http contradict each other")
    if (given[0] is None) != (given[1] is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if given[0] is not None and given[1] is not None:
        return Path(given[0]), Path(given[1])
    host = settings.tcp.rpartition(":")[0]
    return ensure_self_signed(Path(settings.state_dir), [host, *settings.host_names])


def settings_from(args: argparse.Namespace) -> Any:
    from daemon.config import Settings

    overrides: dict[str, Any] = _tls_settings(args)  # --tls, --host-name, …
    for key, attr in (
        ("state_dir", "state"),
        ("socket_path", "socket"),
        ("tcp", "tcp"),
        ("roster_path", "roster"),
        ("coordinator", "coordinator"),
        ("judge", "judge"),
        ("ledger_url", "ledger"),
    ):
        value = getattr(args, attr, None)
        if value is not None:
            overrides[key] = value
    roots = getattr(args, "workspace_root", None)
    if roots:
        resolved = tuple(Path(root).expanduser().resolve() for root in roots)
        for given, root in zip(roots, resolved, strict=True):
            if not root.is_dir():  # a typo would otherwise only show as every submit refused
                raise ValueError(f"--workspace-root {given}: not a directory ({root})")
        overrides["workspace_roots"] = resolved
    return Settings.from_env(**overrides)


def run_serve(args: argparse.Namespace) -> int:
    from surfaces.cli.memory import long_start, settled

    long_start()  # before the imports: they are most of the start's objects
    import asyncio
    import logging

    from daemon.service import Daemon
    from surfaces.auth import load_or_create_token
    from surfaces.cli.mcp import mcp_config_block
    from surfaces.http import HttpOptions, Listen, log_to_stderr, parse_tcp, serve

    log_to_stderr(logging.DEBUG if args.verbose else logging.INFO)
    from daemon.tls import fingerprint, is_loopback

    try:
        if args.tcp:
            parse_tcp(args.tcp, tls=args.tls, insecure_http=args.insecure_http)
        settings = settings_from(args)
        if settings.tcp:  # $TALLY_TCP too: refused before anything starts
            parse_tcp(settings.tcp, tls=settings.tls, insecure_http=settings.insecure_http)
        tls = tls_paths(settings)
    except (ValueError, TallyError) as exc:
        errors = getattr(exc, "errors", None)  # a Settings ValidationError: the messages only
        said = (
            "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in errors())
            if callable(errors)
            else exc
        )
        print(f"tally serve: {said}", file=sys.stderr)
        return 2
    log_to_file(Path(settings.state_dir))
    token = load_or_create_token(Path(settings.state_dir)) if settings.tcp else None
    socket_path = Path(settings.socket_path) if settings.socket_path else None

    def announce(where: list[str]) -> None:
        settled()  # listening, the ledger recovered: what is loaded now stays loaded
        print(f"tally: listening on {', '.join(where)}", file=sys.stderr)
        print(f"tally: state in {settings.state_dir}", file=sys.stderr)
        if token:
            print("tally: TCP needs `Authorization: Bearer $(tally token)`", file=sys.stderr)
        if settings.tcp and not is_loopback(settings.tcp.rpartition(":")[0]):
            print(
                "tally: clients on other machines need their own token: "
                "`tally client add NAME --scope submit` (`tally token` works from this one only)",
                file=sys.stderr,
            )
        if tls is not None:
            pin = fingerprint(tls[0].read_bytes())
            print(f"tally: TLS certificate {tls[0]} ({pin}; `tally cert`)", file=sys.stderr)
        print("tally: MCP config for your IDE (mcpServers):", file=sys.stderr)
        print(mcp_config_block(sys.executable, socket_path), file=sys.stderr)

    from surfaces.connections import ConnectionLimits

    try:
        limits = ConnectionLimits.from_env(os.environ)  # TALLY_MAX_CONNECTIONS, ...
    except ValueError as exc:
        print(f"tally serve: {exc}", file=sys.stderr)
        return 2
    options = HttpOptions(
        token=token,
        body_limit=int(getattr(settings, "body_limit", 1 << 20)),
        limits=limits,
        host_names=settings.host_names,
    )
    listen = Listen(socket_path, settings.tcp, tls=tls, insecure_http=settings.insecure_http)
    try:
        asyncio.run(serve(Daemon(settings), listen, options, announce=announce))
    except TallyError as exc:
        print(f"tally serve: {exc.message}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"tally serve: {exc}", file=sys.stderr)
        return 1
    return 0


LOG_MAX_BYTES = 10 << 20
LOG_KEEP = 3


def log_to_file(state_dir: Path) -> None:
    """The daemon's log also goes to `STATE/logs/daemon.log` (rotated at LOG_MAX_BYTES, LOG_KEEP
    kept), beside the model servers' logs, so `tally logs` finds it however the daemon was
    started (a terminal, a unit whose stderr goes to the journal)."""
    import logging
    from logging.handlers import RotatingFileHandler

    logs = state_dir / layout.LOGS
    try:
        logs.mkdir(parents=True, exist_ok=True, mode=0o700)
        handler = RotatingFileHandler(
            logs / layout.DAEMON_LOG, maxBytes=LOG_MAX_BYTES, backupCount=LOG_KEEP, encoding="utf-8"
        )
    except OSError as exc:  # a read-only state dir fails later, with its own message
        print(f"tally serve: no daemon.log in {logs}: {exc}", file=sys.stderr)
        return
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)


def run_token(args: argparse.Namespace) -> int:
    from surfaces.auth import load_or_create_token

    state = args.state or Path(settings_from(args).state_dir)
    token = load_or_create_token(Path(state))
    print(json.dumps({"token": token}) if args.json else token)
    return 0


def unit_options(
    args: argparse.Namespace, actions: list[argparse.Action]
) -> tuple[list[str], list[str]]:
    """The serve options given to `unit`, as ExecStart words (paths absolute, `~` expanded),
    and the paths among them (for the sandbox warnings). --state and --socket are not here:
    the unit puts them in place of its own directories."""
    words: list[str] = []
    paths: list[str] = []
    for action in actions:
        if action.dest in ("state", "socket") or not action.option_strings:
            continue
        value = getattr(args, action.dest, None)
        if value is None or value is False or value == action.default:
            continue
        flag = max(action.option_strings, key=len)  # the long spelling reads best in a unit
        if action.nargs == 0:  # a flag (store_true, store_const)
            words.append(flag)
            continue
        for one in value if isinstance(value, list) else [value]:
            if isinstance(one, Path):
                one = Path(os.path.abspath(one.expanduser()))
                paths.append(str(one))
            words += [flag, str(one)]
    return words, paths


def run_unit(args: argparse.Namespace) -> int:
    from surfaces.units import hidden, system_unit, user_unit

    exe = shutil.which("tally") or str(Path(sys.executable).with_name("tally"))
    exe = os.path.abspath(exe)
    if args.tcp:
        from surfaces.http import parse_tcp

        try:
            parse_tcp(args.tcp, tls=args.tls, insecure_http=args.insecure_http)
        except ValueError as exc:
            print(f"tally unit: --tcp: {exc}", file=sys.stderr)
            return 2
    options, paths = unit_options(args, args.serve_actions)
    state = str(Path(os.path.abspath(args.state.expanduser()))) if args.state else None
    socket = str(Path(os.path.abspath(args.socket.expanduser()))) if args.socket else None
    paths += [p for p in (state, socket) if p]
    try:
        if args.system:
            roots = [str(Path(os.path.abspath(r.expanduser()))) for r in args.workspace_root or []]
            text = system_unit(exe, options, state, socket, roots)
        else:
            text = user_unit(exe, options, state, socket)
    except ValueError as exc:
        print(f"tally unit: {exc}", file=sys.stderr)
        return 2
    for path in [exe, *paths]:
        why = hidden(path) if args.system else None
        if why is not None:
            print(
                f"tally unit: warning: {path} is out of the system unit's reach ({why}); "
                "move it (e.g. under /etc/tally or /opt) or the service will not find it",
                file=sys.stderr,
            )
    for path in paths:
        if path not in (state, socket) and not Path(path).exists():
            print(f"tally unit: warning: {path} does not exist (yet)", file=sys.stderr)
    if not args.install:
        print(text, end="")
        return 0
    if args.system:
        import shlex

        again = ["tally", "unit", *(a for a in sys.argv[2:] if a != "--install")]
        print(
            "tally unit: install the system unit as root: "
            f"{shlex.join(again)} > /etc/systemd/system/tallyd.service",
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


def run_cert(args: argparse.Namespace) -> int:
    """The certificate clients pin: the one given, the running daemon's, or the state dir's."""
    from daemon.tls import fingerprint, self_signed_paths

    path = args.tls_cert or _served_cert(args)
    if path is None:
        state = args.state or Path(settings_from(args).state_dir)
        path = self_signed_paths(Path(state))[0]
    try:
        pem = Path(path).read_bytes()
        pin = fingerprint(pem)
    except FileNotFoundError:
        print(
            f"tally cert: no certificate at {path}: `tally serve --tcp ADDR:PORT --tls` makes "
            "one on its first start",
            file=sys.stderr,
        )
        return 1
    except (OSError, ValueError) as exc:
        print(f"tally cert: {path}: not a PEM certificate ({exc})", file=sys.stderr)
        return 1
    first = pem.decode("ascii", "replace")
    end = first.find("-----END CERTIFICATE-----")
    cert = first[first.find("-----BEGIN CERTIFICATE-----") : end + 25] + "\n"
    if args.json:
        print(json.dumps({"path": str(path), "fingerprint": pin, "pem": cert}))
    elif args.fingerprint:
        print(pin)
    else:
        print(cert, end="")
        print(pin)  # outside the PEM block: a PEM reader skips it
    return 0


def _served_cert(args: argparse.Namespace) -> Path | None:
    """The running daemon's certificate (its `health`), when it serves TLS and answers."""
    if args.state is not None:
        return None  # the state dir asked for is the one to read
    import asyncio

    from surfaces.client import DaemonClient, DaemonDown, DaemonError, Endpoint

    async def ask() -> dict[str, Any]:
        async with DaemonClient(Endpoint.from_env(None)) as client:
            return await client.call("health", {})

    try:
        listener = asyncio.run(ask()).get("listener") or {}
    except (DaemonDown, DaemonError, OSError):
        return None
    path = listener.get("cert_path")
    return Path(path) if isinstance(path, str) else None
