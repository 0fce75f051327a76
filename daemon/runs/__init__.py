"""Runs: a request routed to a lane, planned into a task DAG, dispatched up an escalation
ladder and witnessed step by step in the ledger.

The surface other packages use is named here; the modules behind it (dispatch, guard,
executors, sandbox, checks, budget, repetition) are the engine's own.
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
