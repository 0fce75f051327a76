"""`tally submit | runs | run | cancel | resume | retry`: run commands, answered by the daemon.

One piece past 500 lines: the six commands share their argument parsing, the follow/stream
loop and the last-line hints a user reads after each.

On a terminal, `submit`, `run --follow`, `resume` and `retry` stream the tokens each task
writes, named by task (`surfaces.cli.stream`); `--stream`/`--no-stream` force it either way.
"""

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
    p.add_argument("request", help="what you want done ('-': read it from stdin)")
    p.add_argument(
        "--workspace",
        metavar="DIR",
        type=Path,
        help="the project the tasks work on (copies of it; `tally apply` changes it)",
    )
    p.add_argument(
        "--file",
        metavar="PATH",
        type=Path,
        action="append",
        default=[],
        help="attach a file's content to the request (repeatable)",
    )
    p.add_argument("--lane", help="force a lane instead of routing")
    p.add_argument("--plan", type=Path, help="an explicit plan (JSON file)")
    p.add_argument("--max-parallel", type=int)
    p.add_argument("--idempotency-key")
    p.add_argument("--detach", action="store_true", help="print the run id and return")
    p.add_argument("--tier", help="start every task on this tier (one of the roster's)")
    p.add_argument("--member", help="send every task's model call to this roster member")
    _stream_flag(p)
    _common(p)
    p.set_defaults(run=_on_daemon(submit))

    p = commands.add_parser("patch", help="print a workspace run's combined patch (a diff)")
    p.add_argument("run_id")
    _common(p)
    p.set_defaults(run=_on_daemon(patch))

    p = commands.add_parser("apply", help="apply a workspace run's patch to the workspace")
    p.add_argument("run_id")
    p.add_argument("--check", action="store_true", help="only check that it applies")
    _common(p)
    p.set_defaults(run=_on_daemon(apply))

    p = commands.add_parser("runs", help="list recent runs (from the record if the daemon is down)")
    p.add_argument("--state", help="only runs in this state")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--all", action="store_true", help="also the runs of daemons sharing the record")
    _offline(p)
    _common(p)
    p.set_defaults(run=_on_daemon(runs))

    p = commands.add_parser("run", help="show one run: each task, then the answer")
    p.add_argument("run_id")
    p.add_argument("--full", action="store_true", help="task outputs unclipped")
    p.add_argument("--follow", action="store_true", help="follow it live, as submit does")
    _stream_flag(p)
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
    _stream_flag(p)
    _common(p)
    p.set_defaults(run=_on_daemon(resume))

    p = commands.add_parser(
        "retry",
        help="run a failed or cancelled run again, reusing its done tasks, and follow it",
    )
    p.add_argument("run_id")
    p.add_argument("--detach", action="store_true", help="print the new run's id and return")
    _stream_flag(p)
    _common(p)
    p.set_defaults(run=_on_daemon(retry))


def _stream_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show the tokens tasks write as they come (default: when stdout is a terminal)",
    )


def _streaming(args: argparse.Namespace) -> Any:
    """A `Tokens` writer on stdout when tokens are to be shown, else None."""
    from surfaces.cli.stream import Tokens

    wanted = getattr(args, "stream", None)
    if wanted is None:
        wanted = sys.stdout.isatty() and not args.json
    return Tokens(sys.stdout) if wanted and not args.json else None


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
        shown = " ".join(
            f"{t['id']}:{t.get('state', '?')}{'(capacity)' if t.get('held') else ''}"
            for t in tasks[:6]
        )
        more = " …" if len(tasks) > 6 else ""
        parts.append(f"tasks {done}/{len(tasks)} [{shown}{more}]")
    spent = run.get("spent") or {}
    if spent.get("model_calls"):
        parts.append(f"{spent['model_calls']} calls {spent.get('tokens', 0)} tok")
    return " · ".join(parts)


async def submit(args: argparse.Namespace) -> int:

    from surfaces.client import DaemonClient, Endpoint

    try:
        request = request_text(args.request, args.file)
    except ValueError as exc:
        print(f"tally: {exc}", file=sys.stderr)
        return 2
    body: dict[str, Any] = {"request": request}
    if args.workspace is not None:
        # absolute, not resolved: the daemon resolves links itself, and its refusal then names
        # the path the user typed beside the one it leads to
        body["workspace"] = str(args.workspace.expanduser().absolute())
    if args.lane:
        body["lane"] = args.lane
    if args.plan:
        try:
            body["plan"] = json.loads(args.plan.read_text())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            print(f"tally: cannot read the plan {args.plan}: {exc}", file=sys.stderr)
            return 2
    if args.max_parallel:
        body["max_parallel"] = args.max_parallel
    if args.idempotency_key:
        body["idempotency_key"] = args.idempotency_key
    if args.tier:
        body["tier"] = args.tier
    if args.member:
        body["member"] = args.member
    tokens = _streaming(args)
    async with DaemonClient(Endpoint.from_env(args.socket)) as client:
        run = await client.call("submit", body)
        if args.detach:
            print(json.dumps(run) if args.json else run["id"])
            return 0
        run = await follow(client, run, args.json, tokens)
    return _ending(run, args.json, tokens)


ATTACH_MAX = 90_000
REQUEST_MAX = 100_000
"""The submit tool's bound on a request (`SubmitIn.request`)."""
"""Characters of attached files a request may carry (the request's own cap is 100,000)."""


def request_text(request: str, files: list[Path]) -> str:
    """The request as typed ('-': stdin), with each `--file` attached under its path."""
    # read with a bound: `--file /dev/zero` or a 10 GB log must not fill memory first
    text = sys.stdin.read(REQUEST_MAX + 1) if request == "-" else request
    if len(text) > REQUEST_MAX:
        raise ValueError(f"the request is over {REQUEST_MAX} characters")
    parts = [text.strip()]
    room = ATTACH_MAX
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                content = f.read(room + 1)
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
        if len(content) > room:
            raise ValueError(
                f"{path} has more characters than the {room} left; attached files may hold "
                f"{ATTACH_MAX} in all (use --workspace for a project)"
            )
        room -= len(content)
        fence = "````" if "```" in content else "```"
        parts.append(f"File {path}:\n{fence}\n{content.rstrip()}\n{fence}")
    joined = "\n\n".join(part for part in parts if part)
    if not joined.strip():
        raise ValueError(
            "the request is empty (stdin gave nothing)"
            if request == "-"
            else "the request is empty"
        )
    return joined


async def patch(args: argparse.Namespace) -> int:
    """`tally patch RUN`: the combined diff on stdout (pipe it to `git apply` or a pager)."""
    from surfaces.client import DaemonClient, Endpoint

    async with DaemonClient(Endpoint.from_env(args.socket)) as client:
        found = await client.call("run_patch", {"run_id": args.run_id})
    if args.json:
        print(json.dumps(found, ensure_ascii=False))
        return 0
    if found.get("error"):
        print(f"tally: run {args.run_id}: {found['error']}", file=sys.stderr)
        return 1
    if found.get("patch") is None:
        if not found.get("workspace"):  # "yet" would promise one that never comes
            why = "worked on no workspace (`--workspace DIR`), so it has no patch"
        elif found["state"] in ("queued", "routing", "planning", "running", "synthesizing"):
            why = f"is {found['state']}: its patch comes once its tasks are done"
        else:
            why = f"is {found['state']} and has no patch"
        print(f"tally: run {args.run_id} {why}", file=sys.stderr)
        return 1
    if not found["patch"]:
        print(f"tally: run {args.run_id} changed no file", file=sys.stderr)
        return 0
    sys.stdout.write(found["patch"])
    return 0


async def apply(args: argparse.Namespace) -> int:
    """`tally apply RUN [--check]`: the patch onto the workspace (witnessed unless --check)."""
    from surfaces.client import DaemonClient, Endpoint

    async with DaemonClient(Endpoint.from_env(args.socket)) as client:
        done = await client.call("run_apply", {"run_id": args.run_id, "check": args.check})
    if args.json:
        print(json.dumps(done, ensure_ascii=False))
        return 0
    files = ", ".join(done["files"][:20]) or "no file"
    if done.get("note") == "already applied":
        print(f"run {args.run_id}: already applied to {done['workspace']} ({files})")
    elif args.check:
        print(f"run {args.run_id}: the patch applies to {done['workspace']} ({files})")
    else:
        print(f"run {args.run_id}: applied to {done['workspace']} with {done['method']}: {files}")
    return 0


async def resume(args: argparse.Namespace) -> int:
    from surfaces.client import DaemonClient, Endpoint

    tokens = _streaming(args)
    async with DaemonClient(Endpoint.from_env(args.socket)) as client:
        run = await client.call("run_resume", {"run_id": args.run_id})
        if args.detach:
            print(json.dumps(run) if args.json else run["id"])
            return 0
        run = await follow(client, run, args.json, tokens)
    return _ending(run, args.json, tokens)


async def retry(args: argparse.Namespace) -> int:
    from surfaces.client import DaemonClient, Endpoint

    tokens = _streaming(args)
    async with DaemonClient(Endpoint.from_env(args.socket)) as client:
        run = await client.call("run_retry", {"run_id": args.run_id})
        if args.detach:
            print(json.dumps(run) if args.json else run["id"])
            return 0
        original = await client.call("run_get", {"run_id": args.run_id})
        reused = [t["id"] for t in original.get("tasks") or [] if t.get("state") == "done"]
        print(
            f"tally: run {run['id']} retries {args.run_id}"
            + (f", reusing {', '.join(reused)}" if reused else "")
            + (
                f" where their changes still apply to {original['workspace']} as it is now"
                if reused and original.get("workspace")
                else ""
            ),
            file=sys.stderr,
        )
        run = await follow(client, run, args.json, tokens)
    return _ending(run, args.json, tokens)


def _ending(run: dict[str, Any], as_json: bool, tokens: Any = None) -> int:
    if as_json:
        print(json.dumps(run, ensure_ascii=False))
    elif run["state"] == "done":
        answer = run.get("answer") or ""
        if tokens is not None and tokens.showed(answer):
            pass  # the user just watched it being written
        elif tokens is not None and tokens.written:
            print(f"── answer ──\n{answer}")
        else:
            print(answer)
        if run.get("patch_files"):
            changed = len(run["patch_files"])
            print(
                f"tally: the run changed {changed} file{'s' if changed != 1 else ''} in a copy of "
                f"{run.get('workspace')}: `tally patch {run['id']}` shows the diff, "
                f"`tally apply {run['id']}` applies it",
                file=sys.stderr,
            )
    else:
        if run.get("answer"):  # a failed run's partial answer: the work its done tasks did
            print(run["answer"])
        print(f"run {run['id']} ended {run['state']}: {run.get('error') or ''}", file=sys.stderr)
        if run["state"] in ("failed", "cancelled", "budget_exhausted"):
            again = f"`tally retry {run['id']}` runs what is not done again"
            if run.get("workspace"):  # engine.retry: on a fresh snapshot of the workspace
                again += f", on {run['workspace']} as it is then"
            print(f"tally: `tally run {run['id']}` shows each attempt; {again}", file=sys.stderr)
            if run.get("patch_files"):  # the done tasks' changes (views.partial_patch)
                changed = len(run["patch_files"])
                print(
                    f"tally: its done tasks changed {changed} file{'s' if changed != 1 else ''}: "
                    f"`tally patch {run['id']}` shows the diff, `tally apply {run['id']}` "
                    "applies it",
                    file=sys.stderr,
                )
        elif run["state"] == "interrupted":
            print(f"tally: `tally resume {run['id']}` goes on", file=sys.stderr)
    return 0 if run["state"] == "done" else 1


async def follow(
    client: Any, run: dict[str, Any], as_json: bool, tokens: Any = None
) -> dict[str, Any]:
    """Follow a run to its end on stderr: one live line on a TTY, else one line per change.
    With `tokens` (a `stream.Tokens`), the tokens tasks write go to it as they come, and the
    status goes to stderr as lines (a redrawn line would cut through the text).

    Ctrl-C cancels the run (it must not go on unattended) and says so.
    """
    import asyncio

    if not sys.stdout.isatty():
        # A script reading our stdout learns the id only at the end; say it now so it can
        # `tally cancel` a run that takes too long.
        print(f"tally: run {run['id']}", file=sys.stderr, flush=True)
    live = sys.stderr.isatty() and not as_json and tokens is None
    last = status_line(run)
    _progress(last, live)
    try:
        async for event in client.events(run["id"]):
            if event.event == "delta":
                if tokens is not None:
                    tokens.delta(event.data)
                continue
            if tokens is not None:
                tokens.entry(event.event, event.data)
            if event.event == "agent.step" and not as_json and isinstance(event.data, dict):
                _step(event.data, live, tokens)
            run = await client.call("run_get", {"run_id": run["id"]})
            line = status_line(run)
            if line != last:
                if tokens is not None and sys.stderr.isatty() and tokens.out.isatty():
                    tokens.pause()  # one terminal: the status gets a line of its own
                _progress(line, live)
                last = line
    except asyncio.CancelledError:
        await asyncio.shield(client.call("run_cancel", {"run_id": run["id"]}))
        print(f"\ncancelled run {run['id']}", file=sys.stderr)
        raise
    run = dict(await client.call("run_get", {"run_id": run["id"]}))
    if tokens is not None:
        tokens.end()
    if live:
        _draw(status_line(run), final=True)
    return run


def _step(data: dict[str, Any], live: bool, tokens: Any) -> None:
    """An agent task's step as it happens, one line on stderr (the status line redraws after)."""
    from daemon.record import AgentStep
    from surfaces.cli.stream import step_line

    if tokens is not None:
        tokens.pause()
    step = AgentStep.parsed(data)
    if step is None:  # not a step this tally can read (another version's): said as such
        line = "tally: agent step (not readable by this tally: `tally run ID` lists it)"
    else:
        line = f"tally: {step.task or 'agent'} {step_line(step)}"
    sys.stderr.write(("\r\x1b[K" if live else "") + line + "\n")
    sys.stderr.flush()


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
    if getattr(args, "all", False):
        query["all"] = True
    owners: dict[str, str] = {}
    try:
        async with DaemonClient(Endpoint.from_env(args.socket)) as client:
            listed = await client.call("runs_list", query)
            found, owners = listed["runs"], listed.get("daemons") or {}
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
            f"{request[:60]}" + (f"  [{owners[run['id']]}]" if run["id"] in owners else "")
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
                run = await follow(client, run, args.json, _streaming(args))
            attempts = {} if args.json else await _attempts(client, run)
    except DaemonDown as down:  # read the record instead, and say so (nothing to follow)
        found = await _from_record(args, down, f"run {args.run_id}", args.run_id)
        if found is None:
            return 1
        if not found:
            print(f"tally: no run {args.run_id} in the record", file=sys.stderr)
            return 1
        run = found[0]
        attempts = {}
    if args.json:
        print(json.dumps(run, ensure_ascii=False))
        return 0
    for line in run_lines(run, full=args.full, attempts=attempts):
        print(line)
    return 0


async def _attempts(client: Any, run: dict[str, Any]) -> dict[str, list[str]]:
    """Each task's attempts, read from the run's entries (see `stream.attempt_lines`)."""
    from surfaces.cli.stream import attempt_lines

    found: list[dict[str, Any]] = []
    start = run.get("request_seq") or 0
    for _ in range(200):  # pages of 1000: a run's entries are bounded by its budget
        page = await client.call(
            "ledger_entries", {"run": run["id"], "start": start, "limit": 1000, "bodies": True}
        )
        batch = page.get("entries") or []
        found += batch
        if len(batch) < 1000:
            break
        start = batch[-1]["seq"] + 1
    return attempt_lines(found)


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
    if getattr(down, "remote", False) and args.state_dir is None:
        # A daemon named by TALLY_URL may be on another machine: this one's state dir is not
        # its record (on the daemon's machine, --state-dir reads it).
        print(f"tally: {down}", file=sys.stderr)
        return None
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


def run_lines(
    run: dict[str, Any], full: bool = False, attempts: dict[str, list[str]] | None = None
) -> list[str]:
    from surfaces.cli.clock import ago

    lines = [status_line(run), f"created {ago(run.get('created_at_us'))}"]
    if run.get("retry_of"):
        lines.append(f"retries run {run['retry_of']}")
    if run.get("tier") or run.get("member"):
        lines.append(
            f"chosen: {'tier ' + run['tier'] if run.get('tier') else 'member ' + run['member']}"
        )
    if run.get("error"):
        lines.append(f"error: {run['error']}")
    for task in run.get("tasks") or []:
        lines.append("")
        lines.append(_task_head(task))
        for line in (attempts or {}).get(task["id"], []):
            lines += ["    " + part for part in line.splitlines()]
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
    if task.get("held"):  # pending, ready, held back by a cap on tasks at once: say which
        parts[1] = f"{parts[1]} ({task['held']})"
    if task.get("member"):
        parts.append(f"member {task['member']}")
    attempts = task.get("attempts") or 0
    parts.append(f"{attempts} attempt{'s' if attempts != 1 else ''}")
    if task.get("executor") == "agent":
        parts.append(f"agent, {task.get('steps') or 0} steps")
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
