"""The tool registry: the one list of tools HTTP, OpenAPI and MCP are generated from.

Each tool is declared once, in the module of its area, beside its handler, its models and the
errors it can answer with (`Tool.errors`). This module only lists them, in the order surfaces
publish them (the OpenAPI paths and MCP's `tools/list`), and is the one place that does.
"""

from __future__ import annotations

from typing import Any

from daemon.errors import TallyError
from daemon.tools import checkpoints, clients, console, ledger, pool, roster, runs
from daemon.tools.pool import slots_out
from daemon.tools.progress import ProgressSteps
from daemon.tools.runs import SubmitIn
from daemon.tools.tool import RunOut, Tool, ToolContext, run_out

# What surfaces import from here (each loads the registry at its first use), besides the list.
__all__ = [
    "ERRORS",
    "TOOLS",
    "ProgressSteps",
    "RunOut",
    "SubmitIn",
    "Tool",
    "ToolContext",
    "run_out",
    "slots_out",
]


def _registry(tools: tuple[Tool[Any, Any], ...]) -> dict[str, Tool[Any, Any]]:
    named: dict[str, Tool[Any, Any]] = {}
    for tool in tools:
        if tool.name in named:
            raise ValueError(f"two tools are named {tool.name!r}: each is declared once")
        named[tool.name] = tool
    return named


TOOLS: dict[str, Tool[Any, Any]] = _registry(
    (
        pool.HEALTH,
        roster.ROUTE,
        roster.ROUTE_TEACH,
        roster.ROUTE_SUGGEST,
        roster.PLAN,
        runs.SUBMIT,
        runs.RUN_GET,
        runs.RUNS_LIST,
        runs.RUN_CANCEL,
        runs.RUN_RESUME,
        runs.RUN_RETRY,
        runs.RUN_PATCH,
        runs.RUN_APPLY,
        runs.RUN_REPLAY,
        runs.RUN_COMPARE,
        ledger.LEDGER_VERIFY,
        ledger.LEDGER_VERIFY_REMOTE,
        ledger.LEDGER_ENTRIES,
        ledger.LEDGER_GET,
        checkpoints.LEDGER_PROOF,
        checkpoints.LEDGER_CHECKPOINT,
        checkpoints.LEDGER_COSIGN,
        checkpoints.LEDGER_COSIGNED,
        checkpoints.LEDGER_COSIGN_COLLECT,
        ledger.CAUSAL_CHAIN,
        ledger.LEDGER_REDACT,
        roster.ROSTER_GET,
        roster.ROSTER_RELOAD,
        pool.SLOTS_STATUS,
        ledger.LEDGER_SUMMARY,
        clients.CLIENT_ADD,
        clients.CLIENT_LIST,
        clients.CLIENT_REVOKE,
        pool.STATUS,
        pool.DAEMON_STOP,
        console.RUN_FEED,
    )
)

ERRORS: dict[str, tuple[type[TallyError], ...]] = {
    t.name: t.errors for t in TOOLS.values() if t.errors
}
"""Each tool's own errors (`Tool.errors`) by name, for the surfaces that look them up so."""
