"""Agent CLI members: a coding agent's command line (`llm`, aider, `claude -p`, `codex exec -`)
run as a task's executor, in the sandbox, on the task's view.

Selection. A roster member with `kind = "agent-cli"` is named like any other member: by a
tier (a tier of agent CLIs only: the roster refuses a tier that mixes them with servers), by
a lane's tier, by the ladder a task climbs, or by a client's `tier`/`member` choice. A chat
task whose target on its rung is such a member, or such a tier (its first member with a free
slot, else its first), runs the CLI instead of a chat call; so escalation can climb from a
local model to an agent CLI. `slots` bounds the calls one member runs at once.

The call. The prompt is the task's instruction, its upstream results and the previous
attempt's failures (`executors.chat_messages`' user message), given on stdin, in a read-only
file (`{prompt_file}`) or as one argument (`{prompt}`). The argv (never a shell) runs through
`executors.run_command` with the task's view as its working dir (`{workspace}`; an empty dir
when the task has no view), under `[policy.command]`'s sandbox and limits, with the member's
own grants on top: `network`, `ro_binds` (its install and config; never the state dir, the
runtime dir, the key, or the home dir itself), the environment named in `env` and the values
in `set_env`. HOME is the sandbox's own `/tmp`, so a CLI's caches stay out of the view.
Timeout (`request_timeout_s`, capped by `[policy.command] max_timeout_s`) and cancellation
kill the sandbox's whole PID namespace.

The result. Its stdout (at most `executors.OUTPUT_CAP` bytes, each value of `env` replaced by
`[env NAME]`) is the task's output; its changes to the view are the task's patch (captured by
`views.settle` like any task's, which then runs the task's checks there: informed retry and
escalation apply as to any chat task). A non-zero exit, a timeout or a limit fails the attempt.

The record. Each call is one `agent.cli` entry (parent: `task.start`; the task's result hangs
off it), body `CliBody`: the argv as configured (placeholders unexpanded: no prompt, no path of
this machine, and no value from the environment, only the names of `env`), the exit status,
duration, digests and bounded excerpts of stdout and stderr, and the digest and paths of the
view's diff. A CLI's calls count against the run's wall clock, not its model calls or tokens
(they are the CLI's own).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from daemon import record as rec
from daemon.errors import InvalidInput
from daemon.plans import Task
from daemon.runs.context import Run, Setting
from daemon.runs.executors import ENV_ALLOW, CommandOutcome, chat_messages, run_command
from daemon.runs.limits import LimitExceeded
from daemon.runs.sandbox import SYSTEM_DIRS, Confinement, python_prefixes, remove_task_dir
from daemon.slots.checkup import MemberReport
from daemon.workspace.view import View, ViewFailed
from roster.models import CommandPolicy, Member, Roster

AGENT_CLI: Final = rec.AgentCli.KIND
"""[task.start] one agent CLI call: `CliBody`."""
EXCERPT = 2000
"""Characters of stdout (its head) and stderr (its tail) an `agent.cli` entry keeps."""
MAX_ARG_PROMPT = 120_000
"""Bytes a `{prompt}` argument may hold (Linux refuses one argument past 128 KiB)."""
FAILURE_TAIL = 800


CliBody = rec.AgentCli
"""The body of an `agent.cli` entry: declared with the record's other kinds, in
`daemon.record.agent`."""


class AgentCliFailed(RuntimeError):
    """The CLI ran and failed (a non-zero exit): the attempt fails with its stderr's tail."""


def member_for(roster: Roster, target: str) -> list[Member]:
    """The agent-cli members a lease target names: itself, or a tier of them; [] for servers."""
    member = roster.member(target)
    if member is not None:
        return [member] if member.agent_cli else []
    names = roster.tiers.members.get(target, [])
    found = [m for n in names if (m := roster.member(n)) is not None]
    return found if found and all(m.agent_cli for m in found) else []


_GATES: weakref.WeakKeyDictionary[Setting, dict[str, asyncio.Semaphore]] = (
    weakref.WeakKeyDictionary()
)


def _gate(s: Setting, members: Sequence[Member]) -> tuple[Member, asyncio.Semaphore]:
    """The member to call (the first with a free slot, else the first) and its gate."""
    gates = _GATES.setdefault(s, {})
    for member in members:
        gates.setdefault(member.name, asyncio.Semaphore(member.slots))
    chosen = next((m for m in members if not gates[m.name].locked()), members[0])
    return chosen, gates[chosen.name]


async def run(
    s: Setting,
    run: Run,
    task: Task,
    members: Sequence[Member],
    attempt: int,
    upstream: Mapping[str, str],
    feedback: list[str],
    previous: str | None,
    start_seq: int,
    opened: View | None,
) -> tuple[str, int | None, int]:
    """Call the CLI for one attempt: (output, exit code, the `agent.cli` seq)."""
    member, gate = _gate(s, members)
    policy = s.roster.policy.command
    if not policy.enabled:
        raise InvalidInput(
            f"agent-cli member {member.name!r} runs a command, and the command executor is off "
            "in this roster ([policy.command] enabled = false)"
        )
    text = prompt_of(task, upstream, feedback, previous)
    async with gate:
        outcome = await call(
            member,
            text,
            policy=policy,
            confinement=s.options.confinement,
            workdir=opened.path if opened is not None else None,
            timeout_s=task.timeout_s,
        )
    diff_sha, files, diff_error = await _diff(run, opened)
    body = record(member, task.id, attempt, text, outcome, diff_sha, files, diff_error)
    seq = await s.witness(run.id, body, start_seq)
    if outcome.timed_out:
        raise TimeoutError(
            f"the agent CLI {member.name!r} timed out after {outcome.duration_ms} ms "
            "(its whole process tree was killed)"
        )
    if outcome.limit is not None:
        raise LimitExceeded(outcome.limit)
    if outcome.exit_code != 0:
        tail = _tail((outcome.stderr or outcome.stdout).strip(), FAILURE_TAIL)
        raise AgentCliFailed(
            f"the agent CLI {member.name!r} exited {outcome.exit_code}"
            + (f": {tail}" if tail else "")
        )
    return outcome.stdout, outcome.exit_code, seq


def prompt_of(
    task: Task, upstream: Mapping[str, str], feedback: Sequence[str], previous: str | None
) -> str:
    """What the CLI is asked: the instruction, upstream results and the last failures."""
    text = str(
        chat_messages("", task.instruction, upstream, list(feedback), previous)[1]["content"]
    )
    if task.output_file is not None:
        text += f"\n\nWrite the result to the file {task.output_file} in the current directory."
    return text


async def call(
    member: Member,
    prompt: str,
    *,
    policy: CommandPolicy,
    confinement: Confinement,
    workdir: Path | None,
    timeout_s: float | None = None,
) -> CommandOutcome:
    """Run the member's argv on `prompt` in `workdir` (an empty dir of its own when None), in
    the sandbox with the member's grants. Returns the outcome, its argv as configured and its
    streams with the values of `env` replaced. Refuses (InvalidInput) a program that is not
    there or that the sandbox would not show, and a bind that would show what tasks must not
    see. The file-system checks run off the event loop."""
    assert member.argv is not None
    binds, program = await asyncio.to_thread(_prepare, member, policy, confinement)
    how = member.prompt or "stdin"
    if how == "arg" and len(prompt.encode()) > MAX_ARG_PROMPT:
        raise InvalidInput(
            f"agent-cli member {member.name!r}: the prompt is {len(prompt.encode())} bytes, more "
            f'than one argument may hold ({MAX_ARG_PROMPT}): use prompt = "file" or "stdin"'
        )
    scratch = await asyncio.to_thread(_scratch, confinement)
    try:
        if workdir is None:
            workdir = scratch / "work"
            workdir.mkdir(mode=0o700)
        prompt_file = scratch / "prompt" / "prompt.md"
        if how == "file":
            await asyncio.to_thread(_write_prompt, prompt_file, prompt)
        values = {
            "{prompt}": prompt,
            "{prompt_file}": str(prompt_file),
            "{workspace}": str(workdir),
        }
        argv = [program, *(_expand(part, values) for part in member.argv[1:])]
        sandboxed = policy.sandbox == "bwrap"
        cli_policy = policy.model_copy(
            update={
                "ro_binds": [*policy.ro_binds, *binds, str(scratch / "prompt")],
                "network": bool(member.network),
            }
        )
        home = "/tmp" if sandboxed else str(scratch)
        names = list(member.env or [])
        outcome = await run_command(
            argv,
            policy=cli_policy,
            confinement=confinement,
            network=bool(member.network),
            timeout_s=min(
                member.request_timeout_s,
                float(policy.max_timeout_s),
                *([timeout_s] if timeout_s else []),
            ),
            env_allow=[*ENV_ALLOW, *names],
            set_env={**(member.set_env or {}), "HOME": home, "TMPDIR": home},
            stdin=prompt if how == "stdin" else None,
            workdir=workdir,
        )
    finally:
        await asyncio.to_thread(remove_task_dir, scratch)
    secrets = {name: os.environ[name] for name in names if len(os.environ.get(name, "")) >= 6}
    return CommandOutcome(
        argv=list(member.argv),
        exit_code=outcome.exit_code,
        stdout=hide(outcome.stdout, secrets),
        stderr=hide(outcome.stderr, secrets),
        timed_out=outcome.timed_out,
        truncated=outcome.truncated,
        duration_ms=outcome.duration_ms,
        limit=outcome.limit,
    )


def static_problem(member: Member, policy: CommandPolicy, confinement: Confinement) -> str | None:
    """What would stop the member's calls before they run (its program, its binds): the
    daemon's start-up check, which runs nothing. None: nothing found."""
    try:
        _prepare(member, policy, confinement)
    except InvalidInput as err:
        return err.message
    return None


def _prepare(
    member: Member, policy: CommandPolicy, confinement: Confinement
) -> tuple[list[str], str]:
    """The member's binds and its program's path (see `grants` and `locate`)."""
    assert member.argv is not None
    binds = grants(member, confinement)
    program = locate(
        member.argv[0], [*binds, *policy.ro_binds], sandboxed=policy.sandbox == "bwrap"
    )
    return binds, program


async def probe(
    member: Member, policy: CommandPolicy, confinement: Confinement, timeout_s: float = 15.0
) -> MemberReport:
    """`tally doctor`'s check of an agent-cli member: its program is there, executable and
    shown by the sandbox, its binds are allowed, and `version_argv` (default: the program
    with `--version`) answers with exit 0 in the sandbox, with the member's grants, within
    `timeout_s`. The first line it prints is the report's `server`."""
    assert member.argv is not None
    report = MemberReport(name=member.name, kind="agent-cli", where=" ".join(member.argv))
    probe_argv = member.version_argv or [member.argv[0], "--version"]
    asked = member.model_copy(update={"argv": probe_argv, "prompt": None})
    try:
        outcome = await call(
            asked,
            "",
            policy=policy,
            confinement=confinement,
            workdir=None,
            timeout_s=timeout_s,
        )
    except InvalidInput as err:
        report.reachable = False
        report.add("error", err.message, "fix the member's argv or ro_binds, or install the CLI")
        return report
    report.latency_ms = outcome.duration_ms
    shown = " ".join(probe_argv)
    if outcome.timed_out:
        report.reachable = False
        report.add(
            "error",
            f"`{shown}` did not answer within {timeout_s:g} s in the sandbox",
            "check that it runs without a terminal or network (or grant network = true), or "
            "set version_argv to a command that answers at once",
        )
    elif outcome.exit_code != 0 or outcome.limit is not None:
        report.reachable = False
        why = outcome.limit or _tail((outcome.stderr or outcome.stdout).strip(), 300)
        report.add(
            "error",
            f"`{shown}` exited {outcome.exit_code} in the sandbox: {why}",
            "bind what it needs with ro_binds (its install, its interpreter, its config), "
            "or set version_argv",
        )
    else:
        report.reachable = True
        lines = (outcome.stdout or outcome.stderr).strip().splitlines()
        report.server = lines[0][:200] if lines else None
    return report


def record(
    member: Member,
    task: str,
    attempt: int,
    prompt: str,
    outcome: CommandOutcome,
    diff_sha256: str | None,
    files: list[str],
    diff_error: str | None,
) -> CliBody:
    assert member.argv is not None
    return CliBody(
        task=task,
        attempt=attempt,
        member=member.name,
        argv=list(member.argv),
        prompt=member.prompt or "stdin",
        prompt_sha256=_sha(prompt),
        env=list(member.env or []),
        network=bool(member.network),
        exit_code=outcome.exit_code,
        timed_out=outcome.timed_out,
        limit=outcome.limit,
        duration_ms=outcome.duration_ms,
        stdout_sha256=_sha(outcome.stdout),
        stdout_chars=len(outcome.stdout),
        stdout_head=outcome.stdout[:EXCERPT],
        stderr_sha256=_sha(outcome.stderr),
        stderr_tail=_tail(outcome.stderr, EXCERPT),
        truncated=outcome.truncated,
        diff_sha256=diff_sha256,
        files=files,
        diff_error=diff_error,
    )


def hide(text: str, secrets: Mapping[str, str]) -> str:
    """`text` with each secret's value replaced by `[env NAME]` (a CLI that prints its key)."""
    for name, value in secrets.items():
        text = text.replace(value, f"[env {name}]")
    return text


def grants(member: Member, confinement: Confinement) -> list[str]:
    """The member's `ro_binds` as paths, refused (InvalidInput) when one would show the state
    dir, the runtime dir or the key (or lie inside one), or the home dir or a parent of it, or
    does not exist."""
    home = os.path.realpath(Path.home())
    found: list[str] = []
    for raw in member.ro_binds or []:
        path = os.path.expanduser(raw) if raw.startswith("~/") else raw
        real = os.path.realpath(path)
        for hidden in confinement.hidden:
            secret = os.path.realpath(hidden)
            if secret == home:  # a dir inside home is the CLI's own (its config)
                shown = _inside(home, real)
            else:
                shown = _inside(real, secret) or _inside(secret, real)
            if shown:
                raise InvalidInput(
                    f"agent-cli member {member.name!r}: ro_binds {raw!r} would show {secret}, "
                    "which no task may see: bind the CLI's own install or config dir only",
                    details={"member": member.name, "bind": raw},
                )
        if not os.path.exists(real):
            raise InvalidInput(
                f"agent-cli member {member.name!r}: ro_binds {raw!r} does not exist",
                details={"member": member.name, "bind": raw},
            )
        found.append(path)
    return found


def locate(program: str, binds: Sequence[str], *, sandboxed: bool) -> str:
    """The program's absolute path, if it exists, is executable and the sandbox shows it."""
    path = program if program.startswith("/") else shutil.which(program)
    if path is None:
        raise InvalidInput(
            f"the agent CLI {program!r} is not on the daemon's PATH: install it, or give its "
            "absolute path in argv (and its install dir in ro_binds)",
            details={"program": program},
        )
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise InvalidInput(
            f"the agent CLI {path!r} is not an executable file", details={"program": program}
        )
    if sandboxed:
        real = os.path.realpath(path)
        roots = [*SYSTEM_DIRS, *python_prefixes(), *binds]
        if not any(_inside(p, os.path.realpath(r)) for r in roots for p in (path, real)):
            raise InvalidInput(
                f"the agent CLI {path!r} is outside what the sandbox shows (the system dirs, "
                "tally's Python, the binds): add its install dir to the member's ro_binds",
                details={"program": program},
            )
    return path


async def _diff(run: Run, opened: View | None) -> tuple[str | None, list[str], str | None]:
    if opened is None or opened.start is None or run.space is None:
        return None, [], None
    try:
        diff, files = await asyncio.to_thread(run.space.capture, opened)
    except ViewFailed as exc:
        return None, [], str(exc)
    return _sha(diff), files, None


def _scratch(confinement: Confinement) -> Path:
    """A dir of the call's own (its prompt file; its working dir without a view), named so a
    killed daemon's leftovers are cleared at start like any task dir."""
    if confinement.tasks_root is not None:
        confinement.tasks_root.mkdir(parents=True, exist_ok=True, mode=0o700)
    scratch = Path(tempfile.mkdtemp(prefix="tally-task-cli-", dir=confinement.tasks_root))
    (scratch / "prompt").mkdir(mode=0o700)  # bound read-only into the sandbox
    return scratch


def _write_prompt(path: Path, prompt: str) -> None:
    path.write_text(prompt)
    os.chmod(path, 0o444)


_PLACEHOLDER = re.compile(r"\{(?:prompt|prompt_file|workspace)\}")


def _expand(part: str, values: Mapping[str, str]) -> str:
    # One pass: a prompt that holds "{workspace}" stays as written.
    return _PLACEHOLDER.sub(lambda m: values[m.group(0)], part)


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "…" + text[-(limit - 1) :]
