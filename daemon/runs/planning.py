"""A run's plan: the task DAG it will dispatch (the step; the Plan model is `daemon.plans`).

Input: a routed run (lane, and the seq of its route or classify entry). Witnessed: one
`run.plan` (parent: that seq, or the coordinator's last reply) with the plan, its waves
(longest-path levels split by the run's `max_parallel`), its critical path and where it came
from: the client's plan ("client"), the coordinator model's ("coordinator", through the
structured-output guard, chat tasks only, checked against the roster's lanes), one task in the
routed lane ("single", no coordinator configured) or that same task because the coordinator
failed ("fallback", with its error). On a run with a workspace, the tasks tally plans
(not a client's) in a lane whose roster `agent` setting is on run as `agent` tasks.
Guarantees: the witnessed plan passes `check_plan`; budget exhaustion and cancellation are
never swallowed as a coordinator failure.
"""

from __future__ import annotations

import asyncio
from typing import Any

from daemon import record as rec
from daemon.plans import Plan, Task, check_plan
from daemon.runs import entries as k
from daemon.runs.budget import BudgetExhausted
from daemon.runs.calls import structured
from daemon.runs.context import Run, Setting, describe
from daemon.runs.dispatch import Node, levels
from daemon.runs.ports import LedgerReader
from daemon.runs.state import RunView


async def plan(s: Setting, run: Run, lane: str, parent: int) -> int:
    view = s.views[run.id]
    source, error = "single", None
    chosen: Plan | None = None
    if run.client_plan is not None:
        chosen = run.client_plan
        source = "client"
    elif s.coordinator is not None:
        try:
            chosen, parent = await _coordinate(s, run, lane, parent)
            source = "coordinator"
        except (BudgetExhausted, asyncio.CancelledError):
            raise
        except Exception as exc:
            source, error = "fallback", describe(exc)
    if chosen is None:
        chosen = Plan(tasks=[Task(id="t1", lane=lane, instruction=view.request)])
    if source != "client" and view.workspace is not None:
        chosen = _agents(s, chosen)
    nodes = [Node(t.id, t.lane, tuple(t.needs)) for t in chosen.tasks]
    waves = levels(nodes, view.max_parallel or s.roster.policy.max_parallel)
    body = rec.RunPlan(
        source=source,
        plan=k.safe(chosen.model_dump(mode="json", by_alias=True)),
        waves=waves,
        critical_path=_depth(nodes),
        error=error,
    )
    return await s.witness(run.id, body, parent)


async def requested_plan(ledger: LedgerReader, view: RunView) -> Plan | None:
    """The plan the client sent with the request, read back from its `run.request` entry
    (a run resumed before its plan was witnessed has nothing else to go by)."""
    entry = await ledger.entries(start=view.request_seq, limit=1, run=view.id)
    body = (await ledger.body(entry[0].body)).value if entry else None
    asked = rec.RunRequest.parsed(body)  # redacted, or not a request's: no plan to go by
    if asked is None or asked.plan is None:
        return None
    return Plan.model_validate(k.unsafe(asked.plan))


async def _coordinate(s: Setting, run: Run, lane: str, parent: int) -> tuple[Plan, int]:
    view = s.views[run.id]
    names = list(s.lanes)
    schema = {
        "type": "object",
        "properties": {
            "tasks": {
                "type": "array",
                "minItems": 1,
                "maxItems": 12,
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "lane": {"type": "string", "enum": names},
                        "instruction": {"type": "string"},
                        "needs": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["id", "lane", "instruction", "needs"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["tasks"],
        "additionalProperties": False,
    }
    messages = [
        {
            "role": "system",
            "content": "You split a request into a few tasks for specialist lanes. Each task "
            "has an id, a lane, an instruction and the ids of the tasks it needs. Reply with "
            'only JSON: {"tasks": [{"id": "t1", "lane": "...", "instruction": "...", '
            '"needs": []}]}. Lanes: ' + ", ".join(names) + ".",
        },
        {"role": "user", "content": f"Suggested lane: {lane}\n\nRequest:\n{view.request}"},
    ]

    def valid(value: Any) -> Plan:
        if not isinstance(value, dict):
            raise ValueError("the plan must be a JSON object with 'tasks'")
        tasks = value.get("tasks")
        if not isinstance(tasks, list):
            raise ValueError("the plan must have a 'tasks' list")
        # A model may only plan chat tasks: commands are for clients that declare them.
        made = Plan.model_validate(
            {
                "tasks": [
                    {
                        "id": t.get("id"),
                        "lane": t.get("lane"),
                        "instruction": t.get("instruction"),
                        "needs": t.get("needs", []),
                    }
                    for t in tasks
                    if isinstance(t, dict)
                ]
            }
        )
        check_plan(made, s.lanes)
        return made

    got = await structured(s, run, "plan", s.coordinator or "", messages, schema, valid, parent)
    return got.value, got.reply_seq or parent


def _agents(s: Setting, chosen: Plan) -> Plan:
    """A plan tally made, on a workspace: each task in a lane with `agent` on runs as an agent
    (it reads, edits and runs the tests itself) rather than answering with edits."""
    tasks = [
        t.model_copy(update={"executor": "agent"})
        if t.executor == "chat"
        and (lane := s.lanes.get(t.lane)) is not None
        and lane.agent != "off"
        else t
        for t in chosen.tasks
    ]
    return Plan(tasks=tasks)


def _depth(nodes: list[Node]) -> int:
    """The critical path's length in tasks."""
    by_id = {n.id: n for n in nodes}
    memo: dict[str, int] = {}

    def depth(node_id: str, seen: frozenset[str] = frozenset()) -> int:
        if node_id in memo:
            return memo[node_id]
        if node_id in seen or node_id not in by_id:
            return 0
        needs = [depth(n, seen | {node_id}) for n in by_id[node_id].needs]
        memo[node_id] = 1 + max(needs, default=0)
        return memo[node_id]

    return max((depth(n.id) for n in nodes), default=0)
