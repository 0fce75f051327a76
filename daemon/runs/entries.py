"""The names of the kinds the runs engine writes (`k.REQUEST`, ...), for its steps and readers.

Each kind's body is a model in `daemon.record` (`daemon/record/runs.py`, `daemon/record/agent.py`),
which states its fields, who writes it and its parents' kinds; `tally ledger schema` publishes
them. Actor is "engine" for everything here; the daemon writes `slot.*` entries with actor
"pool" and the reconcile entries (`run.interrupted`) with actor "daemon".
"""

from __future__ import annotations

from typing import Final

# Their home is the ledger's canonical JSON; named here for the engine's steps.
from daemon.ledger.canonical import safe as safe
from daemon.ledger.canonical import unsafe as unsafe

ACTOR: Final = "engine"
REQUEST: Final = "run.request"
ROUTE: Final = "run.route"
EMBEDDING: Final = "run.embedding"
CLASSIFY: Final = "run.classify"
PLAN: Final = "run.plan"
GUARD: Final = "output.guard"
TASK_START: Final = "task.start"
MODEL_CALL: Final = "model.call"
MODEL_REPLY: Final = "model.reply"
COMMAND_RUN: Final = "command.run"
MODEL_RETRY: Final = "model.retry"
TASK_REUSE: Final = "task.reuse"
TASK_RESULT: Final = "task.result"
TASK_VERDICT: Final = "task.verdict"
TASK_ESCALATE: Final = "task.escalate"
TASK_SKIP: Final = "task.skip"
BUDGET: Final = "run.budget"
CANCEL: Final = "run.cancel"
ANSWER: Final = "run.answer"
INTENT: Final = "run.intent"
STATE: Final = "run.state"
INTERRUPTED: Final = "run.interrupted"
RESUME: Final = "run.resume"
AGENT_STEP: Final = "agent.step"
KINDS: Final = (
    REQUEST,
    ROUTE,
    EMBEDDING,
    CLASSIFY,
    PLAN,
    GUARD,
    TASK_START,
    MODEL_CALL,
    MODEL_REPLY,
    MODEL_RETRY,
    COMMAND_RUN,
    TASK_RESULT,
    TASK_VERDICT,
    TASK_ESCALATE,
    TASK_SKIP,
    TASK_REUSE,
    BUDGET,
    CANCEL,
    ANSWER,
    INTENT,
    STATE,
    INTERRUPTED,
    RESUME,
    AGENT_STEP,
)
