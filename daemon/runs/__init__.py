"""Runs: a request routed to a lane, planned into a task DAG, dispatched up an escalation
ladder and witnessed step by step in the ledger.

The surface other packages use is named here; the modules behind it are the engine's own:
the steps of a run (routing, planning, tasks and attempts, synthesis, lifecycle; model calls
in calls), what they are given (context), what the engine keeps (table, keys, feed) and the
parts they use (dispatch, guard, executors, sandbox, checks, budget, repetition).
"""

from daemon.runs.engine import Engine, EngineOptions
from daemon.runs.ports import ChatReply, LedgerPort, LedgerReader, PoolPort, RouteResult
from daemon.runs.replay import replay
from daemon.runs.state import FINAL, STOPPED, RunEvent, RunView, TaskView

__all__ = [
    "FINAL",
    "STOPPED",
    "ChatReply",
    "Engine",
    "EngineOptions",
    "LedgerPort",
    "LedgerReader",
    "PoolPort",
    "RouteResult",
    "RunEvent",
    "RunView",
    "TaskView",
    "replay",
]
