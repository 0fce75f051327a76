"""`tally client add | list | revoke`: named clients and their scopes.

Through the running daemon (witnessed as client.add / client.revoke) when it answers; with the
daemon stopped, the state dir's client file is edited directly (the daemon re-reads it when it
changes), and the command says the change is not in the record.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SCOPES = ("read", "submit", "command", "admin")


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser("client", help="named clients and their scopes (TCP tokens)")
    sub = parser.add_subparsers(dest="client_command", metavar="SUBCOMMAND", required=True)
    add = sub.add_parser("add", help="make a client; prints its token once")
    add.add_argument("name")
    add.add_argument(
        "--scope", choices=SCOPES, required=True, help="each scope includes the ones before it"
    )
    add.add_argument(
        "--rpm", type=_positive, metavar="N", help="requests a minute (gateway and submit)"
    )
    add.add_argument("--tpm", type=_positive, metavar="N", help="tokens a minute")
    add.add_argument(
        "--tokens-per-day", type=_positive, metavar="N", help="tokens in any 24 hours (a budget)"
    )
    add.set_defaults(run=run, call="client_add")
    lst = sub.add_parser("list", help="names, scopes, creation times (never tokens)")
    lst.set_defaults(run=run, call="client_list")
    revoke = sub.add_parser("revoke", help="its token stops working at once")
    revoke.add_argument("name")
    revoke.set_defaults(run=run, call="client_revoke")
    for p in (add, lst, revoke):
        p.add_argument("--json", action="store_true", help="print JSON")
        p.add_argument("--socket", type=Path, help="the daemon's socket (default: as serve)")
        p.add_argument("--state", type=Path, help="state dir, used when the daemon is stopped")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= 2**53 - 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range (1 to 2**53-1)")
    return value


def _limits(args: argparse.Namespace) -> dict[str, int] | None:
    found = {
        "rpm": getattr(args, "rpm", None),
        "tpm": getattr(args, "tpm", None),
        "tokens_per_day": getattr(args, "tokens_per_day", None),
    }
    limits = {key: value for key, value in found.items() if value is not None}
    return limits or None


def _arguments(args: argparse.Namespace) -> dict[str, Any]:
    found = {
        "name": getattr(args, "name", None),
        "scope": getattr(args, "scope", None),
        "limits": _limits(args),
    }
    return {key: value for key, value in found.items() if value is not None}


def limits_text(client: dict[str, Any]) -> str:
    """`rpm 60 (3 used) · tokens/day 200000 (1520 used)`, or `no limits`."""
    limits = client.get("limits") or {}
    used = client.get("used") or {}
    parts = []
    for key, label, window in (
        ("rpm", "rpm", "requests_minute"),
        ("tpm", "tpm", "tokens_minute"),
        ("tokens_per_day", "tokens/day", "tokens_day"),
    ):
        if limits.get(key) is not None:
            spent = f" ({used[window]} used)" if window in used else ""
            parts.append(f"{label} {limits[key]}{spent}")
    return " · ".join(parts) or "no limits"


async def _through_daemon(args: argparse.Namespace) -> dict[str, Any]:
    from surfaces.client import DaemonClient, Endpoint

    async with DaemonClient(Endpoint.from_env(args.socket)) as client:
        body = await client.call(args.call, _arguments(args))
        if args.call == "client_add":
            listener = (await client.call("health", {})).get("listener") or {}
            body["connect"] = connect_info(listener)
        return body


def connect_info(listener: dict[str, Any]) -> dict[str, Any]:
    """What a client on another machine needs beside its token: the URL and, when the daemon
    serves TLS, the certificate's fingerprint to pin (from the daemon's `health`)."""
    return {
        "url": listener.get("url"),
        "tls_fingerprint": listener.get("tls_fingerprint"),
    }


def _offline_connect(state: Path) -> dict[str, Any]:
    """With the daemon stopped: the state dir's self-signed certificate, if one was made."""
    from daemon.tls import fingerprint, self_signed_paths

    cert = self_signed_paths(state)[0]
    try:
        pin = fingerprint(cert.read_bytes())
    except (OSError, ValueError):
        pin = None
    return {"url": None, "tls_fingerprint": pin}


def _offline(args: argparse.Namespace) -> dict[str, Any]:
    from daemon.clients import ClientStore, Limits
    from daemon.config import default_state_dir

    store = ClientStore(args.state or default_state_dir())
    strip = {"token_sha256"}
    if args.call == "client_add":
        limits = _limits(args)
        token = store.add(args.name, args.scope, Limits(**limits) if limits else None)
        record = next(r for r in store.records() if r.name == args.name)
        connect = _offline_connect(args.state or default_state_dir())
        return {**record.model_dump(exclude=strip), "token": token, "connect": connect}
    if args.call == "client_revoke":
        return store.revoke(args.name).model_dump(exclude=strip)
    return {"clients": [r.model_dump(exclude=strip) for r in store.records()]}


def run(args: argparse.Namespace) -> int:
    import asyncio

    from daemon.errors import TallyError
    from surfaces.client import DaemonDown, DaemonError

    try:
        try:
            body = asyncio.run(_through_daemon(args))
        except DaemonDown:
            body = _offline(args)
            print(
                "tally client: the daemon is not running; read the client file (use against "
                "limits is the daemon's: not shown)"
                if args.call == "client_list"  # a read-only command changed nothing
                else "tally client: the daemon is not running; changed the client file directly "
                "(not witnessed in the ledger)",
                file=sys.stderr,
            )
    except DaemonError as exc:
        print(f"tally client: {exc.message}", file=sys.stderr)
        return 1
    except TallyError as exc:
        print(f"tally client: {exc.message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(body, indent=2))
    elif "clients" in body:
        from surfaces.cli.clock import local_time

        for c in body["clients"]:
            print(
                f"{c['name']:<24} {c['scope']:<8} created {local_time(c['created_at_us'])}  "
                + limits_text(c)
            )
    elif "token" in body:
        print(body["token"])
        print(
            f"client {body['name']!r} ({body['scope']}): store the token now; only its "
            "hash is kept. Use it as TALLY_TOKEN with TALLY_URL.",
            file=sys.stderr,
        )
        connect = body.get("connect") or {}
        lines = [
            f"  TALLY_URL={connect.get('url') or 'http(s)://ADDR:PORT of `tally serve --tcp`'}"
        ]
        lines.append(f"  TALLY_TOKEN={body['token']}")
        if connect.get("tls_fingerprint"):
            lines.append(f"  TALLY_TLS_FINGERPRINT={connect['tls_fingerprint']}")
            lines.append("  (pin that certificate: `tally cert` prints it, PEM, for curl --cacert)")
        print("what the client needs:\n" + "\n".join(lines), file=sys.stderr)
    else:
        print(f"revoked {body['name']!r}")
    return 0
