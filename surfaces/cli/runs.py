"""`tally submit | runs | run | cancel | resume`: run commands, answered by the daemon."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--socket", type=Path, help="daemon socket (default: $TALLY_SOCKET or runtime)")


def _offline(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir",
        dest="state_dir",
        type=Path,
        help="state directory read when the daemon is down (default: as `tally serve`)",
    )


def _on_daemon(
    command: Callable[[argparse.Namespace], Awaitable[int]],
) -> Callable[[argparse.Namespace], int]:
    """A `run=` for a command answered by the daemon (the HTTP client is imported only then)."""

    def run(args: argparse.Namespace) -> int:
        from surfaces.client import run_client

        return run_client(_once(command(args)))

    return run


def register(commands: argparse._SubParsersAction[Any]) -> None:
    p = commands.add_parser("submit", help="run a request and print the answer")
    p.add_argument("request", help="what you want done")
    p.add_argument("--lane", help="force a lane instead of routing")
    p.add_argument("--plan", type=Path, help="an explicit plan (JSON file)")
    p.add_argument("--max-parallel", type=int)
    p.add_argument("--idempotency-key")
    p.add_argument("--detach", action="store_true", help="print the run id and return")
    _common(p)
    p.set_defaults(run=_on_daemon(submit))

    p = commands.add_parser("runs", help="list recent runs (from the record if the daemon is down)")
    p.add_argument("--state", help="only runs in this state")
    p.add_argument("--limit", type=int, default=20)
    _offline(p)
    _common(p)
    p.set_defaults(run=_on_daemon(runs))

    p = commands.add_parser("run", help="show one run: each task, then the answer")
    p.add_argument("run_id")
    p.add_argument("--full", action="store_true", help="task outputs unclipped")
    p.add_argument("--follow", action="store_true", help="follow it live, as submit does")
    _offline(p)
    _common(p)
    p.set_defaults(run=_on_daemon(show))

    p = commands.add_parser("cancel", help="cancel a run")
    p.add_argument("run_id")
    _common(p)
    p.set_defaults(run=_on_daemon(functools.partial(one, tool="run_cancel")))

    p = commands.add_parser("resume", help="resume an interrupted run and follow it")
    p.add_argument("run_id")
    p.add_argument("--detach", action="store_true", help="print the run id and return")
    _common(p)
    p.set_defaults(run=_on_daemon(resume))


def status_line(run: dict[str, Any]) -> str:
    from daemon.runs.state import TASK_ENDED

    tasks = run.get("tasks") or []
    done = sum(1 for t in tasks if t.get("state") in TASK_ENDED)
    parts = [f"{run['id']} {run['state']}"]
    lanes = list(dict.fromkeys(str(t["lane"]) for t in tasks if t.get("lane")))
    if len(lanes) > 1:  # a plan's tasks' lanes, not the lane its request text routes to
        parts.append(f"lanes {', '.join(lanes[:4])}{' …' if len(lanes) > 4 else ''}")
    elif lanes or run.get("lane"):
        parts.append(f"lane {lanes[0] if lanes else run['lane']}")
    if tasks:
        shown = " ".join(f"{t['id']}:{t.get('state', '?')}" for t in tasks[:6])
        more = " …" if len(tasks) > 6 else ""
        parts.append(f"tasks {done}/{len(tasks)} [{shown}{more}]")
    spent = run.get("spent") or {}
    if spent.get("model_calls"):
        parts.append(f"{spent['model_calls']} calls {spent.get('tokens', 0)} tok")
    return " · ".join(parts)


async def submit(args: argparse.Namespace) -> int:

    from surfaces.client import DaemonClient, Endpoint

    body: dict[str, Any] = {"request": args.request}
    if args.lane:
        body["lane"] = args.lane
    if args.plan:
        try:
            body["plan"] = json.loads(args.plan.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            print(f"tally: cannot read the plan {args.plan}: {exc}", file=sys.stderr)
            return 2
    if args.max_parallel:
        body["max_parallel"] = args.max_parallel
    if args.idempotency_key:
        body["idempotency_key"] = args.idempotency_key
    async with DaemonClient(Endpoint.from_env(args.socket)) as client:
        run = await client.call("submit", body)
        if args.detach:
            print(json.dumps(run) if args.json else run["id"])
            return 0
        run = await follow(client, run, args.json)
    return _ending(run, args.json)


async def resume(args: argparse.Namespace) -> int:
    from surfaces.client import DaemonClient, Endpoint

    async with DaemonClient(Endpoint.from_env(args.socket)) as client:
        run = await client.call("run_resume", {"run_id": args.run_id})
        if args.detach:
            print(json.dumps(run) if args.json else run["id"])
            return 0
        run = await follow(client, run, args.json)
    return _ending(run, args.json)


def _ending(run: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(run, ensure_ascii=False))
    elif run["state"] == "done":
        print(run.get("answer") or "")
    else:
        print(f"run {run['id']} ended {run['state']}: {run.get('error') or ''}", file=sys.stderr)
    return 0 if run["state"] == "done" else 1


async def follow(client: Any, run: dict[str, Any], as_json: bool) -> dict[str, Any]:
    """Follow a run to its end on stderr: one live line on a TTY, else one line per change.

    Ctrl-C cancels the run (it must not go on unattended) and says so.
    """
    import asyncio

    if not sys.stdout.isatty():
        # A script reading our stdout learns the id only at the end; say it now so it can
        # `tally cancel` a run that takes too long.
        print(f"tally: run {run['id']}", file=sys.stderr, flush=True)
    live = sys.stderr.isatty() and not as_json
    last = status_line(run)
    _progress(last, live)
    try:
        async for event in client.events(run["id"]):
            if event.event == "delta":
                continue
            run = await client.call("run_get", {"run_id": run["id"]})
            line = status_line(run)
            if line != last:
                _progress(line, live)
                last = line
    except asyncio.CancelledError:
        await asyncio.shield(client.call("run_cancel", {"run_id": run["id"]}))
        print(f"\ncancelled run {run['id']}", file=sys.stderr)
        raise
    run = dict(await client.call("run_get", {"run_id": run["id"]}))
    if live:
        _draw(status_line(run), final=True)
    return run


def _progress(line: str, live: bool) -> None:
    """A TTY redraws one line; a log (non-TTY stderr) gets one line per state change."""
    if live:
        _draw(line)
    else:
        print(f"tally: {line}", file=sys.stderr, flush=True)


def _draw(line: str, final: bool = False) -> None:
    """Redraw the one live status line on stderr (a TTY); `final` keeps it, full length."""
    sys.stderr.write("\r\x1b[K" + (line + "\n" if final else line[:200]))
    sys.stderr.flush()


async def _once(main: Awaitable[int]) -> int:
    """Run a command; an error answer is printed here, each message once.

    The daemon's message already holds every problem one per line (a plan's cycle, unknown
    lanes, …), and `details.errors` repeats them: print the details only when they add to it.
    """
    from surfaces.client import DaemonError

    try:
        return await main
    except DaemonError as exc:
        lines = exc.message.splitlines() or [""]
        errors = exc.details.get("errors", []) if isinstance(exc.details, dict) else []
        for err in errors[:20]:
            if not isinstance(err, dict):
                continue
            text = err.get("message")
            if not isinstance(text, str):
                loc = ".".join(str(p) for p in err.get("loc", []))
                text = f"{loc}: {err.get('msg', err)}" if loc else str(err.get("msg", err))
            if text not in lines:
                lines.append(text)
        if len(lines) == 1:
            print(f"tally: {exc.code}: {lines[0]}", file=sys.stderr)
        else:
            print(f"tally: {exc.code}:", file=sys.stderr)
            for line in lines:
                print(f"  {line}", file=sys.stderr)
        return 2 if exc.status == 422 else 1


async def runs(args: argparse.Namespace) -> int:
    from surfaces.client import DaemonClient, DaemonDown, Endpoint

    query: dict[str, Any] = {"limit": args.limit}
    if args.state:
        query["state"] = args.state
    try:
        async with DaemonClient(Endpoint.from_env(args.socket)) as client:
            found = (await client.call("runs_list", query))["runs"]
    except DaemonDown as down:  # read the record instead, and say so
        found = await _from_record(args, down, "the runs", None)
        if found is None:
            return 1
    if args.json:
        print(json.dumps(found, ensure_ascii=False))
        return 0
    from surfaces.cli.clock import local_time

    print(f"{'RUN':<24} {'STATE':<16} {'CREATED':<19} {'LANE':<14} REQUEST")
    for run in found:
        request = run["request"].replace("\n", " ")
        created = local_time(run.get("created_at_us"))
        print(
            f"{run['id']:<24} {run['state']:<16} {created:<19} {shown_lane(run) or '-':<14} "
            f"{request[:60]}"
        )
    if not found:
        print("(no runs)" if not args.state else f"(no runs in state {args.state})")
    return 0


async def show(args: argparse.Namespace) -> int:
    """`tally run ID`: each task (lane, member, attempts, state, time, output), then the answer."""
    from surfaces.client import DaemonClient, DaemonDown, Endpoint

    try:
        async with DaemonClient(Endpoint.from_env(args.socket)) as client:
            run = await client.call("run_get", {"run_id": args.run_id})
            if args.follow:
                run = await follow(client, run, args.json)
    except DaemonDown as down:  # read the record instead, and say so (nothing to follow)
        found = await _from_record(args, down, f"run {args.run_id}", args.run_id)
        if found is None:
            return 1
        if not found:
            print(f"tally: no run {args.run_id} in the record", file=sys.stderr)
            return 1
        run = found[0]
    if args.json:
        print(json.dumps(run, ensure_ascii=False))
        return 0
    for line in run_lines(run, full=args.full):
        print(line)
    return 0


async def _from_record(
    args: argparse.Namespace, down: Exception, what: str, run_id: str | None
) -> list[dict[str, Any]] | None:
    """The runs (or the one run) read offline from the record, after saying so on stderr;
    None (said why) when there is no record to read either."""
    from daemon.config import default_state_dir
    from daemon.errors import TallyError
    from surfaces.cli import record

    state = args.state_dir or default_state_dir()
    where = getattr(down, "where", "?")
    try:
        if run_id is not None:
            one = await record.run(state, run_id)
            found = [] if one is None else [one]
        else:
            found = await record.runs(state, args.state, args.limit)
    except (record.NoRecord, TallyError, OSError) as exc:
        print(f"tally: {down}; and no record to read offline: {exc}", file=sys.stderr)
        return None
    print(record.OFFLINE_NOTE.format(where=where, what=what, state=state), file=sys.stderr)
    return found


def shown_lane(run: dict[str, Any]) -> str | None:
    """The lane a person should read for a run: its tasks' lanes once it has a plan (a
    `--plan` run's routed lane is only where its request text would have gone)."""
    lanes = list(dict.fromkeys(str(t.get("lane")) for t in run.get("tasks") or [] if t.get("lane")))
    if not lanes:
        return run.get("lane")
    return lanes[0] if len(lanes) == 1 else f"{lanes[0]} +{len(lanes) - 1}"


CLIP = 600


def run_lines(run: dict[str, Any], full: bool = False) -> list[str]:
    from surfaces.cli.clock import ago

    lines = [status_line(run), f"created {ago(run.get('created_at_us'))}"]
    if run.get("error"):
        lines.append(f"error: {run['error']}")
    for task in run.get("tasks") or []:
        lines.append("")
        lines.append(_task_head(task))
        text = task.get("result") or ""
        if task.get("error"):
            lines.append(f"    error: {task['error']}")
        if text:
            shown = text if full or len(text) <= CLIP else text[:CLIP]
            lines += ["    " + line for line in shown.splitlines()]
            if len(shown) < len(text):
                lines.append(f"    … {len(text) - len(shown)} more characters (--full shows all)")
    if run.get("answer"):
        lines += ["", "answer:", run["answer"]]
    return lines


def _task_head(task: dict[str, Any]) -> str:
    parts = [f"task {task['id']}", task.get("state", "?"), f"lane {task.get('lane') or '-'}"]
    if task.get("member"):
        parts.append(f"member {task['member']}")
    attempts = task.get("attempts") or 0
    parts.append(f"{attempts} attempt{'s' if attempts != 1 else ''}")
    start, end = task.get("started_at_us"), task.get("ended_at_us")
    if isinstance(start, int) and isinstance(end, int):
        parts.append(f"{(end - start) / 1e6:.1f} s")
    return " · ".join(parts)


async def one(args: argparse.Namespace, tool: str) -> int:
    from surfaces.client import DaemonClient, Endpoint

    async with DaemonClient(Endpoint.from_env(args.socket)) as client:
        run = await client.call(tool, {"run_id": args.run_id})
    if args.json:
        print(json.dumps(run, ensure_ascii=False))
        return 0
    print(status_line(run))
    if run.get("error"):
        print(f"error: {run['error']}")
    if run.get("answer"):
        print()
        print(run["answer"])
    return 0
