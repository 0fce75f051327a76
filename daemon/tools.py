"""THE tool set: one registry that HTTP, OpenAPI and MCP are generated from.

The CLI calls these tools over the daemon's socket; most of its commands are written by hand
for a terminal (`submit`, `run`, `route`, `plan`, `slots`, `ledger`...), not generated.

Each tool is a name, a description written for a model choosing a tool inside an IDE, a
pydantic input model, a pydantic output model and an async handler on the Daemon. Output
models are defined here (not borrowed from the engine or the ledger) so that the published
schemas stay stable while the internals move; handlers convert the internal pydantic models
with `model_dump(mode="json")` and validate that into the published one.

One file (past 500 lines) because it is the published contract: every tool's input and output
schema and its handler side by side, read as one list by HTTP, OpenAPI, MCP and the parity
tests; the aggregation, the engine and the pool it calls live elsewhere.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.config import JsonDict

from daemon import record as rec
from daemon.clients import CLIENT_NAME, OWNER, Client, Limits, Scope
from daemon.cosigning import CosignHealth
from daemon.errors import (
    Busy,
    Conflict,
    DeadlineExceeded,
    Forbidden,
    InvalidInput,
    NotFound,
    TallyError,
    Unavailable,
)
from daemon.gateway import REPLY as GATEWAY_REPLY
from daemon.ledger.canonical import MAX_SAFE_INT
from daemon.ledger.entry import Body, BodyState
from daemon.ledger.summary import Vocabulary, summarize
from daemon.plans import Plan, PlanInvalid, Task, problems, report, waves
from daemon.quotas import RateLimited
from daemon.runs import entries as k
from daemon.runs.replay import replay
from daemon.runs.state import STOPPED as TERMINAL
from daemon.runs.state import TASK_ENDED, RunState, TaskState
from daemon.tls import Listener
from daemon.version import package_version
from roster.models import NAME, Budget, Whole

if TYPE_CHECKING:
    from daemon.ledger import ConsistencyProof, Entry, InclusionProof
    from daemon.router import Decision, Route
    from daemon.runs.state import RunView
    from daemon.service import Daemon
    from daemon.slots import PoolStatus

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


class VerifyOut(_Out):
    ok: bool
    size: int
    root: str | None = None
    first_bad_seq: int | None = None
    reason: str | None = None
    redacted: list[str] | None = Field(
        default=None, description="Hashes of bodies removed by a witnessed redaction (deep)."
    )
    tampered: list[str] | None = Field(
        default=None, description="Hashes of bodies missing or changed without a witness (deep)."
    )
    tampered_why: dict[str, str] | None = Field(
        default=None,
        description='Per tampered body: "changed" or "missing (no redaction witnessed)".',
    )
    derived: list[str] | None = Field(
        default=None,
        description="Derived files (index, tree levels, body table) that do not match the "
        "entries: caches, the entries are intact.",
    )
    rebuilt: list[str] | None = Field(
        default=None, description="The derived files the daemon rebuilt after finding them wrong."
    )


# ---------------------------------------------------------------- health


CommandSandbox = Annotated[
    Literal["bwrap", "none", "off"],
    Field(
        description="How command tasks run: in bubblewrap, unsandboxed (an explicit roster "
        "opt-in), or not at all."
    ),
]


class HealthOut(_Out):
    status: Literal["ok", "degraded"] = "ok"
    reason: str | None = Field(
        default=None, description="Why `degraded`, e.g. the ledger cannot write (disk full)."
    )
    ledger_writable: bool = Field(
        default=True, description="False while writes fail; appends get 503 until it recovers."
    )
    version: str
    uptime_s: float
    ledger_size: int
    runs_active: int
    runs_queued: int = Field(description="Runs waiting for a run slot (bounded by policy).")
    lanes: int
    members: int
    command_sandbox: CommandSandbox
    loop_lag_worst_s: float = Field(
        default=0.0,
        description="The longest the event loop was late in the last minute (all requests "
        "wait that long).",
    )
    listener: Listener | None = Field(
        default=None,
        description="The TCP listener: its URL, whether it is TLS (and the certificate's "
        "fingerprint clients pin), and whether plain HTTP beyond loopback was asked for "
        "(`--insecure-http`). Null: unix socket only.",
    )
    cosigning: CosignHealth | None = Field(
        default=None,
        description="Cosigned checkpoints: per cosigner (a `cosign` member, or a daemon "
        "sharing the record) the last checkpoint of ours it cosigned, how long ago, the failed "
        "asks since; whether the latest checkpoint has them all. Null: no cosigners.",
    )


def command_sandbox(daemon: Daemon) -> Literal["bwrap", "none", "off"]:
    policy = daemon.roster.policy.command
    return policy.sandbox if policy.enabled else "off"


async def health(daemon: Daemon, _: Empty, ctx: ToolContext) -> HealthOut:
    ledger = daemon.ledger.health
    return HealthOut(
        status="ok" if ledger.writable else "degraded",
        reason=None if ledger.writable else f"the ledger cannot write: {ledger.detail}",
        ledger_writable=ledger.writable,
        version=package_version(),
        uptime_s=round(time.monotonic() - STARTED, 3),
        ledger_size=daemon.ledger.size,
        runs_active=daemon.engine.census.active(),
        runs_queued=daemon.engine.queued(),
        lanes=len(daemon.roster.lanes),
        members=len(daemon.roster.models),
        command_sandbox=command_sandbox(daemon),
        loop_lag_worst_s=round(daemon.lag.worst(), 6),
        listener=_listener_for(daemon, ctx),
        cosigning=await daemon.collector.health(daemon.ledger, daemon.roster),
    )


def _listener_for(daemon: Daemon, ctx: ToolContext) -> Listener | None:
    """The listener as the caller may see it: where the state dir is is the admin's business."""
    listener = daemon.listener
    if listener is None or ctx.client.allows("admin"):
        return listener
    return listener.model_copy(update={"cert_path": None})


# ---------------------------------------------------------------- route and plan


class RouteIn(_In):
    text: str = Field(min_length=1, max_length=100_000, description="The request to route.")


class LaneScore(_Out):
    lane: str
    score: float


class DecisionOut(_Out):
    lane: str | None = Field(
        description="The lane submit will take; null when the classifier picks (one model call)."
    )
    source: Literal["router", "scores", "general", "classifier"] = Field(
        description="router: the route decided; scores: it escalated and no classifier is "
        "set, the best-scoring lane (no model call); general: no lane's evidence reached the "
        "floor (no model call); classifier: the named tier or member picks among candidates."
    )
    model_call: bool
    classifier: str | None = None
    candidates: list[str] = []
    summary: str = Field(description="The decision in words, as `tally route` prints it.")


class EmbeddingNearest(_Out):
    lane: str
    cosine: float = Field(description="Centred cosine of the lane's nearest example.")
    example: str


class EmbeddingOut(_Out):
    member: str
    used: bool = Field(description="False: the route took the keyword scores alone (`why`).")
    why: str | None = None
    digest: str | None = Field(default=None, description="The model digest of the vectors.")
    examples: int = Field(description="Example vectors compared.")
    ms: int = Field(description="The request's embedding call (0: its vector was known).")
    nearest: list[EmbeddingNearest] = Field(description="The best lanes by nearest example.")


class RouteOut(_Out):
    lane: str | None = Field(description="The lane the route decided, or null (escalated).")
    confidence: float
    escalate: bool = Field(description="True if confidence is below the roster's threshold.")
    scores: list[LaneScore]
    matched: dict[str, list[str]] = Field(description="Per lane, the words that scored.")
    similar: dict[str, list[str]] = Field(
        default={}, description="Per lane, the request's words that read like its examples."
    )
    examples: dict[str, str] = Field(
        default={}, description="Per lane, its example nearest the request (when close)."
    )
    decision: DecisionOut = Field(description="What submit will do with this request.")
    embedding: EmbeddingOut | None = Field(
        default=None,
        description="The embedding member's part (`[policy] embeddings`); null: none is set.",
    )


def embedding_out(r: Route) -> EmbeddingOut | None:
    e = r.embedding
    if e is None:
        return None
    return EmbeddingOut.model_validate(e.shown())


def route_out(r: Route) -> RouteOut:
    """A route as the tool (and `tally route --json`) shows it."""
    decision = r.decision
    return RouteOut(
        lane=r.lane,
        confidence=r.confidence,
        escalate=r.escalate,
        scores=[LaneScore(lane=lane, score=score) for lane, score in r.scores],
        matched={k: list(v) for k, v in r.matched.items()},
        similar={k: list(v) for k, v in r.similar.items()},
        examples=dict(r.examples),
        decision=decision_out(decision),
        embedding=embedding_out(r),
    )


def _ppm(x: float) -> int:
    return round(x * 1_000_000)  # the ledger holds no floats


async def route(daemon: Daemon, data: RouteIn, ctx: ToolContext) -> RouteOut:
    r = await daemon.router.aroute(data.text)
    preview = rec.RoutePreview(
        text=data.text,
        lane=r.lane,
        confidence_ppm=_ppm(r.confidence),
        escalate=r.escalate,
        scores_ppm={lane: _ppm(score) for lane, score in r.scores[:5]},
        decision=rec.Decision(lane=r.decision.lane, source=r.decision.source),
    )
    if r.embedding is not None:  # only with an embedding member: older previews unchanged
        from daemon.runs.routing import embedding_body

        preview.embedding = embedding_body(r.embedding)
    await daemon.ledger.append(
        actor="tool",
        kind=preview.KIND,
        body=preview.written(),
    )
    return route_out(r)


class TeachIn(_In):
    lane: str = Field(pattern=NAME, max_length=128, description="The lane that should get it.")
    text: str = Field(
        min_length=1,
        max_length=500,
        pattern=NOT_BLANK,
        description="A request, in the user's words, that belongs in the lane.",
    )


class TeachOut(_Out):
    lane: str
    roster: str = Field(description="The roster file that gained the example.")
    kept_comments: bool = Field(description="False: the file had to be regenerated.")
    examples: int = Field(description="The lane's examples now.")
    before: DecisionOut = Field(description="What submit did with the request before.")
    after: DecisionOut = Field(description="What submit does with it now.")
    seq: int = Field(description="The `route.teach` entry witnessing the edit.")


def decision_out(decision: Decision) -> DecisionOut:
    return DecisionOut(**decision.model_dump(), summary=str(decision))


async def route_teach(daemon: Daemon, data: TeachIn, ctx: ToolContext) -> TeachOut:
    from daemon.teaching import teach

    taught = await teach(daemon, data.lane, data.text, ctx.client.name)
    return TeachOut(
        lane=taught.lane,
        roster=taught.roster,
        kept_comments=taught.kept_comments,
        examples=taught.examples,
        before=decision_out(taught.before),
        after=decision_out(taught.after),
        seq=taught.seq,
    )


class SuggestIn(_In):
    last: Annotated[int, Field(ge=1, le=10_000_000), Whole] = Field(
        default=200_000, description="How many of the latest ledger entries to read."
    )
    limit: Annotated[int, Field(ge=1, le=1000), Whole] = 50


class SuggestionOut(_Out):
    lane: str = Field(description="The lane the user chose (submit's `lane`).")
    text: str = Field(description="The request.")
    router: str | None = Field(description="The router's choice then (null: a classifier's).")
    now: str | None = Field(description="The lane the router gives it today.")
    runs: list[str]
    teach: str = Field(description="The command that teaches it.")


class SuggestOut(_Out):
    overrides: int = Field(description="Runs read whose client overrode the router.")
    suggestions: list[SuggestionOut]


async def route_suggest(daemon: Daemon, data: SuggestIn, ctx: ToolContext) -> SuggestOut:
    import shlex

    from daemon.teaching import suggest

    found, overrides = await suggest(daemon, data.last, data.limit)
    return SuggestOut(
        overrides=overrides,
        suggestions=[
            SuggestionOut(**vars(s), teach=f"tally route --teach {s.lane} {shlex.quote(s.text)}")
            for s in found
        ],
    )


_SOUND_PLAN = {"tasks": [{"id": "-", "lane": "-", "instruction": ""}]}


def _keep_a_bad_plan(data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
    """Validate a tool's input; a `plan` that fails its schema (and nothing else failing) is
    kept as sent, for the handler to report every problem of it in one pass, lanes, needs and
    cycles with the schema's (a 422 all the same), not the schema's alone."""
    try:
        return handler(data)
    except ValidationError as exc:
        bad = data.get("plan") if isinstance(data, dict) else None
        if bad is None or any(tuple(e["loc"][:1]) != ("plan",) for e in exc.errors()):
            raise
        kept = handler({**data, "plan": _SOUND_PLAN})
        kept._unchecked = bad
        return kept


def _refuse_a_bad_plan(daemon: Daemon, unchecked: Any) -> None:
    if unchecked is not None:
        _, found = report(unchecked, [lane.name for lane in daemon.roster.lanes])
        raise PlanInvalid(found)


class PlanIn(_In):
    _unchecked: Any = PrivateAttr(default=None)
    """The plan as sent, when it failed its schema (see `_keep_a_bad_plan`)."""

    @model_validator(mode="wrap")
    @classmethod
    def _one_pass(cls, data: Any, handler: ModelWrapValidatorHandler[PlanIn]) -> PlanIn:
        kept: PlanIn = _keep_a_bad_plan(data, handler)
        return kept

    plan: Plan = Field(
        description=(
            'A plan: {"tasks": [{"id": "T1", "lane": "backend", "instruction": "...", '
            '"needs": [], "assertions": [{"type": "contains", "text": "..."}]}]}'
        )
    )
    max_parallel: Annotated[int, Field(ge=1, le=1024), Whole] | None = None


class PlanProblemOut(_Out):
    code: str
    tasks: list[str] = []
    message: str


class PlanOut(_Out):
    ok: bool
    problems: list[PlanProblemOut] = Field(description="Every problem found, e.g. a named cycle.")
    waves: list[list[str]] = Field(description="Task ids by level, split by max_parallel.")
    critical_path: int = 0
    total_tasks: int = 0


async def plan(daemon: Daemon, data: PlanIn, ctx: ToolContext) -> PlanOut:
    _refuse_a_bad_plan(daemon, data._unchecked)
    parsed = data.plan
    lanes = [lane.name for lane in daemon.roster.lanes]
    found = [
        PlanProblemOut.model_validate(p.model_dump(mode="json")) for p in problems(parsed, lanes)
    ]
    if found:
        return PlanOut(ok=False, problems=found, waves=[])
    limit = data.max_parallel or daemon.roster.policy.max_parallel
    w = waves(parsed, limit)
    return PlanOut(
        ok=True,
        problems=[],
        waves=[list(level) for level in w.waves],
        critical_path=w.critical_path,
        total_tasks=w.total_tasks,
    )


# ---------------------------------------------------------------- runs


class SubmitIn(_In):
    _unchecked: Any = PrivateAttr(default=None)
    """The plan as sent, when it failed its schema (see `_keep_a_bad_plan`)."""

    @model_validator(mode="wrap")
    @classmethod
    def _one_pass(cls, data: Any, handler: ModelWrapValidatorHandler[SubmitIn]) -> SubmitIn:
        kept: SubmitIn = _keep_a_bad_plan(data, handler)
        return kept

    request: str = Field(
        min_length=1,
        max_length=100_000,
        pattern=NOT_BLANK,
        description="What you want done (not only spaces, tabs and line breaks).",
    )
    plan: Plan | None = Field(
        default=None,
        description=(
            "An explicit task DAG (check it first with the plan tool). Without one, the "
            "roster's coordinator model plans it if one is configured, else the request "
            "runs as one task in its routed lane."
        ),
    )
    lane: str | None = Field(
        default=None, pattern=NAME, description="Force a lane (by name) instead of routing."
    )
    budget: Budget | None = Field(default=None, description="Per-run limits (default: roster).")
    idempotency_key: str | None = Field(
        default=None, max_length=200, description="Same key again returns the existing run."
    )
    max_parallel: Annotated[int, Field(ge=1, le=1024), Whole] | None = None
    barrier: bool = Field(
        default=False,
        description="Run the plan strictly wave by wave instead of as soon as needs are done.",
    )
    wait: bool = Field(default=False, description="Wait for the answer (up to timeout_s).")
    timeout_s: float = Field(default=120.0, gt=0, le=3600, description="How long to wait.")
    tier: str | None = Field(
        default=None,
        pattern=NAME,
        description="Start every task on this tier (it still climbs the ladder from there) "
        "instead of each lane's own tier. One of the roster's tiers.",
    )
    member: str | None = Field(
        default=None,
        pattern=NAME,
        description="Send every task's model call to this roster member (no climbing).",
    )
    workspace: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description=(
            "A project directory on the daemon's machine, inside a root the operator allowed. "
            "Tasks work on copies of it; its files change only through run_apply. Needs the "
            "command scope."
        ),
    )


def require(ctx: ToolContext, scope: Scope, why: str) -> None:
    if not ctx.client.allows(scope):
        raise Forbidden(
            f"client {ctx.client.name!r} has scope {ctx.client.scope!r}; {why} needs {scope!r}",
            details={"needed": scope, "client": ctx.client.name},
        )


def _commands(plan: Plan | dict[str, Any] | None) -> bool:
    """Whether a plan (a model, or the dict a run view keeps) has a command or agent task."""
    if plan is None:
        return False
    tasks = plan.tasks if isinstance(plan, Plan) else plan.get("tasks") or []
    return any(  # an agent task runs commands too (its `run` tool)
        (t.executor if isinstance(t, Task) else t.get("executor")) in ("command", "agent")
        for t in tasks
    ) or any(_checks_run(t) for t in tasks)


def _checks_run(task: Task | dict[str, Any]) -> bool:
    """Whether a task has a `run` check (it executes a command in the sandbox)."""
    found = task.assertions if isinstance(task, Task) else task.get("assertions") or []
    return any((a.type if not isinstance(a, dict) else a.get("type")) == "run" for a in found)


async def submit(daemon: Daemon, data: SubmitIn, ctx: ToolContext) -> RunOut:
    _refuse_a_bad_plan(daemon, data._unchecked)
    if _commands(data.plan):
        require(ctx, "command", "a plan with command tasks or run checks")
    if data.workspace is not None:
        require(ctx, "command", "a run on a workspace")
    await daemon.gateway.admit(ctx.client, "submit")  # the client's rpm and token budgets
    view = await daemon.engine.submit(
        data.request,
        plan=data.plan,
        lane=data.lane,
        budget=data.budget,
        idempotency_key=data.idempotency_key,
        max_parallel=data.max_parallel,
        barrier=data.barrier,
        client=ctx.client.name,
        tier=data.tier,
        member=data.member,
        workspace=data.workspace,
    )
    if not data.wait:
        return run_out(daemon.engine.shown(view))
    run_id = view.id
    try:
        async with asyncio.timeout(data.timeout_s):
            return run_out(await daemon.engine.wait(run_id))
    except (TimeoutError, DeadlineExceeded):
        return run_out(daemon.engine.shown(daemon.engine.get(run_id)))


class ProgressSteps:
    """Progress notifications for a run: one per visible change, numbered 1, 2, 3, ...

    MCP requires every notification's progress to be greater than the last, and a run's
    state can move (queued -> planning -> running) while no task finishes; so the value is a
    step count, no total, and the message says where the run is.
    """

    def __init__(self) -> None:
        self.step = 0
        self.last: str | None = None

    def next(self, run: RunOut) -> tuple[float, float | None, str] | None:
        done = sum(1 for t in run.tasks if t.state in TASK_ENDED)
        message = f"{run.state}: {done}/{len(run.tasks)} tasks done"
        if message == self.last:
            return None
        self.step += 1
        self.last = message
        return float(self.step), None, message

    def agent_step(self, data: dict[str, Any]) -> tuple[float, float | None, str]:
        """A progress message for one step of an agent task (an `agent.step` event's data):
        its task, step, tool, arguments and outcome, in at most 240 characters."""
        self.step += 1
        got = data.get("arguments")
        arguments: dict[str, Any] = got if isinstance(got, dict) else {}
        args = ", ".join(
            f"{k}={' '.join(str(v).split())[:60]}" for k, v in arguments.items() if v is not None
        )
        tool = data.get("tool") or "(no call)"
        said = f"{data.get('task') or 'agent'} step {data.get('step')}: {tool}({args[:120]})"
        said += f" → {data.get('outcome')}"
        # the model wrote most of it: no control character reaches the client's display
        said = "".join(c if c.isprintable() else "?" for c in said)
        return float(self.step), None, said[:240]

    def tokens(self, task: str | None, text: str) -> tuple[float, float | None, str]:
        """A progress message carrying what a task (None: the synthesis) is writing."""
        self.step += 1
        tail = " ".join(text.split())[-160:]
        return float(self.step), None, f"{task or 'answer'} writing: …{tail}"


async def run_get(daemon: Daemon, data: RunIdIn, ctx: ToolContext) -> RunOut:
    # An old finished run keeps a summary in memory, or nothing; its record has the rest.
    return run_out(daemon.engine.shown(await daemon.engine.find(data.run_id)))


class RunsIn(_In):
    state: RunState | None = Field(default=None, description="Only runs in this state.")
    limit: Annotated[int, Field(ge=1, le=1000), Whole] = 50
    all: bool = Field(
        default=False,
        description="Also the runs of the other daemons sharing this daemon's record (a record "
        "on PostgreSQL), read from the record; `daemons` names who owns each.",
    )


class RunsOut(_Out):
    runs: list[RunOut]
    daemons: dict[str, str] = Field(
        default_factory=dict,
        description="With `all`: each run's daemon (its checkpoint key's name in the record).",
    )


async def runs_list(daemon: Daemon, data: RunsIn, ctx: ToolContext) -> RunsOut:
    ours = daemon.engine.shown_list(state=data.state, limit=data.limit)
    foreign = getattr(daemon.ledger, "foreign_runs", None)
    if not data.all or foreign is None:
        return RunsOut(runs=[run_out(v) for v in ours])
    # Runs stay per daemon: the others' are read from the shared record as it stands.
    name = getattr(daemon.ledger, "name", "")
    views = [(v, name) for v in ours]
    for run_id, owner in await foreign(data.limit):
        view = (await replay(daemon.ledger, run=run_id)).get(run_id)
        if view is not None and (data.state is None or view.state == data.state):
            views.append((view, owner))
    views.sort(key=lambda p: (p[0].created_at_us, p[0].id), reverse=True)
    views = views[: data.limit]
    return RunsOut(runs=[run_out(v) for v, _ in views], daemons={v.id: o for v, o in views})


async def run_cancel(daemon: Daemon, data: RunIdIn, ctx: ToolContext) -> RunOut:
    return run_out(await daemon.engine.cancel(data.run_id))


async def run_resume(daemon: Daemon, data: RunIdIn, ctx: ToolContext) -> RunOut:
    if _commands(daemon.engine.get(data.run_id).plan):
        require(ctx, "command", "resuming a run with command tasks")
    if daemon.engine.get(data.run_id).workspace is not None:
        require(ctx, "command", "resuming a run on a workspace")
    return run_out(daemon.engine.shown(await daemon.engine.resume(data.run_id)))


async def run_retry(daemon: Daemon, data: RunIdIn, ctx: ToolContext) -> RunOut:
    original = await daemon.engine.find(data.run_id)
    if _commands(original.plan):
        require(ctx, "command", "retrying a run with command tasks")
    if original.workspace is not None:
        require(ctx, "command", "retrying a run on a workspace")
    return run_out(
        daemon.engine.shown(await daemon.engine.retry(data.run_id, client=ctx.client.name))
    )


class PatchOut(_Out):
    """A run's combined patch: its done tasks' changes to the workspace, a unified diff."""

    run_id: str
    workspace: str | None = None
    state: RunState
    patch: str | None = Field(
        default=None, description="The unified diff (None: the run has no patch yet)."
    )
    files: list[str] = []
    tasks: list[str] = Field(default=[], description="The tasks whose changes it holds.")
    seq: int | None = Field(default=None, description="The run.patch entry.")
    error: str | None = None


async def run_patch(daemon: Daemon, data: RunIdIn, ctx: ToolContext) -> PatchOut:
    view, body = await daemon.engine.patch(data.run_id)
    out = PatchOut(run_id=view.id, workspace=view.workspace, state=view.state, seq=view.patch_seq)
    if body is not None:
        out.patch, out.files, out.tasks, out.error = body.patch, body.files, body.tasks, body.error
    return out


class ApplyIn(RunIdIn):
    check: bool = Field(
        default=False, description="Only check that it applies: nothing is written or witnessed."
    )


class ApplyOut(_Out):
    run_id: str
    workspace: str
    applied: bool = Field(description="Whether the files were changed (false with check).")
    method: str = Field(description="git-3way, git-apply, or none (nothing to do).")
    files: list[str]
    note: str | None = None


async def run_apply(daemon: Daemon, data: ApplyIn, ctx: ToolContext) -> ApplyOut:
    done = await daemon.engine.apply(data.run_id, check=data.check, client=ctx.client.name)
    return ApplyOut(
        run_id=data.run_id,
        workspace=done.path,
        applied=not data.check and done.method != "none",
        method=done.method,
        files=done.files,
        note=done.error,
    )


class ReplayIn(RunIdIn):
    at: Seq | None = Field(
        default=None, description="The ledger seq to stop at (inclusive); default: the end."
    )


async def run_replay(daemon: Daemon, data: ReplayIn, ctx: ToolContext) -> RunOut:
    view = (await replay(daemon.ledger, run=data.run_id, until=data.at)).get(data.run_id)
    if view is None:
        where = "" if data.at is None else f" at seq {data.at}"
        raise NotFound(f"no run {data.run_id}{where}", details={"run": data.run_id})
    return run_out(view)


class CompareIn(_In):
    a: str = Field(min_length=1, max_length=128, description="One run's id.")
    b: str = Field(min_length=1, max_length=128, description="The other run's id.")


class CompareSide(_Out):
    id: str
    state: RunState
    lane: str | None = None
    request: str
    tasks: int
    model_calls: int
    tokens: int
    wall_ms: int
    escalations: int = Field(description="task.escalate entries.")
    verdicts_ok: int
    verdicts_failed: int
    answer: str | None = None


class CompareOut(_Out):
    a: CompareSide
    b: CompareSide


async def _compare_side(daemon: Daemon, run_id: str) -> CompareSide:
    daemon.engine.get(run_id)  # NotFound for a run the daemon does not know
    view = (await replay(daemon.ledger, run=run_id)).get(run_id)
    if view is None:
        raise NotFound(f"no run {run_id}", details={"run": run_id})
    counts = {k.TASK_ESCALATE: 0, "ok": 0, "failed": 0}
    start = view.request_seq
    while True:
        batch = await daemon.ledger.entries(start=start, limit=1000, run=run_id)
        verdicts = [e.body if e.kind == k.TASK_VERDICT else None for e in batch]
        for e, (_, body) in zip(batch, await daemon.ledger.read_bodies(verdicts), strict=True):
            if e.kind == k.TASK_ESCALATE:
                counts[k.TASK_ESCALATE] += 1
            elif e.kind == k.TASK_VERDICT and e.body is not None:
                verdict = rec.TaskVerdict.parsed(body)
                counts["ok" if verdict is not None and verdict.ok else "failed"] += 1
        if len(batch) < 1000:
            break
        start = batch[-1].seq + 1
    return CompareSide(
        id=view.id,
        state=view.state,
        lane=view.lane,
        request=view.request,
        tasks=len(view.tasks),
        model_calls=view.spent.model_calls,
        tokens=view.spent.tokens,
        wall_ms=view.spent.wall_ms,
        escalations=counts[k.TASK_ESCALATE],
        verdicts_ok=counts["ok"],
        verdicts_failed=counts["failed"],
        answer=view.answer,
    )


async def run_compare(daemon: Daemon, data: CompareIn, ctx: ToolContext) -> CompareOut:
    return CompareOut(a=await _compare_side(daemon, data.a), b=await _compare_side(daemon, data.b))


# ---------------------------------------------------------------- ledger


class VerifyIn(_In):
    deep: bool = Field(default=False, description="Also re-hash every stored body (slower).")


async def ledger_verify(daemon: Daemon, data: VerifyIn, ctx: ToolContext) -> VerifyOut:
    return VerifyOut.model_validate(
        (await daemon.ledger.verify(deep=data.deep)).model_dump(mode="json")
    )


class RemoteVerifyIn(_In):
    run: str | None = Field(
        default=None, min_length=1, max_length=128, description="Only this run's calls."
    )
    limit: Annotated[int, Field(ge=1, le=100_000), Whole] = Field(
        default=1000, description="Check at most this many."
    )


class RemoteCheckOut(_Out):
    seq: int = Field(description="Our model.reply entry.")
    member: str
    remote_seq: int = Field(description="The other daemon's gateway.reply entry.")
    status: Literal["ok", "failed", "pending"]
    reason: str | None = None
    checkpoint_size: int | None = None


class RemoteVerifyOut(_Out):
    checked: int
    ok: int
    failed: int
    pending: int = Field(description="Calls its latest signed checkpoint does not cover yet.")
    results: list[RemoteCheckOut]


async def ledger_verify_remote(
    daemon: Daemon, data: RemoteVerifyIn, ctx: ToolContext
) -> RemoteVerifyOut:
    from daemon.remotes import verify_remote

    report = await verify_remote(daemon.ledger, daemon.roster, data.run, data.limit)
    return RemoteVerifyOut.model_validate(report.model_dump())


class EntriesIn(_In):
    start: Seq = Field(default=0, description="First seq to return.")
    limit: Annotated[int, Field(ge=1, le=1000), Whole] = 100
    kind: str | None = Field(default=None, description="Only entries of this kind.")
    run: str | None = Field(default=None, description="Only entries of this run.")
    actor: str | None = None
    bodies: bool = Field(default=False, description="Include each entry's body content.")


async def ledger_entries(daemon: Daemon, data: EntriesIn, ctx: ToolContext) -> EntriesOut:
    found = await daemon.ledger.entries(
        start=data.start, limit=data.limit, kind=data.kind, run=data.run, actor=data.actor
    )
    return EntriesOut(
        entries=await _with_bodies(daemon, list(found), data.bodies), size=daemon.ledger.size
    )


class SeqIn(_In):
    seq: Seq = Field(description="The entry's sequence number.")
    bodies: bool = Field(default=True, description="Include body content.")
    line: bool = Field(
        default=False, description="Include the stored line, to check its inclusion yourself."
    )


async def ledger_get(daemon: Daemon, data: SeqIn, ctx: ToolContext) -> EntryOut:
    entry = await daemon.ledger.get(data.seq)
    out = (await _with_bodies(daemon, [entry], data.bodies))[0]
    if data.line:
        out.line = entry.line().decode()
    return out


_PROOF_SHAPES: JsonDict = {
    # The rule the validator below enforces, stated in the published schema: an inclusion
    # proof names `seq` (and maybe `size`), a consistency proof `old` (and maybe `new`).
    "oneOf": [
        {
            "properties": {
                "kind": {"const": "inclusion"},
                "seq": {"type": "integer"},
                "old": {"type": "null"},
                "new": {"type": "null"},
            },
            "required": ["seq"],
        },
        {
            "properties": {
                "kind": {"const": "consistency"},
                "old": {"type": "integer"},
                "seq": {"type": "null"},
                "size": {"type": "null"},
            },
            "required": ["old"],
        },
    ]
}


class ProofIn(_In):
    model_config = ConfigDict(json_schema_extra=_PROOF_SHAPES)

    kind: Literal["inclusion", "consistency"] = Field(
        description="inclusion: seq is in the tree of `size`; consistency: `old` extends to `new`."
    )
    seq: Seq | None = Field(default=None, description="inclusion: the entry.")
    size: Size | None = Field(default=None, description="inclusion: tree size (default now).")
    old: Size | None = Field(default=None, description="consistency: the old tree size.")
    new: Size | None = Field(default=None, description="consistency: new size (default now).")

    @model_validator(mode="after")
    def _needs(self) -> ProofIn:
        if self.kind == "inclusion":
            if self.seq is None:
                raise ValueError("an inclusion proof needs 'seq'")
            if self.old is not None or self.new is not None:
                raise ValueError("'old' and 'new' belong to a consistency proof")
        else:
            if self.old is None:
                raise ValueError("a consistency proof needs 'old'")
            if self.seq is not None or self.size is not None:
                raise ValueError("'seq' and 'size' belong to an inclusion proof")
        return self


class ProofOut(_Out):
    kind: Literal["inclusion", "consistency"]
    leaf_index: int | None = None
    tree_size: int | None = None
    root: str | None = None
    old_size: int | None = None
    new_size: int | None = None
    old_root: str | None = None
    new_root: str | None = None
    path: list[str] = Field(description="RFC 9162 audit path, hex SHA-256 hashes.")


async def ledger_proof(daemon: Daemon, data: ProofIn, ctx: ToolContext) -> ProofOut:
    proof: InclusionProof | ConsistencyProof
    if data.kind == "inclusion":
        assert data.seq is not None
        proof = await daemon.ledger.inclusion_proof(data.seq, size=data.size)
    else:
        assert data.old is not None
        proof = await daemon.ledger.consistency_proof(data.old, data.new)
    return ProofOut.model_validate({"kind": data.kind, **proof.model_dump(mode="json")})


class CheckpointIn(_In):
    create: bool = Field(default=False, description="Sign a new checkpoint instead of the latest.")


class CheckpointOut(_Out):
    checkpoint: dict[str, Any] | None = Field(
        description="Signed tree head (size, root, time, signed note); null if none yet."
    )
    vkey: str | None = Field(
        default=None,
        description="The signer's C2SP verifier key, as the daemon says: pin it out of band "
        "(`checkpoint.vkey` in the state dir) before trusting what it verifies.",
    )


async def ledger_checkpoint(daemon: Daemon, data: CheckpointIn, ctx: ToolContext) -> CheckpointOut:
    if data.create:
        require(ctx, "admin", "signing a checkpoint (create=true)")
    cp = await daemon.ledger.checkpoint() if data.create else daemon.ledger.latest_checkpoint()
    vkey = await asyncio.to_thread(lambda: daemon.ledger.vkey)  # may load the key: off the loop
    return CheckpointOut(checkpoint=None if cp is None else cp.model_dump(mode="json"), vkey=vkey)


class CosignIn(_In):
    note: str = Field(
        max_length=16384, description="The checkpoint's signed note (C2SP signed-note text)."
    )
    old_size: Annotated[int, Field(ge=0, le=MAX_SAFE_INT), Whole] = Field(
        default=0, description="The size this daemon last cosigned for that origin (0: none)."
    )
    proof: list[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = Field(
        default_factory=list,
        max_length=64,
        description="RFC 9162 consistency proof (hex hashes) from old_size to the note's size.",
    )


class CosignOut(_Out):
    line: str = Field(description="The cosignature: one C2SP note signature line, to attach.")
    cosigner: str = Field(description="The cosigner's C2SP verifier key (type 0x04).")
    seq: int = Field(description="The `checkpoint.cosign` entry witnessing it here.")


async def ledger_cosign(daemon: Daemon, data: CosignIn, ctx: ToolContext) -> CosignOut:
    from daemon.cosigning import own_key
    from daemon.ledger.cosign import cosigner_vkey

    assert daemon.cosigner is not None
    line, seq = await daemon.cosigner.cosign(
        daemon.roster, data.note, data.old_size, data.proof, ctx.client.name
    )
    name, public = await asyncio.to_thread(own_key, daemon.ledger)
    return CosignOut(line=line, cosigner=cosigner_vkey(name, public), seq=seq)


class CosignedIn(_In):
    pass


class CosignedOut(_Out):
    note: str | None = Field(
        description="The latest checkpoint cosigned by other daemons: its signed note with one "
        "signature line per cosigner after the origin's; null if none yet."
    )
    size: int | None = None
    root: str | None = Field(default=None, description="Hex root hash at `size`.")
    cosigners: list[str] = Field(
        default_factory=list, description="The key names of its cosignatures (unchecked here)."
    )
    cosigner_vkey: str | None = Field(
        default=None,
        description="This daemon's own cosigner key (type 0x04): what others list to count "
        "its cosignatures (`tally ledger verify --cosigner NAME=KEY`).",
    )


async def ledger_cosigned(daemon: Daemon, data: CosignedIn, ctx: ToolContext) -> CosignedOut:
    from daemon.cosigning import held_cosigned, own_key
    from daemon.ledger.checkpoint import CheckpointError, parse_note
    from daemon.ledger.cosign import CosignError, cosigner_names, cosigner_vkey

    name, public = await asyncio.to_thread(own_key, daemon.ledger)
    mine = cosigner_vkey(name, public)
    note = await held_cosigned(daemon.ledger)  # on a shared record, the record's too
    if note is None:
        return CosignedOut(note=None, cosigner_vkey=mine)
    try:
        checkpoint = parse_note(note)
        names = cosigner_names(note)
    except (CheckpointError, CosignError):
        return CosignedOut(note=None, cosigner_vkey=mine)
    return CosignedOut(
        note=note, size=checkpoint.size, root=checkpoint.root, cosigners=names, cosigner_vkey=mine
    )


class CollectOut(_Out):
    size: int | None = Field(description="The checkpoint asked about; null: none signed yet.")
    note: str | None = Field(description="That checkpoint with the cosignatures held for it.")
    results: list[dict[str, Any]] = Field(
        description="Per `cosign = true` member: status cosigned or failed, with the reason."
    )


async def ledger_cosign_collect(daemon: Daemon, data: CheckpointIn, ctx: ToolContext) -> CollectOut:
    if data.create:
        await daemon.ledger.checkpoint()
    report = await daemon.collector.collect(daemon.ledger, daemon.roster)
    return CollectOut(
        size=report.size, note=report.note, results=[r.model_dump() for r in report.results]
    )


class ChainIn(_In):
    seq: Seq = Field(description="The entry whose causes you want.")
    bodies: bool = False


async def causal_chain(daemon: Daemon, data: ChainIn, ctx: ToolContext) -> EntriesOut:
    chain = await daemon.ledger.causal_chain(data.seq)
    return EntriesOut(
        entries=await _with_bodies(daemon, list(chain), data.bodies), size=daemon.ledger.size
    )


class RedactIn(_In):
    body_hash: str = Field(pattern=HEX64, description="The body hash (an entry's `body`).")
    reason: str = Field(min_length=1, max_length=2000, description="Why; witnessed.")
    actor: str = Field(default="user", min_length=1, max_length=200)


async def ledger_redact(daemon: Daemon, data: RedactIn, ctx: ToolContext) -> EntryOut:
    # The witnessed actor is the authenticated client; `actor` is only a label beside it.
    actor = ctx.client.name if data.actor == "user" else f"{ctx.client.name}/{data.actor}"
    entry = await daemon.ledger.redact(data.body_hash, actor=actor, reason=data.reason)
    return entry_out(entry)


class MemberUsage(_Out):
    calls: int = Field(default=0, description="model.call entries naming this member.")
    errors: int = Field(default=0, description="Replies that carry an error.")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ms: int = Field(default=0, description="Time from each model.call to its model.reply.")


class ClientUsage(_Out):
    runs: int = Field(default=0, description="Runs the client submitted.")
    entries: int = Field(default=0, description="Entries of its runs and of its own requests.")


class GatewayUsage(_Out):
    calls: int = Field(default=0, description="Answered gateway calls (gateway.reply, no error).")
    errors: int = Field(default=0, description="Attempts that ended in an error.")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ms: int = Field(default=0, description="Time the answered calls took, summed.")


class SummaryIn(_In):
    run: str | None = Field(default=None, description="One run's summary; default: all.")
    client: str | None = Field(
        default=None, pattern=CLIENT_NAME, description="Only what this named client caused."
    )
    verify: bool = Field(default=True, description="Include a (shallow) verify result.")


class SummaryOut(_Out):
    run: str | None
    entries: int
    by_kind: dict[str, int]
    model_calls: int = Field(
        description="Model calls of runs (model.call entries); /metrics' tally_model_calls_total"
    )
    gateway_calls: int = Field(
        default=0, description="Gateway calls answered (gateway.reply without an error)"
    )
    gateway_errors: int = Field(default=0, description="Gateway attempts that ended in an error")
    tokens: int = Field(description="Prompt + completion tokens the servers reported to runs.")
    per_member: dict[str, MemberUsage]
    by_purpose: dict[str, int] = Field(description="Model calls by purpose (task, plan, ...).")
    escalations: int = Field(description="task.escalate entries: a task moved up a tier.")
    route_escalations: int = Field(description="Routes that asked for a classifier.")
    runs_by_state: dict[str, int] = Field(description="Final states witnessed by run.state.")
    by_client: dict[str, ClientUsage] = Field(
        default={}, description="Runs submitted and entries caused, by named client."
    )
    gateway: dict[str, dict[str, GatewayUsage]] = Field(
        default={}, description="OpenAI-gateway traffic by client, then by model asked for."
    )
    verify: VerifyOut | None = None
    checkpoint: dict[str, Any] | None = None


_WORDS = Vocabulary(
    request=k.REQUEST,
    route=k.ROUTE,
    state=k.STATE,
    model_call=k.MODEL_CALL,
    model_reply=k.MODEL_REPLY,
    gateway_reply=GATEWAY_REPLY,
    system=frozenset({"daemon", "pool", k.ACTOR}),
)


async def ledger_summary(daemon: Daemon, data: SummaryIn, ctx: ToolContext) -> SummaryOut:
    acc = await summarize(daemon.ledger, _WORDS, run=data.run, client=data.client)
    report = None
    if data.verify:
        report = VerifyOut.model_validate((await daemon.ledger.verify()).model_dump(mode="json"))
    cp = daemon.ledger.latest_checkpoint()
    members = {name: MemberUsage(**asdict(m)) for name, m in acc.members.items()}
    return SummaryOut(
        run=data.run,
        entries=acc.count,
        by_kind=acc.by_kind,
        model_calls=acc.by_kind.get(k.MODEL_CALL, 0),
        gateway_calls=sum(g.calls for models in acc.gateway.values() for g in models.values()),
        gateway_errors=sum(g.errors for models in acc.gateway.values() for g in models.values()),
        tokens=sum(m.prompt_tokens + m.completion_tokens for m in members.values()),
        per_member=members,
        by_purpose=acc.by_purpose,
        escalations=acc.by_kind.get(k.TASK_ESCALATE, 0),
        route_escalations=acc.route_escalations,
        runs_by_state=acc.states,
        by_client={name: ClientUsage(**asdict(c)) for name, c in acc.by_client.items()},
        gateway={
            who: {model: GatewayUsage(**asdict(g)) for model, g in models.items()}
            for who, models in acc.gateway.items()
        },
        verify=report,
        checkpoint=None if cp is None else cp.model_dump(mode="json"),
    )


# ---------------------------------------------------------------- roster and slots


class RosterOut(_Out):
    roster: dict[str, Any] = Field(description="The roster in force (lanes, tiers, policy).")


async def roster_get(daemon: Daemon, _: Empty, ctx: ToolContext) -> RosterOut:
    return RosterOut(roster=daemon.roster.model_dump(mode="json"))


class ClientNameIn(_In):
    name: str = Field(pattern=CLIENT_NAME, description="The client's name.")


class ClientAddIn(ClientNameIn):
    scope: Scope = Field(description="read, submit, command or admin (each includes the former).")
    limits: Limits | None = Field(
        default=None,
        description="Rate limits and a token budget (rpm, tpm, tokens_per_day); none: unlimited.",
    )


class ClientUse(_Out):
    """What a client used, over the same windows its limits count."""

    requests_minute: int
    tokens_minute: int
    tokens_day: int


class ClientOut(_Out):
    name: str
    scope: Scope
    created_at_us: int
    limits: Limits | None = None
    used: ClientUse | None = Field(
        default=None, description="Its requests and tokens in the last minute and 24 hours."
    )


class ClientAddOut(ClientOut):
    token: str = Field(description="The bearer token: store it now, it is not kept.")


class ClientListOut(_Out):
    clients: list[ClientOut]


async def client_add(daemon: Daemon, data: ClientAddIn, ctx: ToolContext) -> ClientAddOut:
    token = await asyncio.to_thread(daemon.clients.add, data.name, data.scope, data.limits)
    body = rec.ClientAdd(name=data.name, scope=data.scope)
    if data.limits is not None and data.limits.any():  # absent otherwise: the bytes of before
        body.limits = data.limits.model_dump(exclude_none=True)
    await daemon.ledger.append(actor=ctx.client.name, kind=body.KIND, body=body.written())
    record = next(r for r in daemon.clients.records() if r.name == data.name)
    return ClientAddOut(**record.model_dump(exclude={"token_sha256"}), token=token)


async def client_list(daemon: Daemon, _: Empty, ctx: ToolContext) -> ClientListOut:
    records = daemon.clients.records()
    return ClientListOut(
        clients=[
            ClientOut(
                **r.model_dump(exclude={"token_sha256"}),
                used=ClientUse(**daemon.quotas.snapshot(r.name)),
            )
            for r in records
        ]
    )


async def client_revoke(daemon: Daemon, data: ClientNameIn, ctx: ToolContext) -> ClientOut:
    record = await asyncio.to_thread(daemon.clients.revoke, data.name)
    revoked = rec.ClientRevoke(name=data.name)
    await daemon.ledger.append(actor=ctx.client.name, kind=revoked.KIND, body=revoked.written())
    return ClientOut(**record.model_dump(exclude={"token_sha256"}))


class ReloadIn(_In):
    path: str | None = Field(default=None, description="Roster file; default: the current one.")


class ReloadOut(_Out):
    lanes: int
    members: int


async def roster_reload(daemon: Daemon, data: ReloadIn, ctx: ToolContext) -> ReloadOut:
    if data.path and not daemon.roster_allowed(Path(data.path)):
        # Checked before existence: a refused path must not become a file-existence oracle.
        raise Forbidden(
            f"roster_reload reads only {str(daemon.roster_path)!r} or a file in its directory "
            "(or in the daemon's roster directories); this path is outside them",
            details={"path": data.path},
        )
    if data.path and not await asyncio.to_thread(Path(data.path).exists):
        raise NotFound(f"no roster file at {data.path!r}")
    try:
        roster = await daemon.reload_roster(
            Path(data.path) if data.path else None, client=ctx.client.name
        )
    except OSError as exc:
        raise InvalidInput(f"cannot read the roster: {exc.strerror or exc}") from None
    return ReloadOut(lanes=len(roster.lanes), members=len(roster.models))


class SlotInstanceOut(_Out):
    index: int
    state: str = Field(
        description="stopped, starting, ready, backoff, stopping, cooldown, unhealthy (an "
        "external server that does not answer: probed, never restarted)"
    )
    port: int | None = None
    pid: int | None = None
    url: str | None = None
    slots_total: int = 0
    slots_busy: int = 0
    slots_idle: int = 0
    n_ctx: int | None = None
    restarts: int = 0
    last_error: str | None = None


class SlotMemberOut(_Out):
    name: str
    external: bool = Field(description="True for a `url` member tally does not spawn.")
    state: str
    queue: int = Field(description="Callers waiting for a slot of this member.")
    max_queue: int
    leases: int = Field(description="Slots leased right now.")
    restarts: int = 0
    failures: int = 0
    cooldown_remaining_ms: int = 0
    last_error: str | None = None
    instances: list[SlotInstanceOut] = []
    healthy: bool = Field(
        default=True, description="False while it takes no lease (cooling down, unreachable)."
    )
    unhealthy_ms: int = Field(default=0, description="How long it has been unreachable.")
    next_probe_ms: int | None = Field(default=None, description="When it is probed next.")
    downs: int = Field(default=0, description="Times it became unreachable.")
    recoveries: int = Field(default=0, description="Times it answered again after that.")


class SlotTierOut(_Out):
    name: str
    members: list[str]
    queue: int = Field(
        description="Callers waiting for any member of this tier (runs lease by tier)."
    )
    max_queue: int
    healthy: list[str] = Field(default=[], description="Members that can take a lease now.")
    failovers: int = Field(
        default=0, description="Leases a higher tier served because none here could."
    )
    in_flight_failovers: int = Field(
        default=0,
        description="Calls moved to another member of this tier after theirs failed mid-call.",
    )


class SlotsOut(_Out):
    members: list[SlotMemberOut]
    tiers: list[SlotTierOut] = []
    busy: int = Field(description="Busy slots across all members.")
    idle: int = Field(description="Idle slots of running instances.")
    queue: int = Field(description="Callers waiting for a slot, tier and member queues together.")
    command_sandbox: CommandSandbox = "bwrap"


def slots_out(status: PoolStatus) -> SlotsOut:
    members = [SlotMemberOut.model_validate(m.model_dump(mode="json")) for m in status.members]
    instances = [i for m in members for i in m.instances]
    return SlotsOut(
        members=members,
        tiers=[SlotTierOut.model_validate(t.model_dump(mode="json")) for t in status.tiers],
        busy=sum(i.slots_busy for i in instances),
        idle=sum(i.slots_idle for i in instances if i.state == "ready"),
        queue=status.queued,
    )


async def slots_status(daemon: Daemon, _: Empty, ctx: ToolContext) -> SlotsOut:
    return slots_out(daemon.pool.status()).model_copy(
        update={"command_sandbox": command_sandbox(daemon)}
    )


# ---------------------------------------------------------------- status and stop (daily use)


class StatusDaemonOut(_Out):
    pid: int
    version: str
    started_at_us: int = Field(description="When the daemon started (wall clock, µs).")
    uptime_s: float
    listeners: list[str] = Field(description="Where it listens: unix:PATH, http://HOST:PORT.")
    state_dir: str


class StatusRunsOut(_Out):
    by_state: dict[str, int] = Field(
        description="Runs in memory by state as shown: a run whose work waits for a slot "
        "counts as `queued`, not `running`."
    )
    tasks_by_state: dict[str, int] = Field(
        description="Tasks of runs in memory by state as shown (`waiting`: for a slot)."
    )
    in_flight: int = Field(description="Runs being driven now (what a stop drains).")


class StatusLedgerOut(_Out):
    size: int = Field(description="Entries in the ledger.")
    bytes: int | None = Field(default=None, description="The entries file's size on disk.")
    writable: bool
    reason: str | None = Field(default=None, description="Why it cannot write (degraded).")
    checkpoint_size: int | None = Field(default=None, description="The last signed tree size.")
    checkpoint_time_us: int | None = Field(default=None, description="When it was signed.")


class StatusRoutingOut(_Out):
    embeddings: str | None = Field(
        description="The embedding member (`[policy] embeddings`); null: keyword routing only."
    )
    state: Literal["off", "not built", "building", "ready", "down"] = Field(
        description="Its example vectors: ready (routes use them); building, not built or "
        "down (routes fall back to the keyword scores, `why`)."
    )
    why: str | None = None
    examples: int = 0
    reused: int = Field(default=0, description="Example vectors taken from the cache.")
    computed: int = Field(default=0, description="Example vectors the member computed.")
    build_ms: int = 0
    cache_problem: str | None = Field(
        default=None, description="Why the cache file was not used at the last build."
    )


class StatusOut(_Out):
    status: Literal["ok", "degraded"]
    daemon: StatusDaemonOut
    pool: SlotsOut
    runs: StatusRunsOut
    ledger: StatusLedgerOut
    routing: StatusRoutingOut | None = None


def _entries_bytes(daemon: Daemon) -> int | None:
    try:
        return (Path(daemon.settings.state_dir) / "ledger" / "entries.jsonl").stat().st_size
    except OSError:
        return None


async def status(daemon: Daemon, _: Empty, ctx: ToolContext) -> StatusOut:
    import os

    engine = daemon.engine
    runs, tasks = engine.shown_census()
    health = daemon.ledger.health
    cp = daemon.ledger.latest_checkpoint()
    return StatusOut(
        status="ok" if health.writable else "degraded",
        daemon=StatusDaemonOut(
            pid=os.getpid(),
            version=package_version(),
            started_at_us=daemon.started_at_us,
            uptime_s=round(time.monotonic() - STARTED, 3),
            listeners=list(daemon.listeners),
            state_dir=str(daemon.settings.state_dir),
        ),
        pool=await slots_status(daemon, Empty(), ctx),
        runs=StatusRunsOut(by_state=runs, tasks_by_state=tasks, in_flight=engine.in_flight()),
        ledger=StatusLedgerOut(
            size=daemon.ledger.size,
            bytes=await asyncio.to_thread(_entries_bytes, daemon),
            writable=health.writable,
            reason=None if health.writable else health.detail,
            checkpoint_size=None if cp is None else cp.size,
            checkpoint_time_us=None if cp is None else cp.time_us,
        ),
        routing=_routing_status(daemon),
    )


def _routing_status(daemon: Daemon) -> StatusRoutingOut:
    embeddings = daemon.router.embeddings
    if embeddings is None:
        return StatusRoutingOut(embeddings=None, state="off")
    shown = embeddings.status()
    return StatusRoutingOut(
        embeddings=shown["member"],
        state=shown["state"],
        why=shown["why"],
        examples=shown["examples"],
        reused=shown["reused"],
        computed=shown["computed"],
        build_ms=shown["build_ms"],
        cache_problem=shown["cache_problem"],
    )


class StopOut(_Out):
    stopping: bool = Field(description="True: the daemon is stopping now.")
    draining: int = Field(description="Runs in flight it lets finish first.")
    drain_s: float = Field(description="How long it lets them run before it interrupts them.")


async def daemon_stop(daemon: Daemon, _: Empty, ctx: ToolContext) -> StopOut:
    stop = daemon.stop_requested
    if stop is None:  # an embedded daemon (tests, a library user): its owner stops it
        raise Conflict("this daemon is not run by `tally serve`: stop it where it runs")
    # After this answer is on its way: the server stops as on SIGTERM (drain, interrupt the
    # rest, checkpoint, release the ledger).
    asyncio.get_running_loop().call_soon(stop.set)
    return StopOut(
        stopping=True, draining=daemon.engine.in_flight(), drain_s=daemon.settings.drain_s
    )


# ---------------------------------------------------------------- the registry


def _tools() -> list[Tool[Any, Any]]:
    return [
        Tool(
            "health",
            "Check that the tally daemon is up: version, uptime, ledger size, active runs, "
            "lanes and pool members. Cheap; use it first when unsure tally is running.",
            Empty,
            HealthOut,
            health,
        ),
        Tool(
            "route",
            "Show which agent lane (backend, frontend, security, docs, ...) tally would route a "
            "request to, with confidence, per-lane scores, the words and examples that decided "
            "it, and `decision`: what submit will do (the lane, `general` or the best score "
            "with no model call, or the classifier). No model call and nothing is run (the "
            "preview is witnessed in the ledger). Use it to preview or debug routing.",
            RouteIn,
            RouteOut,
            route,
        ),
        Tool(
            "route_teach",
            "Teach routing: add a request to a lane's examples in the daemon's roster file "
            "(comments kept, the edit witnessed), so that request and close paraphrases go "
            "to that lane from now on. Answers the decision before and after.",
            TeachIn,
            TeachOut,
            route_teach,
            scope="admin",
        ),
        Tool(
            "route_suggest",
            "Examples worth teaching: requests whose submit named a lane other than the "
            "router's choice, that the router still sends elsewhere, most repeated first, "
            "each with the `tally route --teach` command. Reads the record only.",
            SuggestIn,
            SuggestOut,
            route_suggest,
        ),
        Tool(
            "plan",
            "Validate an explicit task plan (a DAG of tasks with lanes and `needs`) and compute "
            "its execution waves and critical path; reports every problem (unknown lane, missing "
            "dependency, named cycle). Use it to check a plan before passing it to submit.",
            PlanIn,
            PlanOut,
            plan,
        ),
        Tool(
            "submit",
            "Run a request through tally's agent fleet (route → plan → run tasks on local "
            "models → validate → answer); every step is recorded in the verifiable ledger. "
            "Returns the run (id, state); with wait=true waits up to timeout_s and returns the "
            "answer. Use it to get work done; then run_get to poll a run that is still going.",
            SubmitIn,
            RunOut,
            submit,
            scope="submit",
        ),
        Tool(
            "run_get",
            "Get one run by id: state, tasks, spending, and the answer once it is done. Use it "
            "to poll a run started by submit.",
            RunIdIn,
            RunOut,
            run_get,
        ),
        Tool(
            "runs_list",
            "List recent runs, newest first, optionally only those in one state (e.g. running, "
            "interrupted). Use it to find a run id or see what tally is doing.",
            RunsIn,
            RunsOut,
            runs_list,
        ),
        Tool(
            "run_cancel",
            "Cancel a run: in-flight model requests are aborted and no further task starts. "
            "Use it when a run is no longer wanted or is taking too long.",
            RunIdIn,
            RunOut,
            run_cancel,
            scope="submit",
        ),
        Tool(
            "run_resume",
            "Resume an interrupted run (e.g. after a daemon restart), reusing every task "
            "already witnessed as done. Use it on runs in state 'interrupted'.",
            RunIdIn,
            RunOut,
            run_resume,
            scope="submit",
        ),
        Tool(
            "run_retry",
            "Retry a failed, cancelled or budget-exhausted run: a new run with the same "
            "request, plan and budget whose record links the original (retry_of); the tasks "
            "the original had done are reused, not run again, and the rest run anew. On a "
            "workspace (command scope) it works on a fresh snapshot of it, onto which each "
            "reused task's changes are carried (a task whose changes no longer apply runs "
            "again: `workspace.carry` says why). Returns the new run.",
            RunIdIn,
            RunOut,
            run_retry,
            scope="submit",
        ),
        Tool(
            "run_patch",
            "Get a workspace run's combined patch: the unified diff of every done task's "
            "changes to its copy of the project, against the snapshot taken at submit. Nothing "
            "is written; use run_apply to apply it.",
            RunIdIn,
            PatchOut,
            run_patch,
        ),
        Tool(
            "run_apply",
            "Apply a workspace run's patch to the project (check=true only tries). Refuses "
            "paths outside the workspace and files changed since the run's snapshot; a git "
            "repository gets `git apply --3way`. Witnessed in the ledger.",
            ApplyIn,
            ApplyOut,
            run_apply,
            scope="command",
        ),
        Tool(
            "run_replay",
            "Rebuild a run's state from the ledger alone as it stood after entry `at` (default: "
            "now), without calling any model: model replies are in the record. Use it to see "
            "what a run looked like at a point in its history.",
            ReplayIn,
            RunOut,
            run_replay,
        ),
        Tool(
            "run_compare",
            "Compare two runs side by side from the record: state, tasks, model calls, tokens, "
            "wall time, escalations, verdicts and answers. Use it to show that a change to a "
            "roster, model or prompt helped.",
            CompareIn,
            CompareOut,
            run_compare,
        ),
        Tool(
            "ledger_verify",
            "Verify the ledger: the hash chain, the Merkle tree and (deep=true) every stored "
            "body. Reports the first bad entry, redacted and tampered bodies. Use it to check "
            "that the record of what tally did is intact.",
            VerifyIn,
            VerifyOut,
            ledger_verify,
        ),
        Tool(
            "ledger_verify_remote",
            "Prove the calls other tally daemons answered for us (roster members with "
            "tally = true) are in their ledgers: each one's signed checkpoint is checked "
            "against the key pinned in the roster, then the entry's inclusion proof and the "
            "answer's hash. Calls a checkpoint does not cover yet are `pending`.",
            RemoteVerifyIn,
            RemoteVerifyOut,
            ledger_verify_remote,
        ),
        Tool(
            "ledger_entries",
            "Read ledger entries in sequence order, filtered by kind, run or actor, optionally "
            "with their bodies (prompts, outputs, plans, verdicts). Use it to audit what "
            "happened in a run, step by step.",
            EntriesIn,
            EntriesOut,
            ledger_entries,
        ),
        Tool(
            "ledger_get",
            "Get one ledger entry by sequence number, with its body content unless redacted.",
            SeqIn,
            EntryOut,
            ledger_get,
        ),
        Tool(
            "ledger_proof",
            "Produce an RFC 9162 Merkle proof: inclusion (entry `seq` is in the tree of `size`) "
            "or consistency (the tree of size `old` is a prefix of the tree of size `new`). Use "
            "it to prove to a third party that an entry is recorded or that history was not "
            "rewritten since a pinned checkpoint.",
            ProofIn,
            ProofOut,
            ledger_proof,
        ),
        Tool(
            "ledger_checkpoint",
            "Get the latest signed checkpoint (tree size, root hash, ed25519-signed note), or "
            "sign a new one with create=true. Use it to pin the ledger's state for later "
            "consistency checks.",
            CheckpointIn,
            CheckpointOut,
            ledger_checkpoint,
        ),
        Tool(
            "ledger_cosign",
            "Cosign another tally daemon's checkpoint (C2SP tlog-cosignature): the caller "
            "sends the signed note and a consistency proof from the size this daemon last "
            "cosigned for it. Its origin must be a roster member with tally = true whose pinned "
            "key signed it; a checkpoint not consistent with the last one cosigned is refused "
            "(409) and witnessed. Answers 409 cosign_conflict with `details.size` when "
            "old_size is not the size held. Each cosignature is witnessed (checkpoint.cosign).",
            CosignIn,
            CosignOut,
            ledger_cosign,
            scope="submit",
        ),
        Tool(
            "ledger_cosigned",
            "Get the latest checkpoint of this ledger cosigned by other daemons: the signed "
            "note with the origin's signature line and one cosignature line per cosigner. "
            "Verify it yourself with the keys you trust and a quorum "
            "(`tally ledger verify --cosigned FILE --cosigner NAME=KEY --quorum N`).",
            CosignedIn,
            CosignedOut,
            ledger_cosigned,
        ),
        Tool(
            "ledger_cosign_collect",
            "Ask the roster's cosign = true members to cosign the latest checkpoint now (the "
            "daemon also asks after each checkpoint period); create=true signs a new "
            "checkpoint first. Reports each member's answer.",
            CheckpointIn,
            CollectOut,
            ledger_cosign_collect,
            scope="admin",
        ),
        Tool(
            "causal_chain",
            "Walk an entry's causes back to the root (e.g. answer ← verdict ← task result ← "
            "plan ← route ← request). Use it to explain why tally produced something.",
            ChainIn,
            EntriesOut,
            causal_chain,
        ),
        Tool(
            "ledger_redact",
            "Remove a body (e.g. a prompt containing a secret) from the ledger's store, "
            "witnessed by a redaction entry with actor and reason; the chain and proofs still "
            "verify. Irreversible: use only when content must be erased.",
            RedactIn,
            EntryOut,
            ledger_redact,
            scope="admin",
        ),
        Tool(
            "roster_get",
            "Show the roster in force: lanes (keywords, tier, system prompt), model tiers and "
            "the escalation ladder, pool members and policy. Use it to see which agents exist.",
            Empty,
            RosterOut,
            roster_get,
        ),
        Tool(
            "roster_reload",
            "Reload the roster file (or load another); a bad file is rejected with file:line "
            "problems and the last good roster stays in force. Use it after editing the roster.",
            ReloadIn,
            ReloadOut,
            roster_reload,
            scope="admin",
        ),
        Tool(
            "slots_status",
            "Show the local model server pool: members, instances, state, port, busy and idle "
            "slots, queue depth, restarts and last error. Use it when runs are slow or failing.",
            Empty,
            SlotsOut,
            slots_status,
        ),
        Tool(
            "ledger_summary",
            "Summarize the record for one run or the whole ledger: entries by kind, model calls "
            "and tokens and time per member, escalations, verify result and latest checkpoint; "
            "read only from the ledger. Use it for a cost/audit overview.",
            SummaryIn,
            SummaryOut,
            ledger_summary,
        ),
        Tool(
            "client_add",
            "Create a named client with one scope (read < submit < command < admin, each "
            "including the ones before) and return its bearer token, shown only this once.",
            ClientAddIn,
            ClientAddOut,
            client_add,
            scope="admin",
        ),
        Tool(
            "client_list",
            "List the named clients: name, scope and when each was made (never tokens).",
            Empty,
            ClientListOut,
            client_list,
            scope="admin",
        ),
        Tool(
            "client_revoke",
            "Revoke a named client: its token stops working at once.",
            ClientNameIn,
            ClientOut,
            client_revoke,
            scope="admin",
        ),
        Tool(
            "status",
            "The daemon at a glance: pid, uptime, version and listeners; the pool (members, "
            "loaded instances, busy slots, queues); runs and tasks by state (`queued`/`waiting` "
            "for a slot); the ledger (size, last checkpoint, writable or degraded).",
            Empty,
            StatusOut,
            status,
        ),
        Tool(
            "daemon_stop",
            "Stop the daemon cleanly: runs in flight drain for the configured time, the rest are "
            "interrupted (resumable), then it checkpoints and exits.",
            Empty,
            StopOut,
            daemon_stop,
            scope="admin",
        ),
    ]


TOOLS: dict[str, Tool[Any, Any]] = {t.name: t for t in _tools()}

# The errors a tool's handler can answer with, beyond those of any call (bad JSON, auth, body
# size, arguments that do not match the input schema, an internal error). The OpenAPI
# document lists each operation's statuses from this; the schemathesis test checks that no
# other status comes back.
ERRORS: dict[str, tuple[type[TallyError], ...]] = {
    "route": (Unavailable,),  # the preview is witnessed: the ledger may be unwritable
    "route_teach": (NotFound, Conflict, Unavailable),
    "submit": (NotFound, Conflict, Busy, RateLimited, Unavailable),
    "run_get": (NotFound,),
    "run_cancel": (NotFound, Unavailable),
    "run_resume": (NotFound, Conflict, Unavailable),
    "run_retry": (NotFound, Conflict, Busy, Unavailable),
    "run_patch": (NotFound, Conflict),
    "run_apply": (NotFound, Conflict, Unavailable),
    "run_replay": (NotFound,),
    "run_compare": (NotFound,),
    "ledger_get": (NotFound,),
    "ledger_proof": (NotFound,),
    "ledger_checkpoint": (Unavailable,),
    "ledger_cosign": (NotFound, Conflict, Unavailable),
    "ledger_cosign_collect": (Unavailable,),
    "causal_chain": (NotFound,),
    "ledger_redact": (NotFound, Unavailable),
    "roster_reload": (NotFound,),
    "client_add": (Conflict,),
    "client_revoke": (NotFound,),  # 403 (Forbidden) is documented on every operation
    "daemon_stop": (Conflict,),
}
