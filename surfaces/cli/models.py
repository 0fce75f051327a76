"""`tally models scan | add`: find the model servers on this machine, and put one in a roster.

    tally models scan                      # Ollama, llama-server, LM Studio, vLLM on 127.0.0.1
    tally models add --url http://127.0.0.1:11434/v1 --model qwen2.5:7b \\
        --roster ~/.config/tally/roster.toml
    tally doctor --roster ~/.config/tally/roster.toml

`add` without `--tier` makes the model the one every lane starts on: it goes into each tier a
lane names, and into every tier that held only the embedded demo model, which then runs no
more (`roster.edits.start_tiers`); `--tier NAME` puts it in that tier only, `--no-tier` in none.
For a `--url` server, `add` asks it (as `scan` does) how many slots and how much context per
slot it has, and writes those unless `--slots`/`--ctx` say otherwise.

`scan` probes only loopback unless given `--url`. `add` keeps the roster's comments (it edits
the text) unless it cannot, in which case it regenerates the file and says so; a roster file
that does not exist yet starts as a copy of the packaged default.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

# The embedded server, as the default roster runs it; `--llama-server` swaps in the binary.
LAUNCHER = [
    "{python}", "-m", "daemon.slots.launcher", "--model", "{model}", "--host", "127.0.0.1",
    "--port", "{port}", "--parallel", "{slots}", "--ctx-size", "{ctx}", "--threads", "2",
]  # fmt: skip
LLAMA_SERVER = [
    "llama-server", "--model", "{model}", "--host", "127.0.0.1", "--port", "{port}",
    "--parallel", "{slots}", "--ctx-size", "{ctx}", "--jinja",
]  # fmt: skip


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser("models", help="find model servers and add them to a roster")
    sub = parser.add_subparsers(dest="models_command", metavar="SUBCOMMAND", required=True)

    scan = sub.add_parser(
        "scan",
        help="list the OpenAI-compatible servers answering on loopback (and --url)",
        description="Probes 127.0.0.1 on the usual ports (Ollama 11434, llama-server 8080, "
        "LM Studio 1234, vLLM 8000) and every --url, at once, through /v1/models.",
    )
    scan.add_argument("--url", action="append", default=[], help="also probe this server")
    scan.add_argument(
        "--port",
        type=int,
        action="append",
        default=None,
        help="probe these loopback ports instead of the usual ones",
    )
    scan.add_argument("--timeout", type=float, default=1.5, help="seconds per request")
    scan.add_argument("--json", action="store_true", help="print a JSON object")
    scan.set_defaults(run=run_scan)

    add = sub.add_parser(
        "add",
        help="add a member (an external URL or a local .gguf) to a roster, and to a tier",
        description="Writes the member into the roster file (atomically, keeping comments "
        "where it can), then prints `tally roster check` of the result.",
    )
    source = add.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="an OpenAI-compatible server (Ollama, llama-server, …)")
    source.add_argument("--gguf", type=Path, help="a model file tally runs itself")
    add.add_argument("--model", help="the model id the server knows (with --url)")
    add.add_argument("--name", help="member name (default: from the model)")
    placing = add.add_mutually_exclusive_group()
    placing.add_argument(
        "--tier",
        help="put it in this tier only (a new tier tops the ladder); default: every lane "
        "starts on it",
    )
    placing.add_argument(
        "--no-tier", action="store_true", help="add it to no tier (no lane uses it yet)"
    )
    add.add_argument(
        "--keep",
        action="store_true",
        help="keep the tier's members after it (as failover) instead of replacing them",
    )
    add.add_argument(
        "--slots", type=int, help="concurrent requests (default: what the server says, else 1; 2)"
    )
    add.add_argument(
        "--ctx", type=int, help="context per slot (default: what the server says, else 4096)"
    )
    add.add_argument("--timeout", type=float, default=3.0, help="seconds to ask a --url server")
    add.add_argument(
        "--no-probe",
        action="store_true",
        help="do not ask the --url server its slots and context (write --slots/--ctx or defaults)",
    )
    add.add_argument("--api-key-env", help="environment variable holding the server's key")
    add.add_argument(
        "--llama-server", action="store_true", help="run --gguf with llama-server from PATH"
    )
    add.add_argument("--roster", type=Path, help="the roster file (default: $TALLY_ROSTER)")
    add.add_argument("--replace", action="store_true", help="replace a member of that name")
    add.add_argument("--dry-run", action="store_true", help="print the change, write nothing")
    add.set_defaults(run=run_add)


# ----------------------------------------------------------------------------- scan


def run_scan(args: argparse.Namespace) -> int:
    import asyncio

    from daemon.slots.discovery import scan, scan_targets

    try:
        targets = scan_targets(args.port, args.url)
    except ValueError as err:
        print(f"tally models scan: {err}", file=sys.stderr)
        return 2
    if args.timeout <= 0 or any(not 0 < p < 65536 for p in args.port or []):
        print("tally models scan: --timeout must be positive, ports 1-65535", file=sys.stderr)
        return 2
    found = asyncio.run(scan(targets, args.timeout))
    live = [f for f in found if f.found]
    if args.json:
        print(json.dumps({"servers": [f.model_dump(mode="json") for f in found]}, indent=2))
        return 0 if live else 1
    for f in live:
        where = f"{f.url}" + (f"  ({f.usual}?)" if f.usual and f.kind != "llama.cpp" else "")
        print(f"{where}\n  server: {f.kind}, answered in {f.latency_ms} ms")
        if f.total_slots is not None:
            print(f"  slots: {f.total_slots}, context per slot: {f.n_ctx or '?'}")
        print(f"  models: {', '.join(f.models) or '(none listed)'}")
    quiet = [f for f in found if not f.found]
    if quiet:
        print("nothing usable on: " + ", ".join(_quiet(f) for f in quiet))
    if not live:
        print("no OpenAI-compatible server found; start one (ollama serve, llama-server …)")
        return 1
    first = live[0]
    model = first.models[0] if first.models else "MODEL"
    print(f"\nnext: tally models add --url {first.url} --model {model} --roster FILE")
    print("      (every lane then starts on it; --tier NAME puts it in one tier only)")
    return 0


def _quiet(found: Any) -> str:
    label = f" ({found.usual})" if found.usual else ""
    problem = str(found.problem or "")
    why = "refused" if "refused" in problem else problem.rsplit(": ", 1)[-1][:60]
    return f"{found.url.removesuffix('/v1')}{label} [{why}]"


# ----------------------------------------------------------------------------- add


def _member_name(text: str) -> str:
    """`qwen2.5:7b` → `qwen2.5-7b`; `/m/Mistral-7B.Q4.gguf` → `mistral-7b.q4`."""
    name = re.sub(r"[^a-z0-9_.-]+", "-", text.lower()).strip("-._")
    return name[:48] or "model"


def _target(args: argparse.Namespace) -> Path | None:
    from roster import default_roster_path

    given = args.roster or (
        Path(os.environ["TALLY_ROSTER"]) if os.environ.get("TALLY_ROSTER") else None
    )
    if given is None:
        print(
            "tally models add: say which roster to write: --roster FILE (or $TALLY_ROSTER); "
            "a new file starts as a copy of the default roster",
            file=sys.stderr,
        )
        return None
    if given.expanduser().resolve() == default_roster_path().resolve():
        print(
            "tally models add: that is the packaged default roster; write a copy instead "
            "(--roster ~/.config/tally/roster.toml)",
            file=sys.stderr,
        )
        return None
    return given.expanduser()


def _member(args: argparse.Namespace) -> Any:
    """The Member the flags describe; ValueError with a message if they do not make one."""
    from pydantic import ValidationError

    from daemon.slots.discovery import normalize_url
    from roster import Member

    fields: dict[str, Any] = {}
    if args.url is not None:
        if not args.model or not args.model.strip() or not args.model.isprintable():
            raise ValueError("--url needs --model, the id the server lists (tally models scan)")
        fields = {"url": normalize_url(args.url), "model_id": args.model.strip()}
        asks = not args.no_probe and (args.slots is None or args.ctx is None)
        measured = _measure(fields["url"], args) if asks else {}
        fields["slots"] = args.slots if args.slots is not None else measured.get("slots", 1)
        if args.ctx is None and "ctx" in measured:
            fields["ctx"] = measured["ctx"]
        name = args.name or _member_name(args.model)
    else:
        gguf = args.gguf.expanduser().absolute()
        if not gguf.is_file():
            raise ValueError(f"--gguf {args.gguf}: no such file")
        command = LLAMA_SERVER if args.llama_server else LAUNCHER
        fields = {
            "command": command,
            "model": str(gguf),
            "slots": 2 if args.slots is None else args.slots,
        }
        name = args.name or _member_name(gguf.name.removesuffix(".gguf"))
    if args.model and args.url is None:
        raise ValueError("--model names a model on a --url server; --gguf is the model itself")
    if args.ctx is not None:
        fields["ctx"] = args.ctx
    if args.api_key_env:
        fields["api_key_env"] = args.api_key_env
    try:
        return Member(name=name, **fields)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'member'}: {e['msg']}" for e in err.errors()
        )
        raise ValueError(problems) from None


def _measure(url: str, args: argparse.Namespace) -> dict[str, int]:
    """The slots and context per slot the server at `url` reports (llama.cpp's /props), as
    `scan` shows them; {} when it says nothing (Ollama, vLLM) or does not answer."""
    import asyncio

    from daemon.slots.discovery import scan

    if not 0 < args.timeout <= 60:
        raise ValueError("--timeout must be between 0 and 60 seconds")
    found = asyncio.run(scan([(url, None)], args.timeout))[0]
    measured: dict[str, int] = {}
    if found.total_slots is not None:
        measured["slots"] = min(found.total_slots, 256)
    if found.n_ctx is not None and found.n_ctx >= 256:
        measured["ctx"] = min(found.n_ctx, 1 << 24)
    if measured:
        said = ", ".join(f"{k} {v}" for k, v in measured.items())
        print(f"{url} says: {said} (from its /props)")
    elif not found.found:
        print(f"{url} did not answer ({found.problem}); writing the defaults")
    return measured


def run_add(args: argparse.Namespace) -> int:
    from roster import RosterError, default_roster_path
    from roster.edits import EditRefused, add_member
    from roster.loading import write_atomic
    from surfaces.cli.roster import run_check

    path = _target(args)
    if path is None:
        return 2
    try:
        member = _member(args)
    except ValueError as err:
        print(f"tally models add: {err}", file=sys.stderr)
        return 2
    try:
        text = path.read_text() if path.exists() else default_roster_path().read_text()
    except (OSError, UnicodeDecodeError) as err:
        print(f"tally models add: cannot read {path}: {err}", file=sys.stderr)
        return 1
    try:
        added = add_member(
            text,
            str(path),
            member,
            tier=args.tier,
            mode="first" if args.keep else "only",
            replace=args.replace,
            # A new member only: replacing one's definition does not move it between tiers.
            start=args.tier is None and not args.no_tier and not args.replace,
        )
    except RosterError as err:
        print(f"tally models add: {path} is not a valid roster now:\n{err}", file=sys.stderr)
        return 1
    except EditRefused as err:
        print(f"tally models add: {err.message}", file=sys.stderr)
        return 1
    if args.dry_run:
        _print_diff(text, added.text, path)
        return 0
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, added.text)
    except OSError as err:
        print(f"tally models add: cannot write {path}: {err}", file=sys.stderr)
        return 1
    _say_what(added, member, path)
    print("roster check: ", end="", flush=True)
    code = run_check(argparse.Namespace(file=str(path), json=False))
    print(f"next: tally doctor --roster {path}   (then: tally serve --roster {path})")
    return code


def _say_what(added: Any, member: Any, path: Path) -> None:
    verb = "replaced" if added.replaced else "added"
    where = f"url {member.url}, model {member.model_id}" if member.url else f"model {member.model}"
    print(f"{verb} member {member.name!r} ({where}) in {path}")
    tier = added.tier
    if added.started:
        print(f"every lane now starts on {member.name!r}:")
        for name, before in added.started.items():
            now = ", ".join(added.roster.tiers.members[name])
            print(f"  tier {name!r} = [{now}] (was [{', '.join(before)}])")
        from roster.edits import embedded

        demo = [m.name for m in added.roster.models if embedded(m)]
        used = {n for names in added.roster.tiers.members.values() for n in names}
        idle = [name for name in demo if name not in used]
        if idle:
            print(
                f"  the embedded demo model ({', '.join(idle)}) is in no tier now: it runs "
                "only if a tier names it again"
            )
    elif tier is None:
        print("it is in no tier yet: no lane uses it until a tier names it (--tier)")
    elif added.tier_before is None:
        ladder = " → ".join(added.roster.tiers.ladder)
        print(f"new tier {tier!r} = [{member.name}], on top of the ladder: {ladder}")
    else:
        now = ", ".join(added.roster.tiers.members[tier])
        print(f"tier {tier!r} = [{now}] (was [{', '.join(added.tier_before)}])")
    if added.kept_comments:
        print("the file's comments are kept")
    else:
        print("the file's comments could not be kept in place: it was regenerated")


def _print_diff(old: str, new: str, path: Path) -> None:
    import difflib

    diff = difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), str(path), str(path)
    )
    sys.stdout.writelines(diff)
