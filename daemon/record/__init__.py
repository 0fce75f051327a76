"""The record's vocabulary: every kind of ledger entry tally writes, one pydantic model each.

A kind's model states its kind, who writes it and the kinds its parent may be (`Body`), and
`KINDS` below is the one list of them: what `GET /v1/record/schema`, `tally ledger schema`,
`tally ledger verify --deep`, the console's verifier and the README's table read. A writer
builds its kind's model and witnesses `body.written()`; a reader turns a body back into its
model with `read(kind, body)`, tolerant of fields a later tally added.

To add a kind: declare its model (a `Body` subclass with KIND, ACTORS, PARENTS) in the module
of its area here and add it to `KINDS`; `tests/record` fails until it is.
"""

from __future__ import annotations

from typing import Any

from daemon.record.agent import AgentCli, AgentStep
from daemon.record.body import CLIENT, Body, Part
from daemon.record.gateway import (
    ClientLimited,
    GatewayCall,
    GatewayFallback,
    GatewayReply,
    GatewayUsage,
)
from daemon.record.ledger import CheckpointCosign, CheckpointInconsistent, LedgerJoin
from daemon.record.operations import (
    ClientAdd,
    ClientRevoke,
    Decision,
    PolicyUnsandboxed,
    Redaction,
    RosterReload,
    RoutePreview,
    RouteTeach,
    ServeInsecureHttp,
)
from daemon.record.runs import (
    Budget,
    CommandRun,
    Judge,
    ModelCall,
    ModelReply,
    ModelRetry,
    OutputGuard,
    Remote,
    RetryOf,
    RouterChoice,
    RunAnswer,
    RunBudget,
    RunCancel,
    RunClassify,
    RunEmbedding,
    RunIntent,
    RunInterrupted,
    RunPlan,
    RunRequest,
    RunResume,
    RunRoute,
    RunState,
    TaskEscalate,
    TaskResult,
    TaskReuse,
    TaskSkip,
    TaskStart,
    TaskVerdict,
    Usage,
)
from daemon.record.slots import SLOT_KINDS, SlotBody, slot_body
from daemon.record.workspace import (
    CheckRun,
    RunPatch,
    TaskDiff,
    WorkspaceApply,
    WorkspaceCarry,
    WorkspaceSnapshot,
)

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

KINDS: tuple[type[Body], ...] = (
    # runs
    RunRequest,
    RunEmbedding,
    RunRoute,
    RunClassify,
    RunPlan,
    OutputGuard,
    RunBudget,
    RunCancel,
    RunAnswer,
    RunIntent,
    RunState,
    RunInterrupted,
    RunResume,
    # tasks and attempts
    TaskStart,
    TaskResult,
    TaskVerdict,
    TaskEscalate,
    TaskSkip,
    TaskReuse,
    # model calls and commands
    ModelCall,
    ModelReply,
    ModelRetry,
    CommandRun,
    AgentStep,
    AgentCli,
    # workspaces
    WorkspaceSnapshot,
    TaskDiff,
    CheckRun,
    RunPatch,
    WorkspaceApply,
    WorkspaceCarry,
    # the gateway
    GatewayCall,
    GatewayReply,
    GatewayFallback,
    # clients, roster, routing, policy, redaction
    ClientAdd,
    ClientRevoke,
    ClientLimited,
    RosterReload,
    RoutePreview,
    RouteTeach,
    PolicyUnsandboxed,
    ServeInsecureHttp,
    Redaction,
    # the record itself: shared records, cosigning
    LedgerJoin,
    CheckpointCosign,
    CheckpointInconsistent,
    # slots
    *SLOT_KINDS,
)

BY_KIND: dict[str, type[Body]] = {model.KIND: model for model in KINDS}
assert len(BY_KIND) == len(KINDS), "two models claim one kind"


def model_for(kind: str) -> type[Body] | None:
    """The model of `kind`, or None for a kind tally does not write."""
    return BY_KIND.get(kind)


def read(kind: str, body: object) -> Body | None:
    """`body` as its kind's model; None for an unknown kind. Raises pydantic's
    ValidationError when the body does not fit its kind."""
    model = BY_KIND.get(kind)
    return None if model is None else model.read(body)


def schema(model: type[Body]) -> dict[str, Any]:
    """The JSON Schema (2020-12) of one kind's body, as it is read (later fields allowed)."""
    return {"$schema": SCHEMA_DIALECT, **model.model_json_schema(mode="validation")}


def schemas() -> dict[str, dict[str, Any]]:
    """Every kind's JSON Schema, keyed by kind."""
    return {model.KIND: schema(model) for model in KINDS}


def document() -> dict[str, Any]:
    """What `GET /v1/record/schema` and `tally ledger schema` publish: every kind's JSON
    Schema (`schemas`, keyed by kind) and who writes it, its parents' kinds and the fields it
    writes only when they hold something (`kinds`)."""
    return {
        "dialect": SCHEMA_DIALECT,
        "schemas": schemas(),
        "kinds": {
            model.KIND: {
                "actors": list(model.ACTORS),
                "parents": list(model.PARENTS),
                "optional": sorted(model.OPTIONAL),
                "summary": _summary(model),
            }
            for model in KINDS
        },
    }


def _summary(model: type[Body]) -> str:
    """The first sentence of the kind's doc (its model's docstring)."""
    doc = " ".join((model.__doc__ or "").split())
    head, _, _ = doc.partition(". ")
    return head.rstrip(".") + "." if head else ""


__all__ = [
    "BY_KIND",
    "CLIENT",
    "KINDS",
    "SCHEMA_DIALECT",
    "AgentCli",
    "AgentStep",
    "Body",
    "Budget",
    "CheckRun",
    "CheckpointCosign",
    "CheckpointInconsistent",
    "ClientAdd",
    "ClientLimited",
    "ClientRevoke",
    "CommandRun",
    "Decision",
    "GatewayCall",
    "GatewayFallback",
    "GatewayReply",
    "GatewayUsage",
    "Judge",
    "LedgerJoin",
    "ModelCall",
    "ModelReply",
    "ModelRetry",
    "OutputGuard",
    "Part",
    "PolicyUnsandboxed",
    "Redaction",
    "Remote",
    "RetryOf",
    "RosterReload",
    "RoutePreview",
    "RouteTeach",
    "RouterChoice",
    "RunAnswer",
    "RunBudget",
    "RunCancel",
    "RunClassify",
    "RunEmbedding",
    "RunIntent",
    "RunInterrupted",
    "RunPatch",
    "RunPlan",
    "RunRequest",
    "RunResume",
    "RunRoute",
    "RunState",
    "ServeInsecureHttp",
    "SlotBody",
    "TaskDiff",
    "TaskEscalate",
    "TaskResult",
    "TaskReuse",
    "TaskSkip",
    "TaskStart",
    "TaskVerdict",
    "Usage",
    "WorkspaceApply",
    "WorkspaceCarry",
    "WorkspaceSnapshot",
    "document",
    "model_for",
    "read",
    "schema",
    "schemas",
    "slot_body",
]
