"""The suite's one way to wait for a condition: poll it until it holds, or fail saying what.

A test waits for a state (an event seen, a port free, the ledger writable), never for a time:
the timeout only bounds a wait that would otherwise hang, so it is generous (the suite runs on
a loaded two-core machine beside other suites) and a test never asserts how long the wait took.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

INTERVAL_S = 0.02
TIMEOUT_S = 30.0
"""The default bound: far above any wait on an idle machine, so only a hang reaches it."""


def _what(what: str | Callable[[], str] | None) -> str:
    if callable(what):
        return what()
    return what or "the condition"


async def until(
    check: Callable[[], Any],
    timeout: float = TIMEOUT_S,
    what: str | Callable[[], str] | None = None,
) -> Any:
    """Poll `check` (sync or async) until it returns something true, and return that; raise
    AssertionError naming `what` (a string, or a function giving one at the time of failure)
    once `timeout` seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{_what(what)}: not reached within {timeout:g} s")
        await asyncio.sleep(INTERVAL_S)


def until_sync(
    check: Callable[[], Any],
    timeout: float = TIMEOUT_S,
    what: str | Callable[[], str] | None = None,
) -> Any:
    """`until` for code outside an event loop (it sleeps the thread)."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{_what(what)}: not reached within {timeout:g} s")
        time.sleep(INTERVAL_S)
    return value
