"""A run's progress as MCP notifications: what a client watching a long tool call is told."""

from __future__ import annotations

from typing import Any

from daemon.runs.state import TASK_ENDED
from daemon.tools.tool import RunOut


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
