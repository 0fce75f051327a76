"""The body of an `agent.step` entry: declared with the record's other kinds, in
`daemon.record.agent`, and named here for the loop."""

from __future__ import annotations

from daemon.record.agent import AgentStep, Outcome, StepTimings, StepTokens

__all__ = ["AgentStep", "Outcome", "StepTimings", "StepTokens"]
