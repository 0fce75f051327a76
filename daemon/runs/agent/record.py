"""The body of an `agent.step` entry: one model call of the loop and what its tool did.

The step's model call is witnessed by this entry alone (no `model.call` / `model.reply`):
the conversation is the task plus every step's reply and observation, all here, so a run's
record rebuilds it without storing the growing prompt again at each step. The observation is
a field of the body (and so redactable with it); `observation_sha256` says which text the
model saw even after a redaction. Ledger-safe: integers only, microseconds for times.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

Outcome = Literal[
    "ok",  # the tool ran and succeeded
    "error",  # the tool refused or failed; the observation says why, the loop goes on
    "malformed",  # no usable call in the reply: the observation is the nudge
    "finish_refused",  # finish while the checks fail: the observation is their output
    "finished",  # finish accepted
    "stuck",  # the same call a third time with nothing changed in between: the loop ends
]


class StepTokens(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: int = 0
    completion: int = 0
    cached: int = 0


class StepTimings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_us: int = 0
    """The model call, as tally waited for it (lease and request)."""
    tool_us: int = 0
    """The tool, checks included for a finish."""
    step_us: int = 0
    """The whole step up to its witness: compaction, the call, parsing, the tool. What is
    neither model nor tool (`step_us - model_us - tool_us`) is tally's own time."""
    server: dict[str, int] = {}
    """llama.cpp's own timings (`ledger_timings`: prompt_n, cache_n, prompt_us, …)."""


class AgentStep(BaseModel):
    """[the previous agent.step, or the caller's parent (task.start)]"""

    model_config = ConfigDict(extra="forbid")

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


EVENT_CHARS = 600
"""Characters of each free text of a step (its reply, its observation, each string argument)
that the live feed (SSE, and MCP progress through it) carries; the ledger has them whole."""
EVENT_ITEMS = 64


def step_event(body: Any) -> Any:
    """An `agent.step` body as the live feed carries it: every field, its texts cut to
    EVENT_CHARS (a `write_file` of 256 KiB is not sent to every watcher at each step), with
    `clipped` true when anything was cut (`ledger_entries` gives the whole step)."""
    if not isinstance(body, dict):
        return body
    cut = [False]

    def bound(value: Any) -> Any:
        if isinstance(value, str):
            if len(value) > EVENT_CHARS:
                cut[0] = True
                return value[: EVENT_CHARS - 1] + "…"
            return value
        if isinstance(value, list):
            if len(value) > EVENT_ITEMS:
                cut[0] = True
            return [bound(v) for v in value[:EVENT_ITEMS]]
        if isinstance(value, dict):
            if len(value) > EVENT_ITEMS:
                cut[0] = True
            return {k: bound(v) for k, v in list(value.items())[:EVENT_ITEMS]}
        return value

    shown = {
        key: bound(value) if key in ("reply", "observation", "arguments") else value
        for key, value in body.items()
    }
    shown["clipped"] = cut[0]
    return shown
