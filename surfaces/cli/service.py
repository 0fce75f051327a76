"""`tally status | logs | stop`: the running service at a glance, its logs, a clean stop.

`status` and `stop` ask the daemon (tools `status`, `daemon_stop`); `logs` reads the log files
in the state dir (`logs/daemon.log`, which `tally serve` writes beside its stderr, and each
model server's `logs/MEMBER-N.log`), so it works with the daemon down too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from daemon import layout

DAEMON_LOG = layout.DAEMON_LOG
ASK_S = 15.0
"""How long `tally stop` waits for the daemon to answer before it signals the lock's holder."""
MEMBER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A member name as `--member` may give it (the roster's names are of this shape)."""


def register(commands: argparse._SubParsersAction[Any]) -> None:
    p = commands.add_parser("status", help="the daemon, its pool, runs and ledger at a glance")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--socket", type=Path, help="daemon socket (default: $TALLY_SOCKET or runtime)")
    p.set_defaults(run=run_status)

    p = commands.add_parser("logs", help="the daemon's and the model servers' logs")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.add_argument("--member", metavar="NAME", help="only this pool member's model servers")
    p.add_argument("--daemon", action="store_true", help="only the daemon's own log")
    p.add_argument("-n", "--lines", type=int, default=40, help="lines of each log (default 40)")
    p.add_argument("--state", type=Path, help="state directory (default: as `tally serve`)")
    p.set_defaults(run=run_logs)

    p = commands.add_parser("stop", help="stop the running daemon cleanly (runs drain first)")
    p.add_argument("--socket", type=Path, help="daemon socket (default: $TALLY_SOCKET or runtime)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for it to be gone")
    p.add_argument(
        "--state",
        type=Path,
        help="state directory, for when the socket does not answer: the daemon holding its "
        "ledger lock is sent SIGTERM (default: as `tally serve`)",
    )
    p.set_defaults(run=run_stop)


# ---------------------------------------------------------------- status


def run_status(args: argparse.Namespace) -> int:
    from surfaces.client import DaemonClient, Endpoint, run_client

    async def main() -> int:
        async with DaemonClient(Endpoint.from_env(args.socket)) as client:
            body = await client.call("status")
        print(json.dumps(body, indent=2) if args.json else status_text(body))
        return 0 if body["status"] == "ok" else 1

    return run_client(main())


def _states(counts: dict[str, int]) -> str:
    return ", ".join(f"{state} {n}" for state, n in sorted(counts.items())) or "none"


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def status_text(body: dict[str, Any]) -> str:
    from surfaces.cli.clock import ago, duration, local_time

    d, pool, runs, ledger = body["daemon"], body["pool"], body["runs"], body["ledger"]
    lines = [
        f"tally {d['version']} · pid {d['pid']} · up {duration(d['uptime_s'])} "
        f"(since {local_time(d['started_at_us'])}) · {body['status']}",
        f"listening: {', '.join(d['listeners']) or '-'}",
        f"state: {d['state_dir']}",
        f"pool: {pool['busy']} busy, {pool['idle']} idle slots · {pool['queue']} waiting "
        f"for a slot · command tasks: {pool.get('command_sandbox', '?')}",
    ]
    for m in pool["members"]:
        loaded = [i for i in m["instances"] if i["state"] not in ("stopped",)]
        total = sum(i["slots_total"] for i in loaded)
        busy = sum(i["slots_busy"] for i in loaded)
        where = "external" if m["external"] else f"{len(loaded)} loaded"
        extra = f" · {m['last_error']}" if m.get("last_error") and not m["healthy"] else ""
        # An external member is reached on its first call: before that it is not "stopped".
        state = "unused" if m["external"] and m["state"] == "stopped" else m["state"]
        lines.append(
            f"  {m['name']:<16} {state:<10} {where:<10} slots {busy}/{total} busy · "
            f"queue {m['queue']}/{m['max_queue']}{extra}"
        )
    for t in pool.get("tiers") or []:
        if t["queue"]:
            lines.append(f"  tier {t['name']}: {t['queue']} waiting")
    lines.append(
        f"runs: {_states(runs['by_state'])} · in flight {runs['in_flight']}"
        f" · tasks: {_states(runs['tasks_by_state'])}"
    )
    writable = "writable" if ledger["writable"] else f"DEGRADED: {ledger.get('reason')}"
    if ledger.get("checkpoint_size") is None:
        checkpoint = "no checkpoint yet"
    else:
        checkpoint = (
            f"last checkpoint at {ledger['checkpoint_size']} entries, "
            f"{ago(ledger.get('checkpoint_time_us'))}"
        )
    lines.append(
        f"ledger: {ledger['size']} entries ({_bytes(ledger.get('bytes'))}) · {writable} · "
        f"{checkpoint}"
    )
    if (routing := body.get("routing")) and routing.get("embeddings"):
        lines.append(routing_line(routing))
    return "\n".join(lines)


def routing_line(r: dict[str, Any]) -> str:
    """The embedding member's part in routing, as `tally status` says it."""
    head = f"routing: embeddings on {r['embeddings']} · example vectors {r['state']}"
    if r["state"] == "ready":
        built = f"{r['examples']} ({r['reused']} from the cache, {r['computed']} computed)"
        problem = f" · cache rebuilt: {r['cache_problem']}" if r.get("cache_problem") else ""
        return f"{head}: {built}{problem}"
    return f"{head}: routes use the keyword scores alone ({r.get('why') or 'not built yet'})"


# ---------------------------------------------------------------- stop


def run_stop(args: argparse.Namespace) -> int:
    import asyncio

    from surfaces.client import DaemonClient, DaemonDown, Endpoint, run_client

    async def main() -> int:
        endpoint = Endpoint.from_env(args.socket)
        # daemon_stop answers at once (the drain follows): one that does not answer is hung
        async with DaemonClient(endpoint, timeout=min(ASK_S, args.timeout)) as client:
            try:
                pid = await _local_pid(client, endpoint)
                body = await client.call("daemon_stop")
            except (DaemonDown, TimeoutError) as exc:
                if endpoint.socket_path is not None:
                    return await _stop_by_lock(args, endpoint.where)
                if isinstance(exc, TimeoutError):
                    print(f"tally: the daemon at {endpoint.where} does not answer", file=sys.stderr)
                    return 1
                print(f"tally: no daemon running at {endpoint.where}", file=sys.stderr)
                return 0
        if not args.json:
            n = body["draining"]
            print(
                f"tally: stopping: {n} run{'s' if n != 1 else ''} in flight drain for up to "
                f"{body['drain_s']:g} s; the rest are interrupted (`tally resume RUN`)"
                if n
                else "tally: stopping: no run in flight",
                file=sys.stderr,
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + args.timeout
        while loop.time() < deadline:
            # The listener closes as the drain begins: "stopped" waits for the process too.
            async with DaemonClient(endpoint, timeout=2.0) as probe:
                try:
                    answers = await probe.ping()
                except (TimeoutError, OSError):  # a draining daemon may accept, not answer
                    answers = False
                if not answers and not _alive(pid):
                    break
            await asyncio.sleep(0.2)
        else:
            print(f"tally: still running after {args.timeout:g} s", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(body | {"stopped": True}))
        else:
            print("tally: stopped", file=sys.stderr)
        return 0

    return run_client(main())


def lock_holder(state: Path) -> int | None:
    """The pid of the process holding the state dir's ledger lock (the running daemon), if
    this user can see it: the lock is held, the pid written in it is alive, and that process
    has the very lock file open (a stale or forged pid names some other process)."""
    import fcntl

    lock = layout.ledger_dir(state) / layout.LOCK
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # nobody holds it: no daemon on this state dir
        except BlockingIOError:
            pass
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        held = os.fstat(fd)
    finally:
        os.close(fd)
    if not text.isdigit() or int(text) <= 1:
        return None
    pid = int(text)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for name in fds:
        try:
            st = os.stat(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
            return pid
    return None


async def _stop_by_lock(args: argparse.Namespace, where: str) -> int:
    """The socket does not answer (removed, or another path): SIGTERM the daemon that holds
    the state dir's ledger lock (it drains as on Ctrl-C) and wait for it to be gone."""
    import asyncio
    import signal

    from daemon.config import default_state_dir

    state = args.state or default_state_dir()
    pid = lock_holder(state)
    if pid is None:
        print(f"tally: no daemon running at {where} (nor one holding {state})", file=sys.stderr)
        return 0
    print(
        f"tally: the daemon does not answer at {where}; sending SIGTERM to pid {pid}, which "
        f"holds {layout.ledger_dir(state) / layout.LOCK} (it drains its runs as on Ctrl-C)",
        file=sys.stderr,
    )
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    except PermissionError:
        print(f"tally: not allowed to signal pid {pid} (another user's daemon)", file=sys.stderr)
        return 1
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.timeout
    while _alive(pid):
        if loop.time() >= deadline:
            print(
                f"tally: pid {pid} still running after {args.timeout:g} s (`kill -KILL {pid}` "
                "stops it without a drain; the next start recovers the ledger)",
                file=sys.stderr,
            )
            return 1
        await asyncio.sleep(0.2)
    if args.json:
        print(json.dumps({"stopped": True, "pid": pid, "signal": "SIGTERM"}))
    else:
        print("tally: stopped", file=sys.stderr)
    return 0


async def _local_pid(client: Any, endpoint: Any) -> int | None:
    """The daemon's pid when it is on this machine (its unix socket), else None."""
    if endpoint.socket_path is None:
        return None
    from surfaces.client import DaemonDown

    try:
        pid = (await client.call("status"))["daemon"]["pid"]
    except (DaemonDown, TimeoutError):
        raise  # no daemon, or a hung one: the caller's to handle
    except Exception:  # an older daemon or a client without `read`: wait for the listener only
        return None
    return pid if isinstance(pid, int) and pid > 0 else None


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process by that pid: it is there
        return True
    try:  # exited, not yet reaped by its parent (a shell's job, a test's child): gone
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


# ---------------------------------------------------------------- logs


def log_files(state: Path, member: str | None, daemon_only: bool) -> list[Path]:
    """The logs to show: the daemon's, then each model server's (MEMBER-N.log), by name."""
    logs = state / layout.LOGS
    found: list[Path] = []
    if member is None and (logs / DAEMON_LOG).is_file():
        found.append(logs / DAEMON_LOG)
    if daemon_only:
        return found
    pattern = re.compile(rf"{re.escape(member) if member else MEMBER.pattern}-[0-9]+\.log")
    try:
        names = sorted(p.name for p in logs.iterdir())
    except OSError:
        names = []
    found += [logs / name for name in names if pattern.fullmatch(name)]
    return found


def _label(path: Path) -> str:
    return "daemon" if path.name == DAEMON_LOG else path.name.removesuffix(".log")


def _tail(path: Path, lines: int) -> tuple[list[str], int, int]:
    """The last `lines` lines of a file, its inode and its size (what follow continues from)."""
    import os

    with path.open("rb") as f:
        st = os.fstat(f.fileno())
        start = max(0, st.st_size - max(lines, 1) * 512)  # lines are rarely longer than that
        f.seek(start)
        data = f.read(st.st_size - start)
    cut = data.rfind(b"\n") + 1  # a line still being written is printed by follow, whole
    found = data[:cut].decode("utf-8", "replace").splitlines()
    if start > 0:
        found = found[1:]  # the first may be the end of a line cut by the seek
    return (found[-lines:] if lines > 0 else []), st.st_ino, start + cut


def run_logs(args: argparse.Namespace) -> int:
    import time

    from daemon.config import default_state_dir

    if args.member is not None and not MEMBER.fullmatch(args.member):
        print(f"tally logs: {args.member!r} is not a member name", file=sys.stderr)
        return 2
    state = args.state or default_state_dir()
    files = log_files(state, args.member, args.daemon)
    if not files:
        what = f"member {args.member!r}" if args.member else "the daemon or its model servers"
        print(
            f"tally logs: no log of {what} in {state / layout.LOGS} (a member's log appears once "
            "tally has started its server; an external member (`url`) logs where it runs; "
            "`tally serve` writes daemon.log)",
            file=sys.stderr,
        )
        return 1
    width = max(len(_label(p)) for p in files)
    at: dict[Path, tuple[int, int]] = {}
    for path in files:
        try:
            shown, inode, size = _tail(path, args.lines)
        except OSError as exc:
            print(f"tally logs: {path}: {exc.strerror or exc}", file=sys.stderr)
            continue
        at[path] = (inode, size)
        for line in shown:
            print(f"{_label(path):<{width}} | {line}")
    sys.stdout.flush()
    if not args.follow:
        return 0
    try:
        while True:
            time.sleep(0.5)
            for path in log_files(state, args.member, args.daemon):
                width = max(width, len(_label(path)))
                for line in _new_lines(path, at):
                    print(f"{_label(path):<{width}} | {line}")
            sys.stdout.flush()
    except KeyboardInterrupt:
        return 0


def _new_lines(path: Path, at: dict[Path, tuple[int, int]]) -> list[str]:
    """Lines written since the last look; a rotated file (new inode, or copy-truncated to a
    smaller size) is read from its start."""
    try:
        stat = path.stat()
    except OSError:
        return []
    inode, offset = at.get(path, (stat.st_ino, 0))
    if stat.st_ino != inode or stat.st_size < offset:
        offset = 0
    if stat.st_size == offset:
        at[path] = (stat.st_ino, offset)
        return []
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read(stat.st_size - offset)
    except OSError:
        return []
    cut = data.rfind(b"\n") + 1  # a line still being written waits for its end
    at[path] = (stat.st_ino, offset + cut)
    return data[:cut].decode("utf-8", "replace").splitlines()
