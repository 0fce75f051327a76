"""`tally ledger …`: offline inspection and verification of a state dir's ledger.

These commands open the ledger read-only (no lock, no writes), so they work on a copy of the
state dir or beside a running daemon. Exit codes: 0 ok, 1 check failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from daemon.errors import TallyError
from daemon.ledger import (
    CheckpointError,
    Entry,
    Ledger,
    LedgerCorrupt,
    VerifyReport,
    parse_note,
    verify_note,
)
from daemon.ledger.merkle import verify_consistency

Command = Callable[[Ledger, argparse.Namespace], Awaitable[int]]


class UsageError(Exception):
    """Bad arguments or an unusable input file: exit 2."""


def default_state_dir() -> Path:
    for name in ("TALLY_STATE_DIR", "STATE_DIRECTORY"):
        value = os.environ.get(name)
        if value:
            return Path(value.split(":")[0])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "tally"


def register(commands: argparse._SubParsersAction[Any]) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--state",
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="state dir (default: $TALLY_STATE_DIR, $STATE_DIRECTORY, $XDG_STATE_HOME/tally)",
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")
    group = commands.add_parser("ledger", help="inspect and verify the ledger (offline)")
    group.add_argument("--state", metavar="DIR", default=None, help=argparse.SUPPRESS)
    sub = group.add_subparsers(dest="ledger_command", metavar="COMMAND", required=True)

    verify = sub.add_parser("verify", parents=[common], help="check chain, tree and checkpoints")
    verify.add_argument("--deep", action="store_true", help="also re-hash every body")
    verify.add_argument(
        "--since", metavar="CHECKPOINT_FILE", help="prove consistency from a saved checkpoint"
    )
    verify.set_defaults(run=_runner(_verify, tail_check=0))

    show = sub.add_parser("show", parents=[common], help="list entries")
    show.add_argument("--from", dest="start", type=int, default=0, metavar="N")
    show.add_argument("--limit", type=int, default=20, metavar="N")
    show.add_argument("--kind")
    show.add_argument("--run", dest="run_id")
    show.set_defaults(run=_runner(_show))

    get = sub.add_parser("get", parents=[common], help="one entry and its body")
    get.add_argument("seq", type=int, metavar="SEQ")
    get.set_defaults(run=_runner(_get))

    proof = sub.add_parser("proof", help="RFC 9162 proofs")
    kinds = proof.add_subparsers(dest="proof_kind", metavar="KIND", required=True)
    inclusion = kinds.add_parser("inclusion", parents=[common], help="inclusion proof of SEQ")
    inclusion.add_argument("seq", type=int, metavar="SEQ")
    inclusion.add_argument("--size", type=int, metavar="N", help="tree size (default: all)")
    inclusion.set_defaults(run=_runner(_inclusion))
    consistency = kinds.add_parser("consistency", parents=[common], help="OLD → NEW proof")
    consistency.add_argument("old", type=int, metavar="OLD")
    consistency.add_argument("new", type=int, metavar="NEW", nargs="?")
    consistency.set_defaults(run=_runner(_consistency))

    checkpoint = sub.add_parser("checkpoint", parents=[common], help="the latest checkpoint")
    checkpoint.set_defaults(run=_runner(_checkpoint))


def _runner(command: Command, tail_check: int | None = None) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        state = Path(args.state) if args.state else default_state_dir()
        if not (state / "ledger").is_dir():
            print(f"tally ledger: no ledger in {state}", file=sys.stderr)
            return 2
        try:
            if getattr(args, "since", None):
                try:
                    args.since_text = Path(args.since).read_text()
                except (OSError, UnicodeDecodeError) as err:
                    raise UsageError(f"cannot read checkpoint {args.since}: {err}") from err
            return asyncio.run(_with_ledger(state, command, args, tail_check))
        except UsageError as err:
            print(f"tally ledger: {err}", file=sys.stderr)
            return 2
        except LedgerCorrupt as err:
            _emit_report(args, _corrupt_report(err), None)
            return 1
        except TallyError as err:
            print(f"tally ledger: {err.message}", file=sys.stderr)
            return 2 if err.status == 422 else 1
        except OSError as err:
            print(f"tally ledger: {err}", file=sys.stderr)
            return 1

    return run


async def _with_ledger(
    state: Path, command: Command, args: argparse.Namespace, tail_check: int | None
) -> int:
    extra = {} if tail_check is None else {"tail_check": tail_check}
    ledger = await Ledger.open(state, readonly=True, **extra)
    try:
        return await command(ledger, args)
    finally:
        await ledger.close()


def _corrupt_report(err: LedgerCorrupt) -> VerifyReport:
    return VerifyReport(ok=False, size=err.seq, root="", first_bad_seq=err.seq, reason=err.reason)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


def _emit_report(
    args: argparse.Namespace, report: VerifyReport, since: dict[str, Any] | None
) -> None:
    if getattr(args, "json", False):
        out = report.model_dump()
        if since is not None:
            out["since"] = since
        _print_json(out)
        return
    if report.first_bad_seq is not None and report.reason != "tampered bodies":
        print(f"FAILED at seq {report.first_bad_seq}: {report.reason}")
    else:
        status = "ok" if report.ok else "FAILED"
        print(f"{status}: {report.size} entries, root {report.root}")
    if report.redacted:
        print(f"redacted bodies ({len(report.redacted)}): " + ", ".join(report.redacted))
    if report.tampered:
        print(f"TAMPERED bodies ({len(report.tampered)}): " + ", ".join(report.tampered))
        if report.first_bad_seq is not None:
            print(f"first entry with a tampered body: seq {report.first_bad_seq}")
    if since is not None:
        verdict = "consistent" if since["consistent"] else "NOT consistent"
        print(
            f"checkpoint {since['size']} ({since['signature']} signature): {verdict} "
            f"with the ledger at size {report.size}"
        )


async def _verify(ledger: Ledger, args: argparse.Namespace) -> int:
    since = None
    pinned = None
    if args.since:
        text = args.since_text
        try:
            pinned = parse_note(text)
        except CheckpointError as err:
            raise UsageError(f"cannot read checkpoint {args.since}: {err}") from err
        signature = "unchecked (no checkpoint.vkey)"
        if ledger.vkey is not None:
            try:
                verify_note(text, ledger.vkey)
                signature = "valid"
            except CheckpointError:
                signature = "INVALID"
        since = {"size": pinned.size, "root": pinned.root, "signature": signature}
    report = await ledger.verify(deep=args.deep)
    if pinned is not None and since is not None:
        consistent = False
        if report.first_bad_seq is None or report.reason == "tampered bodies":
            consistent = pinned.size <= report.size and await _consistent(
                ledger, pinned.size, pinned.root
            )
        consistent = consistent and since["signature"] != "INVALID"
        since["consistent"] = consistent
        if not consistent:
            report = report.model_copy(update={"ok": False})
    _emit_report(args, report, since)
    return 0 if report.ok else 1


async def _consistent(ledger: Ledger, old: int, old_root: str) -> bool:
    proof = await ledger.consistency_proof(old)
    return verify_consistency(
        old,
        proof.new_size,
        bytes.fromhex(old_root),
        bytes.fromhex(proof.new_root),
        [bytes.fromhex(p) for p in proof.path],
    )


def _entry_json(entry: Entry) -> dict[str, Any]:
    return {**entry.model_dump(), "hash": entry.hash}


def _time(ts: int) -> str:
    return dt.datetime.fromtimestamp(ts / 1e6, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


async def _show(ledger: Ledger, args: argparse.Namespace) -> int:
    if args.start < 0 or args.limit < 0:
        raise UsageError("--from and --limit must not be negative")
    entries = await ledger.entries(args.start, args.limit, kind=args.kind, run=args.run_id)
    if args.json:
        _print_json([_entry_json(e) for e in entries])
        return 0
    for e in entries:
        parent = "" if e.parent is None else f" parent={e.parent}"
        run = "" if e.run is None else f" run={e.run}"
        body = "" if e.body is None else f" body={e.body[:12]}"
        print(f"{e.seq:>8}  {_time(e.ts)}  {e.actor:<12} {e.kind}{run}{parent}{body}")
    return 0


async def _get(ledger: Ledger, args: argparse.Namespace) -> int:
    entry = await ledger.get(args.seq)
    body: Any = None
    state = None
    if entry.body is not None:
        state = ledger.body_state(entry.body)
        body = await ledger.body(entry.body)
    if args.json:
        _print_json({"entry": _entry_json(entry), "body": body, "body_state": state})
        return 0
    print(entry.line().decode())
    print(f"hash {entry.hash}")
    if state == "present":
        print(json.dumps(body, indent=2, ensure_ascii=False))
    elif state is not None:
        print(f"body {state}")
    return 0


async def _inclusion(ledger: Ledger, args: argparse.Namespace) -> int:
    proof = await ledger.inclusion_proof(args.seq, args.size)
    if args.json:
        _print_json(proof.model_dump())
    else:
        print(f"leaf {proof.leaf_index} of {proof.tree_size}, root {proof.root}")
        print(f"leaf hash {ledger.leaf_hash(proof.leaf_index)}")
        for node in proof.path:
            print(f"  {node}")
    return 0


async def _consistency(ledger: Ledger, args: argparse.Namespace) -> int:
    proof = await ledger.consistency_proof(args.old, args.new)
    if args.json:
        _print_json(proof.model_dump())
    else:
        print(f"{proof.old_size} -> {proof.new_size}")
        print(f"old root {proof.old_root}\nnew root {proof.new_root}")
        for node in proof.path:
            print(f"  {node}")
    return 0


async def _checkpoint(ledger: Ledger, args: argparse.Namespace) -> int:
    latest = ledger.latest_checkpoint()
    if latest is None:
        print("tally ledger: no checkpoint yet", file=sys.stderr)
        return 1
    verified = False
    vkey = ledger.vkey
    if vkey is not None:
        try:
            verify_note(latest.note, vkey)
            verified = True
        except CheckpointError:
            verified = False
    if args.json:
        _print_json({**latest.model_dump(), "verified": verified, "vkey": vkey})
    else:
        sys.stdout.write(latest.note)
        if not verified:
            print("WARNING: the signature does not verify against checkpoint.vkey")
    return 0 if verified else 1
