"""What a run looks like on a terminal: its tokens as tasks write them, and its attempts.

`Tokens` writes the `delta` events of a followed run as they come (as `ollama run` and `llm`
do), each task's text under its name: a line `── T1 ──` whenever the writing task changes,
and a note when an attempt starts again (a new attempt, a climb, a lost call sent again), so
text that was thrown away is never mistaken for the answer. It keeps what the last attempt of
each task wrote, so the caller need not print an answer the user has just watched being
written.

`attempt_lines` reads a run's entries (`ledger_entries` with their bodies) into one line per
attempt and one per thing that happened to it: where it ran, what failed and why, the output
of its checks, the call lost and sent again, the climb to the next rung, the task reused from
the run a retry came from. An entry kind this module does not know, naming a task, is shown
by its kind and fields, so new kinds are visible before they get their own words.

Bodies are read as their kinds' models (`daemon.record`): they come from a daemon that may be
older or newer than this CLI, so a later field is read past, and a body that does not fit its
kind (or a kind this tally does not know) is shown as that generic line rather than misread.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, TextIO

from pydantic import ValidationError

from daemon import record as rec

RULE = "──"
SHOWN = 400
"""Characters of a failure, a check's output or an error shown per line in `tally run`."""


class Tokens:
    """Writes a run's streamed tokens to `out`, named by task (see the module doc)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.writer: str | None = None  # the task whose text the cursor follows
        self.mid_line = False
        self.written: dict[str, str] = {}  # task (or "synthesis") -> its last attempt's text

    def delta(self, data: Any) -> None:
        if not isinstance(data, dict) or not isinstance(data.get("text"), str):
            return
        task = data.get("task") if isinstance(data.get("task"), str) else None
        name = task or "synthesis"
        if name != self.writer:
            self._line(f"{RULE} {name} {RULE}")
            self.writer = name
        text = data["text"]
        self.written[name] = self.written.get(name, "") + text
        self.out.write(text)
        self.mid_line = not text.endswith("\n")
        self.out.flush()

    def entry(self, kind: str, data: Any) -> None:
        """An entry of the run: a new attempt, a lost call or a climb starts a task's text over."""
        body = typed(kind, data)
        note: str | None = None
        task: str | None = None
        if isinstance(body, rec.TaskStart) and body.attempt > 1:
            task = body.task
            note = f"{task}: attempt {body.attempt} on {body.tier or '-'}"
        elif isinstance(body, rec.ModelRetry):
            task = body.task
            note = (
                f"{task or 'synthesis'}: the call to {body.member or body.target} was lost "
                f"({_cut(body.error)}); sending it again in {body.wait_ms / 1000:g} s"
            )
        elif isinstance(body, rec.TaskEscalate):
            task = body.task
            note = f"{task}: {body.from_tier} → {body.to_tier}: {_cut(body.reason)}"
        if note is None:
            return
        name = task or "synthesis"
        self.written.pop(name, None)
        self._line(f"{RULE} {note} {RULE}")
        self.writer = None

    def pause(self) -> None:
        """Something else is about to be written: end the text's line; the next token says
        again whose it is."""
        if self.mid_line:
            self.out.write("\n")
            self.mid_line = False
            self.writer = None
        self.out.flush()

    def end(self) -> None:
        if self.mid_line:
            self.out.write("\n")
            self.mid_line = False
        self.out.flush()

    def showed(self, answer: str | None) -> bool:
        """Whether `answer` is exactly what one task's last attempt was seen writing."""
        if not answer or not answer.strip():
            return False
        return any(text.strip() == answer.strip() for text in self.written.values())

    def _line(self, text: str) -> None:
        if self.mid_line:
            self.out.write("\n")
        self.out.write(text + "\n")
        self.mid_line = False
        self.out.flush()


def typed(kind: str, data: Any) -> rec.Body | None:
    """`data` as its kind's model; None for a kind this tally does not know or a body that
    does not fit it (shown by its fields, not read as its kind: see the module doc)."""
    try:
        return rec.read(kind, data)
    except ValidationError:
        return None


_RULE = re.compile(r"([=\-_*~#])\1{4,}")


def _cut(value: Any, limit: int = SHOWN) -> str:
    text = " ".join(str(value if value is not None else "").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069]")


def _plain(value: Any, limit: int) -> str:
    """Model-written text made safe for a terminal: whitespace runs as one space, every other
    control or invisible character (an escape sequence, a bidi override) shown as its code."""
    text = " ".join(str(value if value is not None else "").split())
    text = _CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def step_line(step: rec.AgentStep) -> str:
    """One `agent.step` (its body, whole or as the live feed cuts it) on one line: step, tool,
    arguments, outcome and observation, tokens (cached of prompt) and time."""
    args = ", ".join(
        f"{_plain(k, 40)}={_plain(v, 60)}" for k, v in step.arguments.items() if v is not None
    )
    call = f"{_plain(step.tool, 40)}({_plain(args, 160)})" if step.tool else "(no call)"
    tokens, timings = step.tokens, step.timings
    cost = (
        f"{tokens.prompt}+{tokens.completion} tok"
        f" ({tokens.cached} cached), {timings.step_us // 1000} ms"
    )
    seen = _plain(step.observation, 160)
    return f"step {_plain(step.step, 6)} {call} → {_plain(step.outcome, 20)}: {seen} · {cost}"


def attempt_lines(entries: Iterable[dict[str, Any]]) -> dict[str, list[str]]:
    """Per task id, its attempts and what happened to each, from the run's entries in order
    (each `{"kind", "seq", "content"}` as `ledger_entries` returns them with bodies)."""
    out: dict[str, list[str]] = {}
    for entry in entries:
        kind, seq = str(entry.get("kind")), entry.get("seq")
        content = entry.get("content")
        body = typed(kind, content)
        if isinstance(body, rec.WorkspaceCarry):
            _carry_lines(out, body, seq)
            continue
        task = getattr(body, "task", None) if body is not None else None
        line: str | None
        if body is None and isinstance(content, dict):  # not read as a kind: its fields
            task, line = content.get("task"), _fields(kind, content)
        else:
            line = None if body is None else _describe(body)
        if not isinstance(task, str):
            continue
        lines = out.setdefault(task, [])
        if line:
            lines.append(f"{line}  [seq {seq}]")
    return out


def _carry_lines(out: dict[str, list[str]], b: rec.WorkspaceCarry, seq: Any) -> None:
    """A retry's `workspace.carry` names no one task: a line for each task it decided about."""
    for task, why in b.redo.items():
        line = f"not reused from run {b.from_run}, runs again: {_cut(why)}"
        out.setdefault(task, []).append(f"{line}  [seq {seq}]")
    for task, paths in b.changed.items():
        line = (
            f"its changes carried onto the workspace as it is now; {', '.join(paths)} changed since"
        )
        out.setdefault(task, []).append(f"{_cut(line)}  [seq {seq}]")


def _describe(b: rec.Body) -> str | None:
    if isinstance(b, rec.TaskStart):
        told = f", told: {_cut('; '.join(b.feedback), 200)}" if b.feedback else ""
        return f"attempt {b.attempt} on {b.tier or b.executor}{told}"
    if isinstance(b, rec.ModelCall):
        return f"  call to {b.member} (slot {b.slot}) for {b.purpose}"
    if isinstance(b, rec.ModelReply):
        if b.error:
            return f"  reply from {b.member} failed: {_cut(b.error)}"
        tokens = (b.usage.completion_tokens or 0) if b.usage is not None else 0
        return f"  reply from {b.member}: {tokens} tokens, {b.finish_reason}"
    if isinstance(b, rec.ModelRetry):
        return (
            f"  call lost on {b.member or b.target} "
            f"({b.lost}/{b.retries}): {_cut(b.error)}; sent again"
        )
    if isinstance(b, rec.CommandRun):
        tail = _cut(b.stderr or b.stdout or "", 200)
        return f"  command exit {b.exit_code}" + (f": {tail}" if tail else "")
    if isinstance(b, rec.AgentCli):  # one call of an agent-cli member (daemon.runs.agentcli)
        failed = b.timed_out or b.exit_code != 0
        how = "timed out" if b.timed_out else f"exit {b.exit_code}"
        changed = f", changed {_cut(', '.join(b.files), 120)}" if b.files else ""
        tail = _cut(b.stderr_tail or "", 200) if failed else ""
        said = f"  agent CLI {b.member}: {how} in {b.duration_ms} ms{changed}"
        return said + (f": {tail}" if tail else "")
    if isinstance(b, rec.TaskResult):
        return f"  executor failed: {_cut(b.error)}" if b.error else None
    if isinstance(b, rec.TaskVerdict):
        said = f" (judge: {_cut(b.judge.reason, 200)})" if b.judge is not None else ""
        if b.ok:
            return f"  passed{said} → {b.next}"
        lines = [f"  failed → {b.next}{said}"]
        lines += [f"    - {_cut(f)}" for f in b.failures]
        return "\n".join(lines)
    if isinstance(b, rec.TaskDiff):  # the generic form showed a 40-hex index line, or nothing
        if b.error:
            return f"  changes not captured: {_cut(b.error)}"
        more = f" and {len(b.files) - 10} more" if len(b.files) > 10 else ""
        return f"  changed {', '.join(b.files[:10])}{more}" if b.files else "  changed no file"
    if isinstance(b, rec.CheckRun):
        how = "timed out" if b.timed_out else f"exit {b.exit_code}"
        output = f"{b.stdout_tail} {b.stderr_tail}".strip()
        output = _RULE.sub(r"\1\1\1", output)  # a test runner's ===/--- rules ate the line
        shown = f": {_cut(output, 300)}" if output else ""
        return f"  check `{_cut(' '.join(b.argv), 120)}` ({b.source}): {how}{shown}"
    if isinstance(b, rec.TaskEscalate):
        return f"  climbs {b.from_tier} → {b.to_tier}: {_cut(b.reason)}"
    if isinstance(b, rec.AgentStep):
        return "  " + step_line(b)
    if isinstance(b, rec.TaskSkip):
        return f"skipped: {_cut(b.reason)}"
    if isinstance(b, rec.TaskReuse):
        return f"reused, done in run {b.from_run} (seq {b.from_seq})"
    return _fields(b.KIND, b.model_dump())


def _fields(kind: str, b: dict[str, Any]) -> str:
    """Any other entry naming a task, by its kind and fields."""
    fields = ", ".join(
        f"{key}={_cut(value, 120)}"
        for key, value in b.items()
        if key != "task" and value not in (None, "", [], {})
    )
    return f"  {kind}: {fields}"
