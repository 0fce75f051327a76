"""Routing, teaching, plans and the roster in force."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, ModelWrapValidatorHandler, PrivateAttr, ValidationError, model_validator

from daemon import record as rec
from daemon.errors import Conflict, Forbidden, InvalidInput, NotFound, Unavailable
from daemon.plans import Plan, PlanInvalid, problems, report, waves
from daemon.tools.tool import NOT_BLANK, Empty, Tool, ToolContext, _In, _Out
from roster.models import NAME, Whole

if TYPE_CHECKING:
    from daemon.router import Decision, Route
    from daemon.service import Daemon

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
    candidates: list[str] = Field(default=[])
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


ROUTE = Tool(
    "route",
    "Show which agent lane (backend, frontend, security, docs, ...) tally would route a "
    "request to, with confidence, per-lane scores, the words and examples that decided "
    "it, and `decision`: what submit will do (the lane, `general` or the best score "
    "with no model call, or the classifier). No model call and nothing is run (the "
    "preview is witnessed in the ledger). Use it to preview or debug routing.",
    RouteIn,
    RouteOut,
    route,
    errors=(Unavailable,),  # the preview is witnessed: the ledger may be unwritable
)


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


ROUTE_TEACH = Tool(
    "route_teach",
    "Teach routing: add a request to a lane's examples in the daemon's roster file "
    "(comments kept, the edit witnessed), so that request and close paraphrases go "
    "to that lane from now on. Answers the decision before and after.",
    TeachIn,
    TeachOut,
    route_teach,
    scope="admin",
    errors=(NotFound, Conflict, Unavailable),
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


ROUTE_SUGGEST = Tool(
    "route_suggest",
    "Examples worth teaching: requests whose submit named a lane other than the "
    "router's choice, that the router still sends elsewhere, most repeated first, "
    "each with the `tally route --teach` command. Reads the record only.",
    SuggestIn,
    SuggestOut,
    route_suggest,
    errors=(),
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
    tasks: list[str] = Field(default=[])
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


PLAN = Tool(
    "plan",
    "Validate an explicit task plan (a DAG of tasks with lanes and `needs`) and compute "
    "its execution waves and critical path; reports every problem (unknown lane, missing "
    "dependency, named cycle). Use it to check a plan before passing it to submit.",
    PlanIn,
    PlanOut,
    plan,
    errors=(),
)


# ---------------------------------------------------------------- roster and slots


class RosterOut(_Out):
    roster: dict[str, Any] = Field(description="The roster in force (lanes, tiers, policy).")


async def roster_get(daemon: Daemon, _: Empty, ctx: ToolContext) -> RosterOut:
    return RosterOut(roster=daemon.roster.model_dump(mode="json"))


ROSTER_GET = Tool(
    "roster_get",
    "Show the roster in force: lanes (keywords, tier, system prompt), model tiers and "
    "the escalation ladder, pool members and policy. Use it to see which agents exist.",
    Empty,
    RosterOut,
    roster_get,
    errors=(),
)


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


ROSTER_RELOAD = Tool(
    "roster_reload",
    "Reload the roster file (or load another); a bad file is rejected with file:line "
    "problems and the last good roster stays in force. Use it after editing the roster.",
    ReloadIn,
    ReloadOut,
    roster_reload,
    scope="admin",
    errors=(NotFound,),
)
