"""The `tally` command. Each command group lives in its own module with a `register` function.

A module's `register(commands)` adds its sub-parsers and sets `run=` on each to a function
`(args: argparse.Namespace) -> int` returning the exit code (0 ok, 1 check failed, 2 usage).

Start-up time rule: every group module is imported to build the parser, so a group module
imports at its top only what `register` needs (the standard library, `daemon.errors`); its
`run` functions import the rest. `tally --help` then loads no pydantic, aiohttp or MCP SDK, and
each command loads only what it uses (tests/surfaces/test_start_imports.py holds this).

Memory while a command starts (the cyclic GC's thresholds, the freeze once started, malloc's
arenas) is `surfaces.cli.memory`'s.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import os
import re
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from surfaces.cli import (
    clients,
    console,
    doctor,
    ledger,
    mcp,
    models,
    plan,
    reading,
    roster,
    route,
    runs,
    serve,
    service,
    slots,
    version,
)
from surfaces.cli.memory import GC_DEFAULT, GC_STARTING

GROUPS: list[ModuleType] = [
    version, serve, mcp, runs, ledger, roster, route, plan, slots, models, doctor, clients,
    console, reading, service,
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tally",
        description="tally: local agent fleets with a verifiable ledger.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in GROUPS:
        group.register(commands)
    return parser


class PipeClosed(BaseException):
    """stdout's reader went away (`tally ledger get … | head`). A BaseException so that no
    command's own `except OSError` turns it into an error message: `main` ends quietly."""


PIPE_CLOSED_EXIT = 141
"""128 + SIGPIPE: what a shell reports for a C tool whose pipe's reader left."""


class _Stdout:
    """sys.stdout, with a write or flush to a closed pipe raised as PipeClosed."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def write(self, text: str) -> int:
        try:
            return int(self._inner.write(text))
        except BrokenPipeError:
            raise PipeClosed from None

    def flush(self) -> None:
        try:
            self._inner.flush()
        except BrokenPipeError:
            raise PipeClosed from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


_CONTROLS = re.compile(
    "\x1b\\[K|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)
"""What a terminal would obey rather than show: C0 and C1 controls (ESC starts every escape
sequence: colours, the title, OSC 52 writes the clipboard) and the bidi overrides that reorder
what is shown. Newline, tab and carriage return pass; so does the CLI's own erase-line."""


def _shown(match: re.Match[str]) -> str:
    found = match.group()
    if found == "\x1b[K":
        return found
    code = ord(found)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


class _Terminal:
    """A terminal's stream, showing the control characters in what it prints (a model's answer,
    a request a client sent, a model server's log, a file name) instead of obeying them."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def write(self, text: str) -> int:
        self._inner.write(_CONTROLS.sub(_shown, text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _terminal(stream: Any) -> Any:
    try:
        return _Terminal(stream) if stream.isatty() else stream
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return stream


def _quiet_stdout() -> int:
    """Point fd 1 at /dev/null: the interpreter's last flush then has nowhere to fail."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno() if sys.__stdout__ else 1)
        os.close(devnull)
    return PIPE_CLOSED_EXIT


def main(argv: Sequence[str] | None = None) -> int:
    atexit.unregister(gc.freeze)  # once, however often main runs in one process (tests)
    atexit.register(gc.freeze)  # runs before the exit-time collections, not when main returns
    gc.set_threshold(*GC_STARTING)
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout = _Stdout(_terminal(stdout))
    sys.stderr = _terminal(stderr)
    try:
        return _dispatch(argv)
    except PipeClosed:  # handled here once, for every command
        return _quiet_stdout()
    finally:
        sys.stdout, sys.stderr = stdout, stderr
        gc.set_threshold(*GC_DEFAULT)


def _dispatch(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # a write that bypassed sys.stdout (os.write, a saved reference)
        return _quiet_stdout()
    except Exception as exc:  # the last resort: a user gets one line, never a traceback
        if os.environ.get("TALLY_DEBUG"):
            raise
        print(f"tally: {type(exc).__name__}: {exc} (TALLY_DEBUG=1 shows where)", file=sys.stderr)
        return 1
    sys.stdout.flush()
    return code
