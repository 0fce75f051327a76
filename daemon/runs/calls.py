"""Model calls: one witnessed, metered call through a slot lease, and structured calls on top.

`call` reserves a call against the run's budget before it leases (so parallel tasks cannot
overshoot `model_calls`), witnesses `model.call` with the exact request body the lease will
send before anything goes out, then `model.reply` (parent: the call) with the text, usage and
timings — or with the error and empty text when the call fails, before the error propagates.
Tokens are checked after the reply; crossing the limit raises `BudgetExhausted`.

`structured` asks for JSON matching a schema (`response_format`) through `guard.structured`,
witnessing one `output.guard` entry per attempt (parent: that attempt's reply); each retry's
call hangs off the previous guard entry, so the chain reads call → reply → guard → call → ….
"""

from __future__ import annotations

import asyncio
from typing import Any

from daemon.runs import entries as k
from daemon.runs import guard
from daemon.runs.context import Run, Setting, describe
from daemon.runs.ports import ChatReply
from daemon.slots.records import ledger_timings


async def call(
    s: Setting,
    run: Run,
    *,
    purpose: str,
    target: str,
    messages: list[dict[str, Any]],
    parent: int,
    task: str | None = None,
    affinity: str | None = None,
    response_format: dict[str, Any] | None = None,
    stream: bool = False,
    priority: int = 1,
    max_tokens: int | None = None,
) -> tuple[ChatReply, int]:
    """One witnessed, metered model call through a slot lease: (the reply, its seq)."""
    run.meter.reserve_call()
    max_tokens = min(max_tokens or s.options.max_tokens, s.options.max_tokens)
    on_delta = (lambda text: s.delta(run.id, text, task)) if stream else None
    leasing = s.pool.lease(target, priority=priority, affinity=affinity)
    async with s.waits.lease(run.id, task, leasing) as lease:  # `waiting` while it queues
        request = k.safe(lease.request(messages, max_tokens, response_format, stream=stream))
        call_body = {
            "purpose": purpose,
            "task": task,
            "target": target,
            "member": lease.member,
            "instance": lease.instance,
            "slot": lease.id_slot,
            "request": request,
        }
        call_seq = await s.witness(run.id, k.MODEL_CALL, call_body, parent)
        try:
            result = await lease.chat(
                messages,
                max_tokens=max_tokens,
                response_format=response_format,
                on_delta=on_delta,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            where = {"member": lease.member, "instance": lease.instance, "slot": lease.id_slot}
            await s.witness(
                run.id,
                k.MODEL_REPLY,
                {"text": "", "finish_reason": None, "usage": None, "timings": {}}
                | where
                | {"error": describe(exc)},
                call_seq,
            )
            raise
        # Read after the call: a tier's lease that moved a failed call names where it ran.
        where = {"member": lease.member, "instance": lease.instance, "slot": lease.id_slot}
        reply_seq = await s.witness(run.id, k.MODEL_REPLY, _reply(result, request, where), call_seq)
    run.meter.check_tokens()
    return result, reply_seq


def _reply(result: ChatReply, request: object, where: dict[str, Any]) -> dict[str, Any]:
    """The `model.reply` body of a reply that came back."""
    usage = result.usage
    # What went upstream, when the lease reports it (a relay adds the slot's fields).
    sent = k.safe(dict(getattr(result, "request", None) or {}))
    reply = {
        "text": result.text,
        "finish_reason": result.finish_reason,
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens,
        },
        "timings": ledger_timings(result.timings),
        "sent": _differs(request, sent),
        "error": None,
    } | where
    remote = getattr(result, "remote", None)
    if remote is not None:  # another tally daemon served it: where its record has it
        reply["remote"] = {"member": where["member"], **remote}
    return reply


async def structured(
    s: Setting,
    run: Run,
    purpose: str,
    target: str,
    messages: list[dict[str, Any]],
    schema: dict[str, Any],
    validate: Any,
    parent: int,
) -> guard.Guarded[Any]:
    """A call whose reply must be JSON that `validate` accepts, retried with a nudge."""
    last_parent = parent

    async def ask(history: list[dict[str, Any]], attempt: int) -> tuple[str, int | None]:
        result, seq = await call(
            s,
            run,
            purpose=purpose,
            target=target,
            messages=history,
            parent=last_parent,
            response_format=guard.response_format(purpose, schema),
            priority=0,
        )
        return str(result.text), seq

    async def witness(attempt: guard.Attempt) -> None:
        nonlocal last_parent
        body = {
            "purpose": attempt.purpose,
            "attempt": attempt.attempt,
            "outcome": attempt.outcome,
            "error": attempt.error,
        }
        last_parent = await s.witness(run.id, k.GUARD, body, attempt.reply_seq or last_parent)

    return await guard.structured(
        purpose,
        messages,
        ask,
        validate,
        attempts=s.options.guard_attempts,
        on_attempt=witness,
    )


def _differs(witnessed: object, sent: object) -> object:
    """None when the pool sent what model.call witnessed (or did not say what it sent), else
    the body it did send minus its messages, so the ledger never hides a parameter."""
    if not isinstance(sent, dict) or not sent or not isinstance(witnessed, dict):
        return None
    if sent == witnessed:
        return None
    return {key: value for key, value in sent.items() if key != "messages"}
