"""What a tool is, and the models several areas' tools share.

A tool is a name, a description written for a model choosing a tool inside an IDE, a pydantic
input model, a pydantic output model, an async handler on the Daemon, the least scope that may
call it and the errors it can answer with. Each is declared once, beside its handler, in the
module of its area (`runs`, `ledger`, `checkpoints`, `roster`, `pool`, `clients`, `console`);
`daemon.tools` lists them: HTTP, OpenAPI and MCP are generated from that list. The CLI calls
these tools over the daemon's socket; most of its commands are written by hand for a terminal.

Output models are defined in this package (not borrowed from the engine or the ledger) so that
the published schemas stay stable while the internals move; handlers convert the internal
pydantic models with `model_dump(mode="json")` and validate that into the published one.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from daemon.clients import OWNER, Client, Scope
from daemon.errors import Forbidden, TallyError
from daemon.ledger.canonical import MAX_SAFE_INT
from daemon.ledger.entry import Body, BodyState
from daemon.runs.state import STOPPED as TERMINAL
from daemon.runs.state import RunState, TaskState
from roster.models import Whole

if TYPE_CHECKING:
    from daemon.ledger import Entry
    from daemon.runs.state import RunView
    from daemon.service import Daemon

In = TypeVar("In", bound=BaseModel)
Out = TypeVar("Out", bound=BaseModel)

HEX64 = r"^[0-9a-f]{64}$"
# A request must hold something besides spaces, tabs and line breaks. Spelled out (not `\S`)
# because JSON Schema's regex dialect, Python's and pydantic's disagree on what `\s` covers.
NOT_BLANK = r"[^ \t\n\r\f\v]"
STARTED = time.monotonic()


@dataclass(frozen=True)
class ToolContext:
    """What a surface lends a handler: who is calling (resolved from the transport)."""

    client: Client = OWNER


@dataclass(frozen=True)
class Tool(Generic[In, Out]):
    name: str
    description: str
    input: type[In]
    output: type[Out]
    handler: Callable[[Daemon, In, ToolContext], Awaitable[Out]]
    scope: Scope = "read"
    """The least scope a client needs to call it (see daemon.clients); surfaces enforce it
    before validating the arguments, so a refused client learns nothing from validation."""
    errors: tuple[type[TallyError], ...] = field(kw_only=True)
    """The errors its handler can answer with, beyond those of any call (bad JSON, auth, body
    size, arguments that do not match the input schema, an internal error; 403 Forbidden is
    documented on every operation). Required, `()` for none: the OpenAPI document lists each
    operation's statuses from it, and the schemathesis test checks no other status comes back."""


# Tool models are built (validator, serializer) at their first use, not at import: building all
# ~50 took ~13 ms, and the first call of a tool builds its two in about a millisecond. That use
# is on the event loop's thread (HTTP, MCP), so no two threads race to build one.
class _In(BaseModel):
    # The published schema is the contract: no coercion (`"1"` is not 1, `0` is not false),
    # no unknown fields, every number finite and bounded (NaN, Infinity, 1e308 are a 422).
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, defer_build=True)


Seq = Annotated[int, Field(ge=0, le=MAX_SAFE_INT), Whole]
Size = Annotated[int, Field(ge=1, le=MAX_SAFE_INT), Whole]


class _Out(BaseModel):
    model_config = ConfigDict(extra="ignore", defer_build=True)


# ---------------------------------------------------------------- shared output models


class Empty(_In):
    """No arguments."""


class RunIdIn(_In):
    run_id: str = Field(min_length=1, max_length=128, description="The run's id (from submit).")


class SpentOut(_Out):
    model_calls: int = 0
    tokens: int = 0
    wall_ms: int = 0


class TaskOut(_Out):
    """A task of a run as it stands. Every field is published: a field the run state gains
    is added here too (tests/surfaces/test_task_out.py holds them equal), never passed
    through undescribed."""

    id: str
    lane: str | None = None
    executor: str = "chat"
    needs: list[str] = []
    state: TaskState
    attempts: int = 0
    tier: str | None = None
    member: str | None = None
    result: str | None = Field(default=None, description="Its output, once done.")
    error: str | None = None
    failures: list[str] = Field(default=[], description="Why its attempts failed.")
    verdict_seq: int | None = Field(default=None, description="Its latest task.verdict entry.")
    steps: int = Field(default=0, description="An agent task's tool-loop steps witnessed.")
    last_tool: str | None = Field(default=None, description="The tool of its latest step.")
    started_at_us: int | None = None
    ended_at_us: int | None = None
    reused_from: str | None = Field(
        default=None, description="The run whose done task this one took (a retried run)."
    )
    held: str | None = Field(
        default=None,
        description="Live only: why a pending task whose needs are done has not started "
        "(it waits for capacity: the daemon's, its lane's or the run's cap on tasks at once).",
    )


class RunOut(_Out):
    """A run as it stands: its state, tasks, spending and (once done) the witnessed answer."""

    id: str
    state: RunState
    request: str
    lane: str | None = None
    client: str | None = Field(default=None, description="The named client that submitted it.")
    tasks: list[TaskOut] = []
    answer: str | None = None
    spent: SpentOut = SpentOut()
    budget: dict[str, Any] | None = None
    error: str | dict[str, Any] | None = None
    request_seq: int | None = None
    answer_seq: int | None = None
    created_at_us: int | None = None
    updated_at_us: int | None = None
    tier: str | None = Field(default=None, description="The tier the client chose to start on.")
    member: str | None = Field(default=None, description="The member the client chose.")
    retry_of: str | None = Field(default=None, description="The run this one retries.")
    workspace: str | None = Field(default=None, description="The project the run works on.")
    patch_seq: int | None = Field(
        default=None, description="The run.patch entry: its tasks' changes (run_patch)."
    )
    patch_files: list[str] = Field(default=[], description="The files the patch changes.")

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


def run_out(view: RunView) -> RunOut:
    return RunOut.model_validate(view.model_dump(mode="json"))


JsonValue = Annotated[
    Any,
    WithJsonSchema(
        {
            "anyOf": [
                {"type": name}
                for name in ("object", "array", "string", "integer", "number", "boolean", "null")
            ]
        }
    ),
]
"""Any JSON value, stated as such so strict schema checkers (MCP clients) see a type."""


class EntryOut(_Out):
    """One ledger entry; `body` is the hash of its content, `content` the content if asked for."""

    v: int = 1
    seq: int
    ts: int
    actor: str
    kind: str
    run: str | None = None
    parent: int | None = None
    body: str | None = None
    prev: str
    hash: str | None = None
    content: JsonValue = Field(
        default=None, description="The body's JSON when requested and present."
    )
    redacted: bool = Field(default=False, description="True if the body was redacted.")
    body_state: BodyState | None = Field(
        default=None,
        description="When content was requested: present (content holds it, a JSON null "
        "included), redacted, missing (no stored body) or tampered (the stored bytes do not "
        "hash to `body`); none when the entry has no body.",
    )
    line: str | None = Field(
        default=None,
        description="The entry's line as stored (its RFC 9162 leaf is SHA-256(0x00 || line)), "
        "when requested.",
    )


def entry_out(entry: Entry, body: Body | None = None) -> EntryOut:
    """`body`: the entry's body as read, when the client asked for content."""
    # `hash` is derived, so Entry leaves it out of its dump; the published entry carries it.
    data = entry.model_dump(mode="json")
    if body is None:
        return EntryOut.model_validate({**data, "hash": entry.hash})
    return EntryOut.model_validate(
        {
            **data,
            "hash": entry.hash,
            "content": body.value,
            "redacted": body.state == "redacted",
            "body_state": body.state,
        }
    )


async def _with_bodies(daemon: Daemon, entries: list[Entry], bodies: bool) -> list[EntryOut]:
    if not bodies:
        return [entry_out(e) for e in entries]
    read = await daemon.ledger.read_bodies([e.body for e in entries])
    return [entry_out(e, body) for e, body in zip(entries, read, strict=True)]


class EntriesOut(_Out):
    entries: list[EntryOut]
    size: int = Field(description="Entries in the ledger when read.")


def require(ctx: ToolContext, scope: Scope, why: str) -> None:
    if not ctx.client.allows(scope):
        raise Forbidden(
            f"client {ctx.client.name!r} has scope {ctx.client.scope!r}; {why} needs {scope!r}",
            details={"needed": scope, "client": ctx.client.name},
        )
