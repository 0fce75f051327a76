"""`tally ledger …`: offline inspection and verification of a state dir's ledger.

These commands open the ledger read-only (no lock, no writes: not a byte of the state dir
changes, whatever they find), so they work on a copy of the state dir or beside a running
daemon. Exit codes: 0 ok, 1 check failed, 2 usage error. Whatever breaks, the answer is one
line naming the seq where there is one, never a traceback.
One file (past 500 lines): the `ledger` command group, each subcommand a parser and a printer.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

from daemon import layout
from daemon.errors import TallyError

if TYPE_CHECKING:
    from daemon.ledger import Entry, Ledger, LedgerCorrupt, VerifyReport

Command: TypeAlias = "Callable[[Ledger, argparse.Namespace], Awaitable[int]]"


class UsageError(Exception):
    """Bad arguments or an unusable input file: exit 2."""


class _Parser(argparse.ArgumentParser):
    """Reports its usage errors as `{"error": …}` on stdout when `--json` is among the args.

    `tally ledger` subcommands are built with this class (`parser_class=`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._argv: list[str] = []

    def parse_known_args(  # type: ignore[override]
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._argv = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:  # said here, not by the top-level parser, which cannot answer in JSON
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        if "--json" in self._argv:
            _print_json({"error": {"code": "usage", "message": f"{self.prog}: {message}"}})
            sys.exit(2)
        super().error(message)


def _fail(args: argparse.Namespace, code: str, message: str, exit_code: int) -> int:
    """One error: `{"error": {"code", "message"}}` on stdout with --json, else a line on stderr."""
    if getattr(args, "json", False):
        _print_json({"error": {"code": code, "message": message}})
    else:
        print(f"tally ledger: {message}", file=sys.stderr)
    return exit_code


def register(commands: argparse._SubParsersAction[Any]) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--state",
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="state dir (default: $TALLY_STATE_DIR, $STATE_DIRECTORY, $XDG_STATE_HOME/tally)",
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument(
        "--ledger",
        metavar="URL",
        default=argparse.SUPPRESS,
        help="a shared record on PostgreSQL (postgresql://…; default: $TALLY_LEDGER, else "
        "the state dir's file ledger)",
    )
    group = commands.add_parser("ledger", help="inspect and verify the ledger (offline)")
    group.add_argument("--state", metavar="DIR", default=None, help=argparse.SUPPRESS)
    sub = group.add_subparsers(
        dest="ledger_command", metavar="COMMAND", required=True, parser_class=_Parser
    )

    verify = sub.add_parser("verify", parents=[common], help="check chain, tree and checkpoints")
    verify.add_argument(
        "--deep",
        action="store_true",
        help="also re-hash every body and check it against its kind's schema",
    )
    verify.add_argument(
        "--since",
        metavar="CHECKPOINT_FILE",
        help="prove consistency from a saved checkpoint (the note, or `checkpoint --json` output)",
    )
    verify.add_argument(
        "--remote",
        action="store_true",
        help="also prove the calls other tally daemons answered are in their ledgers",
    )
    verify.add_argument(
        "--roster", metavar="FILE", help="--remote: the roster with their keys (default: ours)"
    )
    verify.add_argument(
        "--cosigner",
        dest="cosigners",
        action="append",
        default=[],
        metavar="NAME=KEY",
        help="require cosignatures: a cosigner you trust and its verifier key (repeatable)",
    )
    verify.add_argument(
        "--quorum", type=int, metavar="N", help="--cosigner: how many must verify (default 1)"
    )
    verify.add_argument(
        "--cosigned",
        metavar="FILE",
        help="--cosigner: the cosigned checkpoint (the note, or `ledger_cosigned` JSON); "
        "default: the one the daemon collected in the state dir",
    )
    verify.add_argument(
        "--max-age", type=float, metavar="SECONDS", help="--cosigner: refuse older cosignatures"
    )
    verify.add_argument(
        "--trust-record-keys",
        action="store_true",
        help="--ledger URL: count the cosignatures of every daemon whose key the record "
        "itself holds (whoever can write the database can add one: prefer --cosigner)",
    )
    verify.set_defaults(run=_runner(_verify, tail_check=0, reports=True))

    show = sub.add_parser("show", parents=[common], help="list entries")
    where = show.add_mutually_exclusive_group()
    where.add_argument("--from", dest="start", type=int, default=0, metavar="N")
    where.add_argument("--tail", type=int, metavar="N", help="the last N (matching) entries")
    show.add_argument("--limit", type=int, default=None, metavar="N", help="default: 20")
    show.add_argument("--kind")
    show.add_argument("--run", dest="run_id")
    show.set_defaults(run=_runner(_show))

    get = sub.add_parser("get", parents=[common], help="one entry and its body")
    get.add_argument("seq", type=int, metavar="SEQ")
    get.set_defaults(run=_runner(_get))

    proof = sub.add_parser("proof", help="RFC 9162 proofs")
    kinds = proof.add_subparsers(
        dest="proof_kind", metavar="KIND", required=True, parser_class=_Parser
    )
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

    export = sub.add_parser(
        "export",
        parents=[common],
        help="write a shared record as a file ledger's layout, for file verifiers",
    )
    export.add_argument("dir", metavar="DIR", help="a new directory (DIR/ledger is written)")
    export.set_defaults(run=_runner(_export))

    schema = sub.add_parser(
        "schema", help="the JSON Schema (2020-12) of every entry kind, keyed by kind"
    )
    schema.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # always JSON
    schema.set_defaults(run=_schema)

    from surfaces.cli.reading import register_summary  # stdlib only at import, as this module

    register_summary(sub)


def _runner(
    command: Command, tail_check: int | None = None, reports: bool = False
) -> Callable[[argparse.Namespace], int]:
    """Wrap a command: open the ledger read-only, map every error to one message and a code.

    `reports`: a corrupt ledger is the command's answer (a failed verify report), not an error.
    """

    def run(args: argparse.Namespace) -> int:
        import asyncio
        import os

        from daemon.config import default_state_dir
        from daemon.ledger import LedgerCorrupt

        state = Path(args.state) if args.state else default_state_dir()
        args.ledger = getattr(args, "ledger", None) or os.environ.get("TALLY_LEDGER") or None
        if args.ledger is not None:
            return _shared_runner(command, args)
        if command is _export:
            return _fail(args, "usage", "export reads a shared record: give --ledger URL", 2)
        if not (state / layout.LEDGER).is_dir():
            return _fail(args, "no_ledger", f"no ledger in {state}", 2)
        try:
            if getattr(args, "since", None):
                try:
                    args.since_text = Path(args.since).read_text()
                except (OSError, UnicodeDecodeError) as err:
                    raise UsageError(f"cannot read checkpoint {args.since}: {err}") from err
            return asyncio.run(_with_ledger(state, command, args, tail_check))
        except UsageError as err:
            return _fail(args, "usage", str(err), 2)
        except LedgerCorrupt as err:
            report = _corrupt_report(state, err)
            if not reports:
                message = f"ledger corrupt at seq {report.first_bad_seq}: {report.reason}"
                return _fail(args, err.code, message + " (see `tally ledger verify`)", 1)
            _emit_report(args, report, None, {"entries": report.size, "deep": False})
            return 1
        except TallyError as err:
            return _fail(args, err.code, err.message, 2 if err.status == 422 else 1)
        except OSError as err:
            return _fail(args, "os_error", str(err), 1)
        except Exception as err:  # a damaged ledger we did not foresee: an answer, not a trace
            return _unforeseen(args, state, err, reports)

    return run


def _shared_runner(command: Command, args: argparse.Namespace) -> int:
    """`--ledger postgresql://…`: the same commands on the shared record, read-only (from any
    machine that reaches the database; no state dir)."""
    import asyncio

    from daemon.ledger.postgres import check_dsn

    async def run() -> int:
        from daemon.ledger.shared import SharedLedger

        ledger = await SharedLedger.open_shared(check_dsn(args.ledger), None, readonly=True)
        try:
            return await command(ledger, args)
        finally:
            await ledger.close()

    try:
        if getattr(args, "since", None):
            try:
                args.since_text = Path(args.since).read_text()
            except (OSError, UnicodeDecodeError) as err:
                raise UsageError(f"cannot read checkpoint {args.since}: {err}") from err
        return asyncio.run(run())
    except UsageError as err:
        return _fail(args, "usage", str(err), 2)
    except TallyError as err:
        return _fail(args, err.code, err.message, 2 if err.status == 422 else 1)
    except OSError as err:
        return _fail(args, "os_error", str(err), 1)


async def _export(ledger: Ledger, args: argparse.Namespace) -> int:
    from daemon.ledger.shared import SharedLedger

    assert isinstance(ledger, SharedLedger)
    done = await ledger.export(Path(args.dir))
    if args.json:
        _print_json(done)
    else:
        print(f"exported {done['entries']} entries to {done['dir']}")
        if done["checkpoint"] is not None:
            cp = done["checkpoint"]
            print(f"  checkpoint: size {cp['size']}, signed by {cp['daemon']}")
        print(f"  check it:   tally ledger verify --deep --state {args.dir}")
    return 0


def _unforeseen(args: argparse.Namespace, state: Path, err: Exception, reports: bool) -> int:
    """An error no check named: verify still names the first seq it can (the entries walked
    on their own), every command says what broke; exit 1."""
    what = f"{type(err).__name__}: {err}"
    if not reports:
        return _fail(
            args, "unreadable", f"cannot read the ledger ({what}); see `tally ledger verify`", 1
        )
    from daemon.ledger import VerifyReport
    from daemon.ledger.audit import scan_entries

    try:
        scan = scan_entries(state / layout.LEDGER / layout.ENTRIES)
        seq, reason = scan.first_bad_seq, scan.reason
        if seq is None:
            seq, reason = scan.intact, "the entries up to it chain; the error is elsewhere"
    except Exception:
        seq, reason = 0, "the entries file cannot be walked either"
    report = VerifyReport(
        ok=False, size=seq, root="", first_bad_seq=seq, reason=f"{reason} (verify stopped: {what})"
    )
    _emit_report(args, report, None, {"entries": report.size, "deep": False})
    return 1


async def _with_ledger(
    state: Path, command: Command, args: argparse.Namespace, tail_check: int | None
) -> int:
    from daemon.ledger import Ledger

    extra = {} if tail_check is None else {"tail_check": tail_check}
    ledger = await Ledger.open(state, readonly=True, **extra)
    note = ledger.record_note
    if note is not None and command is not _verify:  # verify reports it in its verdict
        print(f"tally ledger: warning: {note}", file=sys.stderr)
    try:
        return await command(ledger, args)
    finally:
        await ledger.close()


def _corrupt_report(state: Path, err: LedgerCorrupt) -> VerifyReport:
    """The ledger would not open: walk the entries file to name the first missing/broken seq.

    `size` is the number of entries that were intact before it.
    """
    from daemon.ledger import VerifyReport
    from daemon.ledger.audit import scan_entries

    seq, reason = err.seq, err.reason
    try:
        scan = scan_entries(state / layout.LEDGER / layout.ENTRIES)
    except OSError:
        scan = None
    if scan is not None and scan.first_bad_seq is not None and scan.first_bad_seq <= seq:
        seq, reason = scan.first_bad_seq, scan.reason or reason
    elif scan is not None and scan.first_bad_seq is None and scan.intact <= seq:
        # The entries still there chain correctly; those after them are gone.
        seq = scan.intact
        reason = f"entries from seq {seq} on are missing: the entries file ends there ({reason})"
    return VerifyReport(ok=False, size=seq, root="", first_bad_seq=seq, reason=reason)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


def _emit_report(
    args: argparse.Namespace,
    report: VerifyReport,
    since: dict[str, Any] | None,
    checked: dict[str, Any],
) -> None:
    if getattr(args, "json", False):
        out = {**report.model_dump(), "checked": checked}
        if since is not None:
            out["since"] = since
        _print_json(out)
        return
    for line in _report_lines(report, since, checked):
        print(line)


def _report_lines(
    report: VerifyReport, since: dict[str, Any] | None, checked: dict[str, Any]
) -> list[str]:
    """The verdict first, then what was checked, so an `ok` says what it vouches for."""
    n = report.size
    if _broken(report):
        lines = [f"FAILED at seq {report.first_bad_seq}: {report.reason}"]
        if n > 1:
            intact = f"entries 0..{n - 1} intact before it"
        else:
            intact = "entry 0 intact before it" if n else "no entry before it"
        lines.append(f"  checked:    {intact}")
    else:
        lines = [f"{'ok' if report.ok else 'FAILED'}: {n} {_plural(n, 'entry', 'entries')}"]
        lines.append("  chain:      every prev link and leaf hash re-computed from the entries")
        if any(p.startswith("tree/") for p in report.derived):
            lines.append(f"  merkle:     root {report.root} (recomputed from the entries)")
        else:
            lines.append(f"  merkle:     root {report.root} (matches the stored tree)")
        latest = checked.get("checkpoint")
        if latest is None:
            lines.append("  checkpoint: none yet (nothing to compare the root with)")
        else:
            lines.append(
                f"  checkpoint: latest, size {latest['size']} (signature {latest['signature']}):"
                " its root matches the tree at that size"
            )
        if checked.get("deep"):
            lines.append(
                f"  bodies:     re-hashed (--deep): {len(report.redacted)} redacted, "
                f"{len(report.tampered)} tampered"
            )
        else:
            lines.append("  bodies:     not re-hashed (add --deep)")
        if checked.get("schemas") is not None:
            lines.extend(_schema_lines(checked["schemas"]))
    lines.extend(f"WARNING: {warning}" for warning in report.warnings)
    if report.derived:
        lines.append(
            "DERIVED files do not match the entries (caches: the entries are intact; the daemon "
            "rebuilds them when it opens the ledger, serves a proof or verifies):"
        )
        lines.extend(f"  {problem}" for problem in report.derived)
    if report.redacted:
        lines.append(f"redacted bodies ({len(report.redacted)}): " + ", ".join(report.redacted))
    if report.tampered:
        lines.append(f"TAMPERED bodies ({len(report.tampered)}):")
        for body in report.tampered:
            why = report.tampered_why.get(body)
            lines.append(f"  {body}" + (f": {why}" if why else ""))
        if report.first_bad_seq is not None:
            lines.append(f"first entry with a tampered body: seq {report.first_bad_seq}")
    if since is not None:
        verdict = "consistent" if since["consistent"] else "NOT consistent"
        lines.append(
            f"  since:      {since['file']}, size {since['size']} ({since['signature']} "
            f"signature): {verdict} with the ledger at size {n}"
        )
    return lines


def _schema(args: argparse.Namespace) -> int:
    """The record's vocabulary as `GET /v1/record/schema` publishes it (no ledger is read)."""
    from daemon.record import document

    _print_json(document())
    return 0


def _schema_lines(found: dict[str, Any]) -> list[str]:
    """--deep: the bodies against their kinds' published schemas."""
    lines = [
        f"  schemas:    {found['checked']} present bodies checked against their kind's schema "
        f"(`tally ledger schema`): {found['mismatches']} do not fit"
    ]
    for miss in found["first"]:
        lines.append(f"SCHEMA MISMATCH at seq {miss['seq']} ({miss['kind']}):")
        lines.extend(f"  {error}" for error in miss["errors"])
    if found["mismatches"] > len(found["first"]):
        lines.append(f"  ... and {found['mismatches'] - len(found['first'])} more")
    if found["unknown"]:
        kinds = ", ".join(f"{kind} ({n})" for kind, n in found["unknown"].items())
        lines.append(f"  unknown kinds (not tally's, not checked): {kinds}")
    return lines


def _plural(n: int, one: str, many: str) -> str:
    return one if n == 1 else many


def _signature(note: str, vkey: str | None) -> str:
    from daemon.ledger import CheckpointError, verify_note

    if vkey is None:
        return "unchecked (no checkpoint.vkey)"
    try:
        verify_note(note, vkey)
    except CheckpointError:
        return "INVALID"
    return "valid"


def _note_text(name: str, text: str) -> str:
    """A saved checkpoint: the note itself, or what `tally ledger checkpoint --json` printed."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        saved = json.loads(text)
    except (ValueError, RecursionError) as err:  # nested past json's limit: not a checkpoint
        raise UsageError(f"cannot read checkpoint {name}: not JSON: {err}") from err
    note = saved.get("note") if isinstance(saved, dict) else None
    if not isinstance(note, str):
        raise UsageError(f'cannot read checkpoint {name}: JSON without a "note" string')
    return note


async def _verify(ledger: Ledger, args: argparse.Namespace) -> int:
    import asyncio

    from daemon.ledger import CheckpointError, parse_note

    since = None
    pinned = None
    if args.since:
        text = _note_text(args.since, args.since_text)
        try:
            pinned = parse_note(text)
        except CheckpointError as err:
            raise UsageError(f"cannot read checkpoint {args.since}: {err}") from err
        signature = _signature(text, ledger.vkey)
        since = {
            "file": args.since,
            "size": pinned.size,
            "root": pinned.root,
            "signature": signature,
        }
    report = _vouched(await ledger.verify(deep=args.deep))
    from daemon.runs.snapshot import check as check_snapshot  # derived: a warning, not a fault

    stale = None
    if not getattr(ledger, "shared", False):  # a shared record has no run snapshot
        stale = await asyncio.to_thread(check_snapshot, ledger.state_dir, ledger)
    if stale is not None:
        report = report.model_copy(update={"warnings": [*report.warnings, stale]})
    if pinned is not None and since is not None:
        consistent = False
        if not _broken(report):
            consistent = pinned.size <= report.size and await _consistent(
                ledger, pinned.size, pinned.root
            )
        consistent = consistent and since["signature"] != "INVALID"
        since["consistent"] = consistent
        if not consistent:
            report = report.model_copy(update={"ok": False})
    latest = ledger.latest_checkpoint()
    checked: dict[str, Any] = {"entries": report.size, "deep": args.deep, "checkpoint": None}
    if latest is not None:
        checked["checkpoint"] = {
            "size": latest.size,
            "root": latest.root,
            "signature": _signature(latest.note, ledger.vkey),
        }
    if args.deep:
        from daemon.record import KINDS
        from daemon.record.conformance import conformance

        found = await conformance(ledger, KINDS)
        checked["schemas"] = found.model_dump()
        if not found.ok:
            report = report.model_copy(update={"ok": False})
    if getattr(args, "remote", False):
        checked["remote"] = await _remote(ledger, args)
    if getattr(ledger, "shared", False):
        if args.cosigners or args.quorum is not None or args.trust_record_keys:
            checked["cosigned"] = await _cosigned_shared(ledger, args, report)
    elif getattr(args, "cosigners", None) or getattr(args, "quorum", None) is not None:
        checked["cosigned"] = await _cosigned(ledger, args, report)
    _emit_report(args, report, since, checked)
    if checked.get("remote") and not getattr(args, "json", False):
        _print_remote(checked["remote"])
    if checked.get("cosigned") and not getattr(args, "json", False):
        _print_cosigned(checked["cosigned"])
    remote_ok = not checked.get("remote") or checked["remote"]["failed"] == 0
    cosigned_ok = not checked.get("cosigned") or checked["cosigned"]["ok"]
    return 0 if report.ok and remote_ok and cosigned_ok else 1


def _cosigners(args: argparse.Namespace) -> tuple[dict[str, str], int]:
    """The `--cosigner NAME=KEY` list and the quorum, or UsageError naming what is wrong."""
    from daemon.ledger.cosign import CosignError, parse_cosigner_vkey

    cosigners: dict[str, str] = {}
    for given in args.cosigners:
        name, sep, key = given.partition("=")
        if not sep or not name or not key:
            raise UsageError(f"--cosigner {given!r}: expected NAME=KEY (KEY a verifier key)")
        if name in cosigners:
            raise UsageError(f"--cosigner {name!r} is given twice")
        try:
            parse_cosigner_vkey(key)
        except CosignError as err:
            raise UsageError(f"--cosigner {name}: {err}") from err
        cosigners[name] = key
    if not cosigners:
        raise UsageError("--quorum needs at least one --cosigner NAME=KEY")
    quorum = 1 if args.quorum is None else args.quorum
    if not 1 <= quorum <= len(cosigners):
        raise UsageError(
            f"--quorum {quorum} can never be met by {len(cosigners)} listed cosigner(s)"
        )
    return cosigners, quorum


async def _cosigned(
    ledger: Ledger, args: argparse.Namespace, report: VerifyReport
) -> dict[str, Any]:
    """`--cosigner`: a quorum of cosignatures on a checkpoint of this very ledger."""
    import asyncio

    from daemon.ledger.cosign import verify_quorum

    cosigners, quorum = _cosigners(args)
    from daemon.cosigning import cosigned_path

    source = Path(args.cosigned) if args.cosigned else cosigned_path(ledger)
    try:
        text = await asyncio.to_thread(source.read_text)
    except (OSError, UnicodeDecodeError) as err:
        if args.cosigned:
            raise UsageError(f"cannot read cosigned checkpoint {source}: {err}") from err
        text = None
    if text is None:
        out: dict[str, Any] = {"ok": False, "quorum": quorum, "verified": 0, "results": []}
        out["reason"] = f"no cosigned checkpoint in {source} (the daemon collects it)"
        out["file"] = str(source)
        return out
    note = _note_text(str(source), text)
    result = verify_quorum(
        note, cosigners, quorum, origin_vkey=ledger.vkey, max_age_s=args.max_age
    ).model_dump()
    result["file"] = str(source)
    size, root = result["size"], result["root"]
    if ledger.vkey is None and result["ok"]:
        result["ok"] = False
        result["reason"] = "no checkpoint.vkey: the origin's signature cannot be checked"
    if size is not None and root is not None:
        consistent = (
            not _broken(report) and size <= report.size and await _consistent(ledger, size, root)
        )
        result["consistent"] = consistent
        if not consistent and result["ok"]:
            result["ok"] = False
            result["reason"] = (
                f"the cosigned checkpoint (size {size}) is not consistent with this ledger: "
                "its root is not the tree's at that size"
            )
    return result


async def _cosigned_shared(
    ledger: Ledger, args: argparse.Namespace, report: VerifyReport
) -> dict[str, Any]:
    """`--ledger URL --quorum N`: a quorum of cosignatures, read from the record's
    `tally_cosignatures`, on its largest cosigned checkpoint (or on `--cosigned FILE`).

    Secure by default: the cosigners counted are the ones named with `--cosigner NAME=KEY`; the
    keys the record holds (each witnessed by its daemon's `ledger.join` entry) count only with
    `--trust-record-keys`, since whoever can write the database could add a daemon of its own.
    The origin's own signature never counts toward the quorum: a quorum of N is N daemons
    other than the one that signed the checkpoint."""
    import asyncio

    from daemon.ledger.cosign import same_key, verify_quorum
    from daemon.ledger.shared import SharedLedger

    assert isinstance(ledger, SharedLedger)
    cosigners: dict[str, str] = {}
    if args.cosigners:
        cosigners, _ = _cosigners(argparse.Namespace(cosigners=args.cosigners, quorum=None))
    elif not args.trust_record_keys:
        raise UsageError(
            "--quorum on a shared record needs the cosigners you trust: --cosigner NAME=KEY "
            "(each daemon's `tally ledger key`), or --trust-record-keys to trust the keys the "
            "record holds"
        )
    keys = await ledger.joined_keys()
    quorum = 1 if args.quorum is None else args.quorum
    if args.cosigned:
        source = args.cosigned
        try:
            text = await asyncio.to_thread(Path(args.cosigned).read_text)
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"cannot read cosigned checkpoint {args.cosigned}: {err}") from err
        note: str | None = _note_text(args.cosigned, text)
        daemon = None
    else:
        source = "the record's tally_cosignatures"
        found = await ledger.latest_cosigned()
        daemon, note = (None, None) if found is None else (found[0], found[2])
    out: dict[str, Any] = {"ok": False, "quorum": quorum, "verified": 0, "results": []}
    out["file"] = source
    if note is None:
        out["reason"] = "no checkpoint in the record carries a cosignature yet"
        return out
    from daemon.ledger import CheckpointError, parse_note

    try:
        origin = parse_note(note).origin
    except CheckpointError as err:
        out["reason"] = f"not a checkpoint note: {err}"
        return out
    if daemon is not None and origin != daemon:
        out["reason"] = f"the checkpoint stored as {daemon}'s names another origin ({origin})"
        return out
    if args.trust_record_keys:
        for name, vkey in keys.items():
            listed = any(same_key(vkey, mine) for mine in cosigners.values())
            if name != origin and not listed and name not in cosigners:
                cosigners[name] = vkey
    if not cosigners or not 1 <= quorum <= len(cosigners):
        raise UsageError(
            f"--quorum {quorum} can never be met by {len(cosigners)} cosigner(s) "
            f"(the origin, {origin}, does not count)"
        )
    result = verify_quorum(
        note, cosigners, quorum, origin_vkey=keys.get(origin), max_age_s=args.max_age
    ).model_dump()
    result["file"] = source
    if origin not in keys and result["ok"]:
        result["ok"] = False
        result["reason"] = f"the origin {origin} has no key witnessed in the record"
    size, root = result["size"], result["root"]
    if size is not None and root is not None:
        consistent = (
            not _broken(report) and size <= report.size and await _consistent(ledger, size, root)
        )
        result["consistent"] = consistent
        if not consistent and result["ok"]:
            result["ok"] = False
            result["reason"] = (
                f"the cosigned checkpoint (size {size}) is not the record's tree at that size"
            )
    return result


def _print_cosigned(result: dict[str, Any]) -> None:
    for r in result["results"]:
        when = f" at {r['timestamp']}" if r.get("timestamp") is not None else ""
        why = f": {r['reason']}" if r.get("reason") else ""
        print(f"  cosigner {r['cosigner']}: {r['status']}{when}{why}")
    size = result.get("size")
    where = f"size {size}" if size is not None else result.get("file", "")
    verdict = "ok" if result["ok"] else f"FAILED: {result.get('reason')}"
    print(
        f"  cosigned:   {where}, {result['verified']} of {len(result['results'])} cosigners "
        f"verified, quorum {result['quorum']}: {verdict}"
    )


async def _remote(ledger: Ledger, args: argparse.Namespace) -> dict[str, Any]:
    """`--remote`: each call a `tally = true` member answered, proven in that daemon's ledger."""
    from daemon.remotes import verify_remote
    from roster import RosterError, load_roster
    from roster.loading import default_roster_path

    path = Path(args.roster) if args.roster else default_roster_path()
    try:
        roster = load_roster(path)
    except RosterError as err:
        raise UsageError(str(err)) from err
    return (await verify_remote(ledger, roster)).model_dump()


def _print_remote(report: dict[str, Any]) -> None:
    for r in report["results"]:
        where = f"seq {r['seq']} -> {r['member']} seq {r['remote_seq']}"
        print(f"  remote {r['status']}: {where}" + (f" ({r['reason']})" if r["reason"] else ""))
    print(
        f"  remote:     {report['checked']} calls checked, {report['ok']} ok, "
        f"{report['failed']} failed, {report['pending']} pending"
    )


def _broken(report: VerifyReport) -> bool:
    """The chain or tree is broken (not merely some bodies tampered)."""
    from daemon.ledger.audit import TAMPERED_BODIES

    return report.first_bad_seq is not None and report.reason != TAMPERED_BODIES


def _vouched(report: VerifyReport) -> VerifyReport:
    """A broken ledger's report, sized to what it vouches for: the entries before the bad one.

    `Ledger.verify` reports the ledger's size; the CLI's `size` and `checked.entries` are the
    entries found intact, the same as when the ledger would not even open (`_corrupt_report`).
    """
    if _broken(report):
        return report.model_copy(update={"size": report.first_bad_seq})
    return report


async def _consistent(ledger: Ledger, old: int, old_root: str) -> bool:
    from daemon.ledger.merkle import verify_consistency

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
    if args.start < 0 or (args.limit is not None and args.limit < 0):
        raise UsageError("--from and --limit must not be negative")
    if args.tail is not None:
        if args.tail < 0:
            raise UsageError("--tail must not be negative")
        if args.limit is not None:
            raise UsageError("--tail N already says how many; leave out --limit")
        entries = await _tail(ledger, args.tail, kind=args.kind, run=args.run_id)
    else:
        limit = 20 if args.limit is None else args.limit
        entries = await ledger.entries(args.start, limit, kind=args.kind, run=args.run_id)
    if args.json:
        _print_json([_entry_json(e) for e in entries])
        return 0
    for e in entries:
        parent = "" if e.parent is None else f" parent={e.parent}"
        run = "" if e.run is None else f" run={e.run}"
        body = "" if e.body is None else f" body={e.body[:12]}"
        print(f"{e.seq:>8}  {_time(e.ts)}  {e.actor:<12} {e.kind}{run}{parent}{body}")
    return 0


async def _tail(ledger: Ledger, n: int, kind: str | None, run: str | None) -> list[Entry]:
    """The last `n` entries matching the filters, oldest first.

    Entries are only scanned forwards, so look back over a window that grows 4x until it holds
    `n` matches or reaches seq 0: at most ~4/3 of one full scan.
    """
    size = ledger.size
    if n == 0 or size == 0:
        return []
    window = n if kind is None and run is None else max(n, 4096)
    while True:
        start = max(0, size - window)
        found = await ledger.entries(start, size - start, kind=kind, run=run)
        if len(found) >= n or start == 0:
            return found[-n:]
        window *= 4


async def _get(ledger: Ledger, args: argparse.Namespace) -> int:
    entry = await ledger.get(args.seq)
    body: Any = None
    state = None
    if entry.body is not None:
        state, body = await ledger.body(entry.body)
    if args.json:
        _print_json({"entry": _entry_json(entry), "body": body, "body_state": state})
        return 1 if state in ("tampered", "missing") else 0
    print(entry.line().decode())
    print(f"hash {entry.hash}")
    if state == "present":
        print(json.dumps(body, indent=2, ensure_ascii=False))
    elif state == "tampered":
        print(f"body TAMPERED: the stored bytes do not hash to {entry.body}")
    elif state == "missing":
        print(f"body MISSING: no stored body for {entry.body}")
    elif state is not None:
        print(f"body {state}")
    return 1 if state in ("tampered", "missing") else 0


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
    from daemon.ledger import CheckpointError, verify_note

    latest = ledger.latest_checkpoint()
    if latest is None:
        return _fail(args, "no_checkpoint", "no checkpoint yet", 1)
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
