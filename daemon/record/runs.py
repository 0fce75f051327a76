"""The kinds a run writes: request, routing, plan, tasks and attempts, model calls, commands,
answer and state. Written by the engine (actor "engine"); `run.interrupted` also by the daemon
when it reconciles on start. Every entry carries `run` = the run id.

All bodies hold only JSON null/bool/str/int/list/dict (no floats): confidences and scores are
parts per million (`*_ppm`), durations integer milliseconds (`*_ms`) or microseconds (`*_us`).
Values passed through as given (a plan's `timeout_s`, a request's sampling parameters) go
through `daemon.ledger.canonical.safe`: each float becomes {"__float__": "<repr>"}. `parent`
makes the causal chain: request → route → plan → task.start → model.call → model.reply →
task.result → task.verdict → [synthesis call → reply] → run.answer → run.state.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from daemon.record.body import Body, Part

ENGINE = ("engine",)


class Budget(Part):
    """Limits (null: none) or amounts spent."""

    model_calls: int | None
    tokens: int | None
    wall_ms: int | None


class RetryOf(Part):
    run: str
    """The failed or cancelled run this one retries."""
    state: str
    reuse: list[str]
    """Its done tasks, taken as done (see task.reuse)."""


class RunRequest(Body):
    """A run as the client asked for it. `plan` is the client's plan (`safe`), if it gave one;
    `tier`, `member` and `retry_of` are written only when set."""

    KIND: ClassVar[str] = "run.request"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"tier", "member", "retry_of"})

    request: str
    lane: str | None
    plan: dict[str, Any] | None
    budget: Budget
    max_parallel: int | None
    barrier: bool
    idempotency_key: str | None
    client: str | None = None
    """The client that submitted it (absent in entries written before it was recorded)."""
    tier: str | None = None
    """The tier its tasks start on, when the client chose one."""
    member: str | None = None
    """The member every task call goes to, when the client chose one."""
    retry_of: RetryOf | None = None


class RouterChoice(Part):
    lane: str | None
    source: str
    classifier: str | None
    candidates: list[str]


class RunRoute(Body):
    """The lane chosen. Source "client": the client named it (confidence 1 000 000), with the
    router's own choice beside it in `router` (since issue 31; before it scores [] and matched
    {}). `scores` is [[lane, score_ppm], ...] (top 8), `matched` the words each lane matched."""

    KIND: ClassVar[str] = "run.route"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = ("run.request", "run.resume")
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"router", "embedding"})

    lane: str | None
    confidence_ppm: int
    escalate: bool
    source: str
    scores: list[list[Any]]
    matched: dict[str, list[str]]
    router: RouterChoice | None = None
    embedding: int | None = None
    """The seq of the run's `run.embedding` entry (since issue 31), only when the roster's
    `[policy] embeddings` names a member."""


class RunEmbedding(Body):
    """What the embedding member said of the request, written before `run.route` only when
    `[policy] embeddings` names a member (issue 31). `nearest` is [[lane, cosine_ppm, example],
    ...]: the best 5 lanes by their nearest example (centred cosine); `digest` the model digest
    the example vectors are keyed by; `examples` how many were compared; `ms` the request's
    embedding call (0: its vector was known). `used` false: the member was down, timed out or
    its vectors were still being built, and the route took the keyword scores alone (`why`)."""

    KIND: ClassVar[str] = "run.embedding"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = ("run.request", "run.resume")

    member: str
    used: bool
    why: str | None
    digest: str | None
    examples: int
    ms: int
    nearest: list[list[Any]]


class RunClassify(Body):
    """The classifier's choice among the candidate lanes. Source "model": the `[policy]
    classifier` chose; "fallback": it failed and the best score stands; "scores": no classifier,
    the best-scoring lane; "general": no lane's words matched."""

    KIND: ClassVar[str] = "run.classify"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = ("model.reply", "run.route", "output.guard")

    lane: str
    candidates: list[str]
    source: str
    error: str | None


class RunPlan(Body):
    """The plan the run follows (`safe`), its waves of task ids and critical path. Source
    "client", "coordinator", "single" or "fallback" (with `error`: why the coordinator's plan
    was not used)."""

    KIND: ClassVar[str] = "run.plan"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = (
        "run.route",
        "run.classify",
        "model.reply",
        "output.guard",
        "workspace.snapshot",
    )

    source: str
    plan: dict[str, Any]
    waves: list[list[str]]
    critical_path: int
    error: str | None


class OutputGuard(Body):
    """One structured-output attempt (classify, plan, judge) and how its reply was read."""

    KIND: ClassVar[str] = "output.guard"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = ("model.reply", "output.guard")

    purpose: str
    attempt: int
    outcome: str
    error: str | None


class TaskStart(Body):
    """An attempt of a task starts on a tier (null: the task names a member or runs a
    command). `feedback` says what failed in the previous attempt."""

    KIND: ClassVar[str] = "task.start"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = ("run.plan", "task.verdict", "task.escalate")

    task: str
    lane: str | None
    executor: str
    tier: str | None
    attempt: int
    needs: list[str]
    feedback: list[str]


class ModelCall(Body):
    """A model call, witnessed before it goes out: `request` is the exact body sent to
    `/v1/chat/completions` (`safe`)."""

    KIND: ClassVar[str] = "model.call"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = (
        "task.start",
        "run.route",
        "run.request",
        "run.classify",
        "run.plan",
        "task.result",
        "task.verdict",
        "task.diff",
        "check.run",
        "model.reply",
        "model.retry",
        "output.guard",
        "run.resume",
        "workspace.snapshot",
    )

    purpose: str
    task: str | None
    target: str
    member: str
    instance: int
    slot: int
    request: dict[str, Any]


class Usage(Part):
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None


class Remote(Part):
    """Where another tally daemon's record holds the call (`ledger_verify_remote` proves it)."""

    member: str
    seq: int
    checkpoint: int


class ModelReply(Body):
    """What came back. An error reply has text "", `usage` null and the error, no `sent`.
    `sent` is null when the pool sent exactly model.call's `request`, else what it did send
    minus messages (`safe`). `timings` are llama.cpp's, `*_ms` as `*_us`."""

    KIND: ClassVar[str] = "model.reply"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = ("model.call",)
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"sent", "remote"})

    text: str
    finish_reason: str | None
    usage: Usage | None
    timings: dict[str, int]
    member: str
    instance: int
    slot: int
    sent: dict[str, Any] | None = None
    error: str | None
    remote: Remote | None = None

    def tokens(self) -> int:
        """Prompt and completion tokens together (0 for an error or an unreported count)."""
        if self.usage is None:
            return 0
        return (self.usage.prompt_tokens or 0) + (self.usage.completion_tokens or 0)


class ModelRetry(Body):
    """A call lost to its server (died, hung, dropped mid-stream, no member up), sent again
    after `wait_ms` through a new lease of the same target: not a failed attempt of the task."""

    KIND: ClassVar[str] = "model.retry"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = (*ModelCall.PARENTS, "model.call")

    purpose: str
    task: str | None
    target: str
    member: str | None
    error: str
    lost: int
    retries: int
    wait_ms: int


class CommandRun(Body):
    """A `command` task ran in its sandbox. `limit` (only when one was hit) says which."""

    KIND: ClassVar[str] = "command.run"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = ("task.start",)
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"limit"})

    task: str
    argv: list[str]
    exit_code: int | None
    timed_out: bool
    stdout: str
    stderr: str
    truncated: bool
    duration_ms: int
    limit: str | None = None


class TaskResult(Body):
    """What the executor returned (`ok`: it finished), before the checks."""

    KIND: ClassVar[str] = "task.result"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = (
        "model.reply",
        "command.run",
        "task.start",
        "agent.step",
        "model.retry",
    )

    task: str
    attempt: int
    ok: bool
    output: str
    exit_code: int | None
    error: str | None


class Judge(Part):
    ok: bool
    reason: str


class TaskVerdict(Body):
    """The checks' verdict on an attempt and what follows: "done", "retry" (the same rung,
    failures as feedback), "escalate" or "failed"."""

    KIND: ClassVar[str] = "task.verdict"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = (
        "task.result",
        "task.diff",
        "check.run",
        "model.reply",
        "output.guard",
    )

    task: str
    attempt: int
    ok: bool
    failures: list[str]
    judge: Judge | None
    next: str


class TaskEscalate(Body):
    """A task climbs to the next tier of its lane's ladder after a failed attempt."""

    KIND: ClassVar[str] = "task.escalate"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = ("task.verdict",)

    task: str
    from_tier: str | None
    to_tier: str
    reason: str
    failures: list[str]


class TaskSkip(Body):
    """A dependency failed (policy on_task_failure = "continue")."""

    KIND: ClassVar[str] = "task.skip"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = ("run.plan",)

    task: str
    reason: str


class TaskReuse(Body):
    """A retried run takes a task the original run had done (`from_seq`: its done verdict)
    as done, with its output, and does not run it again."""

    KIND: ClassVar[str] = "task.reuse"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = ("run.plan",)

    task: str
    from_run: str
    from_seq: int | None
    output: str


class RunBudget(Body):
    """A limit was reached ("model_calls", "tokens" or "wall"); run.state budget_exhausted
    follows."""

    KIND: ClassVar[str] = "run.budget"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = ("run.request",)

    limit: str
    budget: Budget
    spent: Budget


class RunCancel(Body):
    """The run was cancelled (by a client, or because its daemon is stopping)."""

    KIND: ClassVar[str] = "run.cancel"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = ("run.request",)

    reason: str


class RunAnswer(Body):
    """The run's answer. Source "single", "synthesis" (`looped`: the summary was cut where it
    began to repeat itself), "results" (with `error`: why synthesis failed) or "partial" (a task
    failed; `error` says what; the done tasks' results are the answer still)."""

    KIND: ClassVar[str] = "run.answer"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = (
        "model.reply",
        "task.verdict",
        "task.reuse",
        "task.skip",
        "output.guard",
        "run.plan",
        "run.patch",
    )
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"looped", "error"})

    answer: str
    source: str
    looped: bool | None = None
    error: str | None = None


class RunIntent(Body):
    """How much of the request's key words the answer covers (witnessed; never blocks)."""

    KIND: ClassVar[str] = "run.intent"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = ("run.answer",)

    coverage_ppm: int
    keys: list[str]
    missing: list[str]


class RunState(Body):
    """The run ended: "done", "failed", "cancelled" or "budget_exhausted"."""

    KIND: ClassVar[str] = "run.state"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = (
        "run.answer",
        "run.intent",
        "run.budget",
        "run.cancel",
        "run.request",
        "run.patch",
    )

    state: str
    error: str | None


class RunInterrupted(Body):
    """The daemon stopped while the run was in flight (on a stop that could not drain, or by
    reconcile on start: actor "daemon"). `spent_wall_ms`: the wall time the run was driven
    (absent in older entries)."""

    KIND: ClassVar[str] = "run.interrupted"
    ACTORS: ClassVar[tuple[str, ...]] = ("engine", "daemon")
    PARENTS: ClassVar[tuple[str, ...]] = ("run.request",)

    reason: str
    previous: str
    spent_wall_ms: int | None = None


class RunResume(Body):
    """A run carries on after a restart. `stage` "route": routed (and planned) again;
    "dispatch": the plan stands and only the tasks in `redo` run. The budget carries over."""

    KIND: ClassVar[str] = "run.resume"
    ACTORS: ClassVar[tuple[str, ...]] = ENGINE
    PARENTS: ClassVar[tuple[str, ...]] = ("run.answer", "run.request", "run.interrupted")

    reused: list[str]
    redo: list[str]
    stage: Literal["route", "dispatch"]
    spent: Budget
