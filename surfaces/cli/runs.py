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

    p = commands.add_parser("runs", help="list recent runs")
    p.add_argument("--state", help="only runs in this state")
    p.add_argument("--limit", type=int, default=20)
    _common(p)
    p.set_defaults(run=_on_daemon(runs))

    for name, tool, text in (
        ("run", "run_get", "show one run"),
        ("cancel", "run_cancel", "cancel a run"),
        ("resume", "run_resume", "resume an interrupted run"),
    ):
        p = commands.add_parser(name, help=text)
        p.add_argument("run_id")
        _common(p)
        p.set_defaults(run=_on_daemon(functools.partial(one, tool=tool)))


def status_line(run: dict[str, Any]) -> str:
    from daemon.runs.state import TASK_ENDED

    tasks = run.get("tasks") or []
    done = sum(1 for t in tasks if t.get("state") in TASK_ENDED)
    parts = [f"{run['id']} {run['state']}"]
    if run.get("lane"):
        parts.append(f"lane {run['lane']}")
    if tasks:
        shown = " ".join(f"{t['id']}:{t.get('state', '?')}" for t in tasks[:6])
        more = " …" if len(tasks) > 6 else ""
        parts.append(f"tasks {done}/{len(tasks)} [{shown}{more}]")
    spent = run.get("spent") or {}
    if spent.get("model_calls"):
        parts.append(f"{spent['model_calls']} calls {spent.get('tokens', 0)} tok")
    return " · ".join(parts)


async def submit(args: argparse.Namespace) -> int:
    import asyncio

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
        if not sys.stdout.isatty():
            # A script reading our stdout learns the id only at the end; say it now so it can
            # `tally cancel` a run that takes too long.
            print(f"tally: run {run['id']}", file=sys.stderr, flush=True)
        live = sys.stderr.isatty() and not args.json
        if live:  # the state the daemon answered with (queued, …), before any event
            _draw(status_line(run))
        try:
            async for event in client.events(run["id"]):
                if event.event == "delta":
                    continue
                run = await client.call("run_get", {"run_id": run["id"]})
                if live:
                    _draw(status_line(run))
        except asyncio.CancelledError:
            await asyncio.shield(client.call("run_cancel", {"run_id": run["id"]}))
            print(f"\ncancelled run {run['id']}", file=sys.stderr)
            raise
        run = await client.call("run_get", {"run_id": run["id"]})
        if live:
            _draw(status_line(run), final=True)
    if args.json:
        print(json.dumps(run, ensure_ascii=False))
    elif run["state"] == "done":
        print(run.get("answer") or "")
    else:
        print(f"run {run['id']} ended {run['state']}: {run.get('error') or ''}", file=sys.stderr)
    return 0 if run["state"] == "done" else 1


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
    from surfaces.client import DaemonClient, Endpoint

    query: dict[str, Any] = {"limit": args.limit}
    if args.state:
        query["state"] = args.state
    async with DaemonClient(Endpoint.from_env(args.socket)) as client:
        found = (await client.call("runs_list", query))["runs"]
    if args.json:
        print(json.dumps(found, ensure_ascii=False))
        return 0
    print(f"{'RUN':<24} {'STATE':<16} {'LANE':<14} REQUEST")
    for run in found:
        request = run["request"].replace("\n", " ")
        print(f"{run['id']:<24} {run['state']:<16} {run.get('lane') or '-':<14} {request[:60]}")
    if not found:
        print("(no runs)" if not args.state else f"(no runs in state {args.state})")
    return 0


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
