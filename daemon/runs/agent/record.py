"""The body of an `agent.step` entry: declared with the record's other kinds, in
`daemon.record.agent`, and named here for the loop."""

from __future__ import annotations

from typing import Any

from daemon.record.agent import AgentStep, Outcome, StepTimings, StepTokens

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


__all__ = [
    "EVENT_CHARS",
    "EVENT_ITEMS",
    "AgentStep",
    "Outcome",
    "StepTimings",
    "StepTokens",
    "step_event",
]
