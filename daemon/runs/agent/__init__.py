"""The `agent` executor: a bounded tool-calling loop over a task's view, with guardrails.

`run_agent` is the entry point the engine calls; `sandboxed` makes the `run` tool's runner
from the command executor's sandbox; `native_supported` reads a member's `/props`. The parts:
`paths` (what a tool may touch), `toolbox` (the tools), `calls` (asking for a call and reading
it back), `conversation` (the messages inside `n_ctx`), `record` (the `agent.step` body),
`loop` (the steps and guardrails); `executor` runs it as one attempt of a task with
`"executor": "agent"` (imported by `attempts` directly: it needs the engine's `Setting`).

It lives under `daemon.runs` because it is one of the runs engine's executors: it uses the
engine's sandbox and entry kinds, and `attempts` imports it without an import cycle.
"""

from daemon.runs.agent.calls import Mode, native_supported
from daemon.runs.agent.loop import (
    AgentLimits,
    AgentResult,
    Checks,
    LeaseFactory,
    StepWitness,
    run_agent,
    sandboxed,
)
from daemon.runs.agent.paths import DEFAULT_HIDDEN, Jail, PathRefused
from daemon.runs.agent.record import AgentStep
from daemon.runs.agent.toolbox import TOOLS, ToolLimits

__all__ = [
    "DEFAULT_HIDDEN",
    "TOOLS",
    "AgentLimits",
    "AgentResult",
    "AgentStep",
    "Checks",
    "Jail",
    "LeaseFactory",
    "Mode",
    "PathRefused",
    "StepWitness",
    "ToolLimits",
    "native_supported",
    "run_agent",
    "sandboxed",
]
