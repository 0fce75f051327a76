"""The `agent.step` kind (actor "engine"): one model call of an agent loop and what its tool
did.

The step's model call is witnessed by this entry alone (no `model.call` / `model.reply`):
the conversation is the task plus every step's reply and observation, all here, so a run's
record rebuilds it without storing the growing prompt again at each step. The observation is
a field of the body (and so redactable with it); `observation_sha256` says which text the
model saw even after a redaction. Ledger-safe: integers only, microseconds for times.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from daemon.record.body import Body, Part

Outcome = Literal[
    "ok",  # the tool ran and succeeded
    "error",  # the tool refused or failed; the observation says why, the loop goes on
    "malformed",  # no usable call in the reply: the observation is the nudge
    "finish_refused",  # finish while the checks fail: the observation is their output
    "finished",  # finish accepted
    "stuck",  # the same call a third time with nothing changed in between: the loop ends
]


class StepTokens(Part):
    prompt: int = 0
    completion: int = 0
    cached: int = 0


class StepTimings(Part):
    model_us: int = 0
    """The model call, as tally waited for it (lease and request)."""
    tool_us: int = 0
    """The tool, checks included for a finish."""
    step_us: int = 0
    """The whole step up to its witness: compaction, the call, parsing, the tool. What is
    neither model nor tool (`step_us - model_us - tool_us`) is tally's own time."""
    server: dict[str, int] = Field(default_factory=dict)
    """llama.cpp's own timings (`ledger_timings`: prompt_n, cache_n, prompt_us, …)."""


class AgentStep(Body):
    """One step of an `agent` task's tool loop: one model call and what its tool did."""

    KIND: ClassVar[str] = "agent.step"
    ACTORS: ClassVar[tuple[str, ...]] = ("engine",)
    PARENTS: ClassVar[tuple[str, ...]] = ("agent.step", "task.start")

    task: str | None
    step: int
    """1-based; every model call of the loop is a step, a malformed reply included."""
    mode: Literal["native", "json"]
    tool: str | None
    """None when the reply held no usable call."""
    arguments: dict[str, Any]
    """The call's arguments as validated by the tool's input model ({} when malformed)."""
    parse: Literal["native", "parsed", "fenced", "object", "repaired", "malformed"]
    outcome: Outcome
    reply: str
    """The model's text (clipped), which is the call itself in json mode."""
    observation: str
    observation_sha256: str
    tokens: StepTokens
    timings: StepTimings
    member: str
    instance: int
    slot: int
    compacted: int = 0
    """Old messages cut to a stub before this step's call (context compaction)."""


class AgentCli(Body):
    """One call of an agent CLI member (`kind = "agent-cli"`) as a task's executor: the argv as
    configured (placeholders unexpanded: no prompt, no path, no environment value, only the
    names in `env`), its exit, duration, digests and bounded excerpts of its output, and the
    digest and paths of the view's diff. The task's result hangs off it."""

    KIND: ClassVar[str] = "agent.cli"
    ACTORS: ClassVar[tuple[str, ...]] = ("engine",)
    PARENTS: ClassVar[tuple[str, ...]] = ("task.start",)

    task: str
    attempt: int
    member: str
    argv: list[str]
    """As configured: placeholders such as `{prompt_file}` unexpanded."""
    prompt: Literal["stdin", "file", "arg"]
    prompt_sha256: str
    env: list[str]
    """The names of the variables passed from the daemon's environment (never their values)."""
    network: bool
    exit_code: int | None
    timed_out: bool
    limit: str | None
    duration_ms: int
    stdout_sha256: str
    stdout_chars: int
    stdout_head: str
    stderr_sha256: str
    stderr_tail: str
    truncated: bool
    """A stream passed `executors.OUTPUT_CAP` bytes: its digest is of the part kept."""
    diff_sha256: str | None
    """The view's changes (the `task.diff` body's `diff`); None when the task has no workspace
    or the diff could not be taken (`diff_error`)."""
    files: list[str]
    diff_error: str | None = None
