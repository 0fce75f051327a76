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
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, TextIO

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
        if not isinstance(data, dict):
            return
        task = data.get("task") if isinstance(data.get("task"), str) else None
        note: str | None = None
        if kind == "task.start" and int(data.get("attempt") or 1) > 1 and task is not None:
            note = f"{task}: attempt {data.get('attempt')} on {data.get('tier') or '-'}"
        elif kind == "model.retry":
            where = data.get("member") or data.get("target")
            note = (
                f"{task or 'synthesis'}: the call to {where} was lost ({_cut(data.get('error'))}); "
                f"sending it again in {int(data.get('wait_ms') or 0) / 1000:g} s"
            )
        elif kind == "task.escalate" and task is not None:
            climb = f"{data.get('from_tier')} → {data.get('to_tier')}"
            note = f"{task}: {climb}: {_cut(data.get('reason'))}"
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


def step_line(b: dict[str, Any]) -> str:
    """One `agent.step` (its body, whole or as the live feed cuts it) on one line: step, tool,
    arguments, outcome and observation, tokens (cached of prompt) and time."""
    got = b.get("arguments")
    arguments: dict[str, Any] = got if isinstance(got, dict) else {}
    args = ", ".join(
        f"{_plain(k, 40)}={_plain(v, 60)}" for k, v in arguments.items() if v is not None
    )
    call = f"{_plain(b.get('tool'), 40)}({_plain(args, 160)})" if b.get("tool") else "(no call)"
    tokens: dict[str, Any] = b["tokens"] if isinstance(b.get("tokens"), dict) else {}
    timings: dict[str, Any] = b["timings"] if isinstance(b.get("timings"), dict) else {}
    cost = (
        f"{tokens.get('prompt', 0)}+{tokens.get('completion', 0)} tok"
        f" ({tokens.get('cached', 0)} cached), {int(timings.get('step_us') or 0) // 1000} ms"
    )
    seen = _plain(b.get("observation"), 160)
    return (
        f"step {_plain(b.get('step'), 6)} {call} → {_plain(b.get('outcome'), 20)}: {seen} · {cost}"
    )


def attempt_lines(entries: Iterable[dict[str, Any]]) -> dict[str, list[str]]:
    """Per task id, its attempts and what happened to each, from the run's entries in order
    (each `{"kind", "seq", "content"}` as `ledger_entries` returns them with bodies)."""
    out: dict[str, list[str]] = {}
    for entry in entries:
        kind = str(entry.get("kind"))
        body = entry.get("content")
        if kind == "workspace.carry" and isinstance(body, dict):
            _carry_lines(out, body, entry.get("seq"))
            continue
        if not isinstance(body, dict) or not isinstance(body.get("task"), str):
            continue
        lines = out.setdefault(body["task"], [])
        line = _describe(kind, body)
        if line:
            lines.append(f"{line}  [seq {entry.get('seq')}]")
    return out


def _carry_lines(out: dict[str, list[str]], b: dict[str, Any], seq: Any) -> None:
    """A retry's `workspace.carry` names no one task: a line for each task it decided about."""
    origin = b.get("from_run")
    redo, changed = b.get("redo"), b.get("changed")
    for task, why in (redo if isinstance(redo, dict) else {}).items():
        line = f"not reused from run {origin}, runs again: {_cut(why)}"
        out.setdefault(str(task), []).append(f"{line}  [seq {seq}]")
    for task, paths in (changed if isinstance(changed, dict) else {}).items():
        named = ", ".join(str(p) for p in paths) if isinstance(paths, list) else ""
        line = f"its changes carried onto the workspace as it is now; {named} changed since"
        out.setdefault(str(task), []).append(f"{_cut(line)}  [seq {seq}]")


def _describe(kind: str, b: dict[str, Any]) -> str | None:
    if kind == "task.start":
        feedback = b.get("feedback") or []
        told = f", told: {_cut('; '.join(map(str, feedback)), 200)}" if feedback else ""
        return f"attempt {b.get('attempt')} on {b.get('tier') or b.get('executor')}{told}"
    if kind == "model.call":
        return f"  call to {b.get('member')} (slot {b.get('slot')}) for {b.get('purpose')}"
    if kind == "model.reply":
        usage = b.get("usage") or {}
        if b.get("error"):
            return f"  reply from {b.get('member')} failed: {_cut(b.get('error'))}"
        tokens = int(usage.get("completion_tokens") or 0) if isinstance(usage, dict) else 0
        return f"  reply from {b.get('member')}: {tokens} tokens, {b.get('finish_reason')}"
    if kind == "model.retry":
        return (
            f"  call lost on {b.get('member') or b.get('target')} "
            f"({b.get('lost')}/{b.get('retries')}): {_cut(b.get('error'))}; sent again"
        )
    if kind == "command.run":
        tail = _cut(b.get("stderr") or b.get("stdout") or "", 200)
        return f"  command exit {b.get('exit_code')}" + (f": {tail}" if tail else "")
    if kind == "agent.cli":  # one call of an agent-cli member (daemon.runs.agentcli)
        failed = b.get("timed_out") or b.get("exit_code") != 0
        how = "timed out" if b.get("timed_out") else f"exit {b.get('exit_code')}"
        files = [str(f) for f in b.get("files") or []]
        changed = f", changed {_cut(', '.join(files), 120)}" if files else ""
        tail = _cut(b.get("stderr_tail") or "", 200) if failed else ""
        said = f"  agent CLI {b.get('member')}: {how} in {b.get('duration_ms')} ms{changed}"
        return said + (f": {tail}" if tail else "")
    if kind == "task.result":
        return f"  executor failed: {_cut(b.get('error'))}" if b.get("error") else None
    if kind == "task.verdict":
        failures = [str(f) for f in b.get("failures") or []]
        judge = b.get("judge")
        said = f" (judge: {_cut(judge.get('reason'), 200)})" if isinstance(judge, dict) else ""
        if b.get("ok"):
            return f"  passed{said} → {b.get('next')}"
        lines = [f"  failed → {b.get('next')}{said}"]
        lines += [f"    - {_cut(f)}" for f in failures]
        return "\n".join(lines)
    if kind == "task.diff":  # the generic form showed a 40-hex index line, or nothing at all
        if b.get("error"):
            return f"  changes not captured: {_cut(b.get('error'))}"
        files = [str(f) for f in b.get("files") or []]
        more = f" and {len(files) - 10} more" if len(files) > 10 else ""
        return f"  changed {', '.join(files[:10])}{more}" if files else "  changed no file"
    if kind == "check.run":
        argv = " ".join(str(a) for a in b.get("argv") or [])
        how = "timed out" if b.get("timed_out") else f"exit {b.get('exit_code')}"
        output = " ".join(str(b.get(k) or "") for k in ("stdout_tail", "stderr_tail")).strip()
        output = _RULE.sub(r"\1\1\1", output)  # a test runner's ===/--- rules ate the line
        shown = f": {_cut(output, 300)}" if output else ""
        return f"  check `{_cut(argv, 120)}` ({b.get('source')}): {how}{shown}"
    if kind == "task.escalate":
        return f"  climbs {b.get('from_tier')} → {b.get('to_tier')}: {_cut(b.get('reason'))}"
    if kind == "agent.step":
        return "  " + step_line(b)
    if kind == "task.skip":
        return f"skipped: {_cut(b.get('reason'))}"
    if kind == "task.reuse":
        return f"reused, done in run {b.get('from_run')} (seq {b.get('from_seq')})"
    fields = ", ".join(
        f"{key}={_cut(value, 120)}"
        for key, value in b.items()
        if key != "task" and value not in (None, "", [], {})
    )
    return f"  {kind}: {fields}"
