"""A run's answer: the done tasks' results combined into one `run.answer`.

Input: a run whose tasks have been dispatched (their outputs in `run.outputs`). Witnessed:
- one task done and a one-task plan: `run.answer` (source "single", parent: its verdict) with
  its output, no model call;
- otherwise a synthesis call in the run's lane (`model.call` / `model.reply`, streamed as
  deltas, at most SYNTHESIS_TOKENS) and `run.answer` (source "synthesis", parent: the reply):
  the short summary, cut where it began to repeat itself (`looped`), then every done task's
  result verbatim under its id and lane, so a poor summary never hides the work;
- a synthesis call that fails: `run.answer` (source "results", parent: the last verdict) with
  the results alone and the error.
- a run whose task failed (`partial`): `run.answer` (source "partial", parent: the last done
  verdict) with the done tasks' results and the failure, no model call, so a failed run still
  shows the work it did; the run then ends failed.
Returns the answer's seq. Budget exhaustion and cancellation propagate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from daemon import record as rec
from daemon.plans import Plan
from daemon.runs.budget import BudgetExhausted
from daemon.runs.calls import call
from daemon.runs.context import Run, Setting, describe
from daemon.runs.executors import upstream_block
from daemon.runs.repetition import cut_loop

SYNTHESIS_TOKENS = 320
"""The synthesis is a short summary above the task results, not a rewrite of them."""


async def synthesize(s: Setting, run: Run, plan: Plan) -> int:
    view = s.views[run.id]
    done = [t for t in view.tasks if t.state == "done"]
    last = max((t.verdict_seq or 0 for t in done), default=view.plan_seq or 0)
    if len(plan.tasks) == 1 and done:
        body = rec.RunAnswer(answer=run.outputs.get(done[0].id, ""), source="single")
        return await s.witness(run.id, body, done[0].verdict_seq or last)
    results = {t.id: run.outputs.get(t.id, "") for t in done}
    lane = s.lanes.get(view.lane or "") or s.roster.lanes[0]
    messages = [
        {
            "role": "system",
            "content": "Combine the task results below into a short answer to the request: "
            "a few sentences that answer it and say which task's result holds the "
            "details. The results follow your answer in full: do not repeat them.",
        },
        {
            "role": "user",
            "content": f"Request:\n{view.request}\n\n{upstream_block(results)}",
        },
    ]
    try:
        result, reply_seq = await call(
            s,
            run,
            purpose="synthesize",
            target=view.member or view.tier or lane.tier,
            messages=messages,
            parent=last,
            affinity=lane.name,
            stream=True,
            priority=0,
            max_tokens=SYNTHESIS_TOKENS,
        )
    except (BudgetExhausted, asyncio.CancelledError):
        raise
    except Exception as exc:  # the task results still answer the request
        answer = _with_results("", done, results)
        failed = rec.RunAnswer(answer=answer, source="results", error=describe(exc))
        return await s.witness(run.id, failed, last)
    summary, looped = await asyncio.to_thread(cut_loop, str(result.text))
    answered = rec.RunAnswer(
        answer=_with_results(summary, done, results), source="synthesis", looped=looped
    )
    return await s.witness(run.id, answered, reply_seq)


async def partial(s: Setting, run: Run, error: str) -> int | None:
    """Witness a failing run's partial answer: its done tasks' results (None: none is done)."""
    view = s.views[run.id]
    done = [t for t in view.tasks if t.state == "done"]
    if not done:
        return None
    last = max((t.verdict_seq or 0 for t in done), default=0) or view.plan_seq
    results = {t.id: run.outputs.get(t.id, t.result or "") for t in done}
    body = rec.RunAnswer(answer=_with_results("", done, results), source="partial", error=error)
    return await s.witness(run.id, body, last)


def _with_results(summary: str, done: list[Any], results: Mapping[str, str]) -> str:
    """The answer: the summary, then every task's result verbatim under its id and lane."""
    parts = [summary.strip()] if summary.strip() else []
    for task in done:
        parts.append(f"## {task.id} ({task.lane})\n\n{results.get(task.id, '').strip()}")
    return "\n\n".join(parts)
