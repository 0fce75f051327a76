"""The agent's tools: each a pydantic input model, each bounded, none reaching outside the view.

`list_files`, `read_file`, `search`, `write_file`, `edit` work on the view through `Jail`
(paths resolved inside it, hidden patterns invisible); `run` hands an argv to the command
executor's sandbox with the view as its working dir; `finish` is the loop's to judge (it
needs the task's checks). Every limit is a number in `ToolLimits`, and hitting one says so
in the observation, so the model knows the text it sees is cut and how to see the rest.
File work is blocking I/O: the loop runs it in a worker thread.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import re2
from pydantic import BaseModel, ConfigDict, Field, model_validator

from daemon.runs.agent.paths import Jail, PathRefused
from daemon.runs.executors import CommandOutcome

KB = 1024
MB = 1024 * KB


class _Input(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)

    @model_validator(mode="before")
    @classmethod
    def _absent(cls, data: Any) -> Any:
        """An optional argument sent as null or "" is absent (small models write
        `"glob": ""` or `"start_line": null` for "not this one"); required ones stay as sent."""
        if not isinstance(data, dict):
            return data
        return {
            key: value
            for key, value in data.items()
            if not (
                key in cls.model_fields
                and not cls.model_fields[key].is_required()
                and (value is None or (isinstance(value, str) and not value.strip()))
            )
        }


class ListFiles(_Input):
    """List the project's files (recursively) under a directory, optionally filtered by a glob."""

    path: str = Field(default=".", description="directory relative to the project root")
    glob: str | None = Field(default=None, description="e.g. '*.py' (matches names or paths)")


class ReadFile(_Input):
    """Read a text file, optionally only lines start_line..end_line (1-based, inclusive)."""

    path: str
    start_line: Annotated[int, Field(ge=1, le=1 << 30)] | None = None
    end_line: Annotated[int, Field(ge=1, le=1 << 30)] | None = None


class Search(_Input):
    """Search the project's text files with a regular expression (RE2 syntax)."""

    pattern: str = Field(min_length=1, max_length=1000)
    path: str = Field(default=".", description="directory to search in")
    glob: str | None = None


class WriteFile(_Input):
    """Create or overwrite a file with the given content."""

    path: str
    content: str


class Edit(_Input):
    """Replace the exact text `old` (which must occur exactly once) with `new` in a file."""

    path: str
    old: str = Field(min_length=1)
    new: str


class Run(_Input):
    """Run a command (an argv list, no shell) in the project directory, in the sandbox."""

    argv: list[str] = Field(min_length=1, max_length=64)


class Finish(_Input):
    """Say the task is done, with a short summary; accepted once the task's checks pass."""

    summary: str = Field(max_length=4000)


TOOLS: dict[str, type[_Input]] = {
    "list_files": ListFiles,
    "read_file": ReadFile,
    "search": Search,
    "write_file": WriteFile,
    "edit": Edit,
    "run": Run,
    "finish": Finish,
}
ToolName = Literal["list_files", "read_file", "search", "write_file", "edit", "run", "finish"]


@dataclass(frozen=True)
class ToolLimits:
    list_entries: int = 200
    walk_entries: int = 20_000
    """Directory entries looked at per list/search, however deep the tree."""
    read_chars: int = 24_000
    """Characters of a file one read_file returns."""
    read_file_max: int = 8 * MB
    """Files larger than this are not read at all (line ranges included)."""
    search_matches: int = 50
    search_file_max: int = 1 * MB
    search_total: int = 32 * MB
    """Bytes one search reads across files."""
    line_chars: int = 240
    write_chars: int = 256 * KB
    run_output: int = 8000
    """Characters of stdout + stderr a run shows (head and tail kept)."""
    argv_chars: int = 8 * KB


Runner = Callable[[list[str]], Awaitable[CommandOutcome]]
"""Runs an argv in the sandbox with the view as its working dir (see `loop.sandboxed`)."""


@dataclass
class Observation:
    text: str
    ok: bool
    """False: the tool refused or failed (the text says why); the loop goes on."""


class ToolError(Exception):
    """A tool that cannot do what was asked; the message is the observation."""


def _matches(glob: str | None, name: str, path: str) -> bool:
    """Whether a file is in; no glob (None, "", "*", "**") takes every file."""
    if glob is None or glob.strip() in ("", "*", "**", "**/*"):
        return True
    return fnmatch.fnmatchcase(name, glob) or fnmatch.fnmatchcase(path, glob)


def _is_binary(head: bytes) -> bool:
    return b"\x00" in head


class Toolbox:
    """The tools bound to one view."""

    def __init__(self, jail: Jail, runner: Runner | None, limits: ToolLimits) -> None:
        self.jail = jail
        self.runner = runner
        self.limits = limits
        self.writes = 0
        """Writes that changed a file: a call repeated after one is not the same call."""

    # ------------------------------------------------------------------ walking

    def _walk(self, start: str, glob: str | None) -> Iterator[tuple[str, os.stat_result]]:
        """(relative path, lstat) of each regular file under `start`, hidden ones and `.git`
        left out, symlinks not followed, at most `walk_entries` entries looked at."""
        rel, real = self.jail.resolve(start)
        try:
            st = os.stat(real)
        except FileNotFoundError:
            raise PathRefused(
                f"{rel or '.'!r} does not exist: give no path to look at the whole project; to "
                "create a file, call write_file with its path and content"
            ) from None
        if not stat.S_ISDIR(st.st_mode):
            raise PathRefused(f"{rel!r} is a file, not a directory: use read_file")
        seen = 0
        stack = [(rel, real)]
        while stack:
            dir_rel, dir_real = stack.pop()
            try:
                with os.scandir(dir_real) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError:
                continue
            subdirs = []
            for entry in entries:
                seen += 1
                if seen > self.limits.walk_entries:
                    raise _Truncated()
                child = f"{dir_rel}/{entry.name}" if dir_rel else entry.name
                if entry.name == ".git" or self.jail.is_hidden(child):
                    continue
                try:
                    est = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(est.st_mode):
                    subdirs.append((child, Path(entry.path)))
                elif stat.S_ISREG(est.st_mode) and _matches(glob, entry.name, child):
                    yield child, est
            stack.extend(reversed(subdirs))

    # ------------------------------------------------------------------ the tools

    def list_files(self, args: ListFiles) -> str:
        lines: list[str] = []
        more = False
        try:
            for rel, st in self._walk(args.path, args.glob):
                if len(lines) >= self.limits.list_entries:
                    more = True
                    break
                lines.append(f"{rel} ({st.st_size} bytes)")
        except _Truncated:
            more = True
        if not lines:
            if args.glob:
                return (
                    f"no files matching {args.glob!r} under {args.path!r}: list_files with no "
                    "glob shows every file"
                )
            return f"no files under {args.path!r}: the project is empty there"
        if more:
            lines.append(
                f"[listing cut at {len(lines)} files: give a subdirectory or a glob to see more]"
            )
        return "\n".join(lines)

    def overview(self, most: int) -> list[str] | None:
        """The view's files (as list_files shows them) if there are at most `most`; else None."""
        found: list[str] = []
        try:
            for rel, st in self._walk(".", None):
                if len(found) >= most:
                    return None
                found.append(f"{rel} ({st.st_size} bytes)")
        except (_Truncated, PathRefused):
            return None
        return found

    def read_file(self, args: ReadFile) -> str:
        rel, real = self.jail.resolve(args.path)
        if not os.path.lexists(real):
            # Small models read the file they were asked to create: say what to send instead.
            raise ToolError(
                f"{rel!r} does not exist yet. To create it, call write_file with path {rel!r} "
                "and its full content; list_files shows the files that exist"
            )
        st = self.jail.regular(rel, real)
        if st.st_size > self.limits.read_file_max:
            raise ToolError(
                f"{rel!r} is {st.st_size:,} bytes; files over {self.limits.read_file_max:,} "
                "bytes are not read (use search to find what you need in the project)"
            )
        with open(real, "rb") as f:
            data = f.read(self.limits.read_file_max + 1)
        if _is_binary(data[:8192]):
            raise ToolError(f"{rel!r} is a binary file: only text files can be read")
        lines = data.decode("utf-8", errors="replace").splitlines(keepends=True)
        start = (args.start_line or 1) - 1
        end = len(lines) if args.end_line is None else min(args.end_line, len(lines))
        if lines and start >= len(lines):
            raise ToolError(f"{rel!r} has {len(lines)} lines; start_line is past its end")
        text = "".join(lines[start:end])
        header = f"{rel}: lines {start + 1}-{max(start + 1, end)} of {len(lines)}"
        if len(text) > self.limits.read_chars:
            cut = text[: self.limits.read_chars]
            shown = start + cut.count("\n")
            return (
                f"{header}\n{cut}\n[cut at {self.limits.read_chars} characters, after line "
                f"{shown}: read again with start_line={shown + 1}]"
            )
        return f"{header}\n{text}"

    def search(self, args: Search) -> str:
        try:
            regex = re2.compile(args.pattern)
        except Exception as err:  # re2.error, or a pattern RE2 refuses as too large
            raise ToolError(f"not a valid RE2 pattern: {err}") from None
        found: list[str] = []
        budget = self.limits.search_total
        more = False
        try:
            for rel, st in self._walk(args.path, args.glob):
                if st.st_size > self.limits.search_file_max or st.st_size > budget:
                    continue
                _, real = self.jail.resolve(rel)
                try:
                    with open(real, "rb") as f:
                        data = f.read(self.limits.search_file_max)
                except OSError:
                    continue
                budget -= len(data)
                if _is_binary(data[:8192]):
                    continue
                for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
                    if regex.search(line):
                        if len(found) >= self.limits.search_matches:
                            more = True
                            break
                        found.append(f"{rel}:{number}: {line[: self.limits.line_chars]}")
                if more or budget <= 0:
                    more = more or budget <= 0
                    break
        except _Truncated:
            more = True
        if not found:
            return f"no match for {args.pattern!r}"
        if more:
            found.append(f"[cut at {len(found)} matches: narrow the pattern, path or glob]")
        return "\n".join(found)

    def write_file(self, args: WriteFile) -> str:
        if len(args.content) > self.limits.write_chars:
            raise ToolError(
                f"the content is {len(args.content):,} characters; at most "
                f"{self.limits.write_chars:,} are written at once"
            )
        rel, real = self.jail.resolve(args.path, write=True)
        size = len(args.content.encode())
        if not self._put(rel, real, args.content):
            return f"{rel} already holds exactly this content ({size} bytes): nothing changed"
        return f"wrote {rel} ({size} bytes)"

    def edit(self, args: Edit) -> str:
        rel, real = self.jail.resolve(args.path, write=True)
        st = self.jail.regular(rel, real)
        if st.st_size > self.limits.read_file_max:
            raise ToolError(f"{rel!r} is too large to edit ({st.st_size:,} bytes)")
        with open(real, "rb") as f:
            data = f.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError(f"{rel!r} is not UTF-8 text: it cannot be edited") from None
        count = text.count(args.old)
        if count == 0:
            hint = ""
            if args.old.strip() and text.count(args.old.strip()) == 1:
                hint = " (it does once without its leading/trailing whitespace)"
            raise ToolError(
                f"edit failed: the old text was not found in {rel}{hint}; read_file it and copy "
                "the exact text, indentation included"
            )
        if count > 1:
            raise ToolError(
                f"edit failed: the old text matches {count} places in {rel}; include more "
                "surrounding lines so that it matches exactly once"
            )
        new = text.replace(args.old, args.new, 1)
        if len(new) > self.limits.write_chars * 4:
            raise ToolError(f"edit failed: {rel} would grow past {self.limits.write_chars * 4:,}")
        line = text[: text.index(args.old)].count("\n") + 1
        if not self._put(rel, real, new):
            return f"{rel} unchanged: the new text is the old text"
        return f"edited {rel} at line {line}: {len(args.old)} characters became {len(args.new)}"

    def _put(self, rel: str, real: Path, content: str) -> bool:
        """Write through no symlink and onto nothing but a regular file (or a new one);
        False when the file already held exactly this (then nothing is written)."""
        if real.exists() and not real.is_file():
            raise PathRefused(f"{rel!r} exists and is not a regular file")
        data = content.encode("utf-8")
        if real.is_file() and real.stat().st_size == len(data) and real.read_bytes() == data:
            return False
        parent = real.parent
        if not self.jail.contains(Path(os.path.realpath(parent))):
            raise PathRefused(f"{rel!r} resolves outside the project")
        parent.mkdir(parents=True, exist_ok=True)
        before = real.stat().st_mtime if real.exists() else None
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(real, flags, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(content)
            f.flush()
            after = os.fstat(f.fileno())
            if before is not None and int(after.st_mtime) <= int(before):
                # Python's .pyc (and make) trust a source whose whole-second mtime and size are
                # unchanged: an edit of the same length within the second would run stale code.
                os.utime(f.fileno(), (after.st_atime, int(before) + 1))
        self.writes += 1
        return True

    async def run(self, args: Run) -> Observation:
        if self.runner is None:
            return Observation("run is not available for this task", ok=False)
        if sum(len(a) for a in args.argv) > self.limits.argv_chars:
            return Observation(f"the argv is over {self.limits.argv_chars} characters", ok=False)
        if any("\x00" in a for a in args.argv) or not args.argv[0]:
            return Observation("an argument holds a NUL byte, or the program is empty", ok=False)
        outcome = await self.runner(list(args.argv))
        return Observation(self._ran(outcome), ok=outcome.exit_code == 0)

    def _ran(self, outcome: CommandOutcome) -> str:
        if outcome.timed_out:
            head = f"timed out after {outcome.duration_ms} ms (killed with everything it started)"
        else:
            head = f"exit code {outcome.exit_code} ({outcome.duration_ms} ms)"
        half = self.limits.run_output // 2
        parts = [head]
        for name, text in (("stdout", outcome.stdout), ("stderr", outcome.stderr)):
            if not text:
                continue
            if len(text) > half:  # the end of a test run says what failed: keep head and tail
                keep = half // 2
                text = f"{text[:keep]}\n[… {len(text) - 2 * keep} characters cut …]\n{text[-keep:]}"
            parts.append(f"--- {name} ---\n{text}")
        if outcome.truncated:
            parts.append("[the output was longer than the executor keeps]")
        return "\n".join(parts)

    async def use(self, name: str, arguments: dict[str, Any], *, thread: Any) -> Observation:
        """Validate `arguments` for tool `name` and run it (not `finish`: the loop's own).

        `thread` runs a blocking function off the event loop (`asyncio.to_thread`)."""
        model = TOOLS[name]
        args = model.model_validate(arguments)
        try:
            if isinstance(args, Run):
                return await self.run(args)
            method = getattr(self, name)
            text = await thread(method, args)
            return Observation(str(text), ok=True)
        except (PathRefused, ToolError) as err:
            return Observation(str(err), ok=False)
        except OSError as err:
            return Observation(f"{name} failed: {err.strerror or err}", ok=False)


class _Truncated(Exception):
    """A walk that looked at its limit of entries."""
