"""Model calls: one witnessed, metered call through a slot lease, and structured calls on top.

`call` reserves a call against the run's budget before it leases (so parallel tasks cannot
overshoot `model_calls`), witnesses `model.call` with the exact request body the lease will
send before anything goes out, then `model.reply` (parent: the call) with the text, usage and
timings — or with the error and empty text when the call fails, before the error propagates.
Tokens are checked after the reply; crossing the limit raises `BudgetExhausted`.

A call lost to its server (it died, hung or dropped the connection mid-stream: `SlotLost`; no
member of the target can serve right now:
`NoHealthyMember`, once a try of the call was lost: a call whose first lease finds no member
fails at once, as the pool explains it; none came back in time: `PoolTimeout`) is not the
model's failure: `call`
witnesses `model.retry` (parent: the lost call's reply, or the call's parent when nothing was
sent) with why and how long it waits, and sends the call again through a new lease of the same
target: the same member once it is back, another member of the tier, or (when none of the
tier can serve) the next rung, as the pool decides. At most `lost_call_retries` times, each
lease waiting at most `lost_call_wait_s`; then the call fails with a `SlotLost` that names
the members and what to do. The attempt that made the call stays one attempt.

`structured` asks for JSON matching a schema (`response_format`) through `guard.structured`,
witnessing one `output.guard` entry per attempt (parent: that attempt's reply); each retry's
call hangs off the previous guard entry, so the chain reads call → reply → guard → call → ….
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from daemon import record as rec
from daemon.errors import TallyError
from daemon.runs import entries as k
from daemon.runs import guard
from daemon.runs.context import Run, Setting, describe
from daemon.runs.ports import ChatReply
from daemon.slots.errors import NoHealthyMember, PoolTimeout, SlotLost
from daemon.slots.records import ledger_timings

LOST_WAIT_FIRST_S = 0.5
"""The first pause before a lost call is sent again; each later one doubles (capped)."""
LOST_WAIT_CAP_S = 8.0


class _Lost(Exception):
    """One try of a call lost to its server: why, where, and the seq the retry hangs off."""

    def __init__(self, error: Exception, member: str | None, seq: int | None) -> None:
        super().__init__(str(error))
        self.error = error
        self.member = member
        self.seq = seq


def _lost(exc: Exception) -> bool:
    """The server went away under the call (or none is back yet): sending it again may work.
    A server that answered with an error status (`ModelError`) did answer: that is a failed
    attempt, whose error the next attempt is told (and a tier's lease moved it already)."""
    return isinstance(exc, SlotLost | NoHealthyMember | PoolTimeout)


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
    """One witnessed, metered model call through a slot lease: (the reply, its seq).

    A try lost to its server is sent again (module doc), bounded."""
    lost: list[_Lost] = []
    deadline: float | None = None  # the first lease waits as any does; a resend, bounded
    while True:
        try:
            return await _once(
                s,
                run,
                purpose=purpose,
                target=target,
                messages=messages,
                parent=parent,
                task=task,
                affinity=affinity,
                response_format=response_format,
                stream=stream,
                priority=priority,
                max_tokens=max_tokens,
                deadline=deadline,
            )
        except _Lost as exc:
            if not lost and exc.seq is None:
                # No member could take the call before any was lost: the pool already climbed
                # the ladder and names each member; a run does not wait on servers known down.
                raise _what_to_do(run, exc.error) from None
            lost.append(exc)
            if len(lost) > s.options.lost_call_retries:
                raise _given_up(run, target, lost) from exc.error
            wait_s = min(LOST_WAIT_FIRST_S * 2 ** (len(lost) - 1), LOST_WAIT_CAP_S)
            retry_after = getattr(exc.error, "retry_after", None)
            if isinstance(exc.error, NoHealthyMember) and isinstance(retry_after, int | float):
                # Until the pool's next probe nothing changes; but never past the cap.
                wait_s = min(max(wait_s, float(retry_after)), LOST_WAIT_CAP_S)
            body = rec.ModelRetry(
                purpose=purpose,
                task=task,
                target=target,
                member=exc.member,
                error=describe(exc.error),
                lost=len(lost),
                retries=s.options.lost_call_retries,
                wait_ms=int(wait_s * 1000),
            )
            parent = await s.witness(run.id, body, exc.seq or parent)
            await asyncio.sleep(wait_s)
            deadline = time.monotonic() + s.options.lost_call_wait_s


def _what_to_do(run: Run, error: Exception) -> Exception:
    """The pool's own words on why no member could serve, and what the user can do about it."""
    if isinstance(error, TallyError) and "tally retry" not in error.message:
        error.message += (
            f"; check the members' servers (`tally slots`, `tally doctor`), then "
            f"`tally retry {run.id}`"
        )
        error.args = (error.message,)
    return error


def _given_up(run: Run, target: str, lost: list[_Lost]) -> SlotLost:
    """What the user sees when a call stayed lost: the members, what to do, then each
    member's reason, short (the replies and `model.retry` entries hold them in full)."""
    reasons: dict[str, str] = {}
    for x in lost:
        named = getattr(x.error, "details", None)
        named = named.get("members") if isinstance(named, dict) else None
        if isinstance(x.error, SlotLost) and isinstance(named, dict):
            reasons |= {str(m): f"failed in flight: {why}" for m, why in named.items()}
        elif isinstance(named, dict):  # no member could serve: each one's state
            reasons |= {str(m): str(why) for m, why in named.items() if str(m) not in reasons}
        elif x.member is not None:
            reasons[x.member] = f"failed in flight: {getattr(x.error, 'message', x.error)}"
    where = ", ".join(reasons) or f"no member of {target!r}"
    why = "; ".join(f"{m} {' '.join(r.split())[:100]}" for m, r in reasons.items())
    return SlotLost(
        f"the model call was lost {len(lost)} times on {where}: check its server "
        f"(`tally slots`, `tally doctor`), then `tally retry {run.id}`. {why}",
        details={"target": target, "members": reasons, "lost": len(lost)},
    )


async def _once(
    s: Setting,
    run: Run,
    *,
    purpose: str,
    target: str,
    messages: list[dict[str, Any]],
    parent: int,
    task: str | None,
    affinity: str | None,
    response_format: dict[str, Any] | None,
    stream: bool,
    priority: int,
    max_tokens: int | None,
    deadline: float | None,
) -> tuple[ChatReply, int]:
    """One try: lease, witness model.call, send, witness model.reply. A loss raises `_Lost`."""
    run.meter.reserve_call()
    max_tokens = min(max_tokens or s.options.max_tokens, s.options.max_tokens)
    on_delta = (lambda text: s.delta(run.id, text, task)) if stream else None
    sent = False
    try:
        leasing = s.pool.lease(target, priority=priority, deadline=deadline, affinity=affinity)
        async with s.waits.lease(run.id, task, leasing) as lease:  # `waiting` while it queues
            request = k.safe(lease.request(messages, max_tokens, response_format, stream=stream))
            call_body = rec.ModelCall(
                purpose=purpose,
                task=task,
                target=target,
                member=lease.member,
                instance=lease.instance,
                slot=lease.id_slot,
                request=request,
            )
            call_seq = await s.witness(run.id, call_body, parent)
            sent = True
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
                error = rec.ModelReply(
                    text="",
                    finish_reason=None,
                    usage=None,
                    timings={},
                    member=lease.member,
                    instance=lease.instance,
                    slot=lease.id_slot,
                    error=describe(exc),
                )
                reply_seq = await s.witness(run.id, error, call_seq)
                if _lost(exc):
                    raise _Lost(exc, lease.member, reply_seq) from exc
                raise
            # Read after the call: a tier's lease that moved a failed call names where it ran.
            where = {"member": lease.member, "instance": lease.instance, "slot": lease.id_slot}
            reply_seq = await s.witness(run.id, _reply(result, request, where), call_seq)
    except (NoHealthyMember, PoolTimeout) as exc:
        if sent:
            raise
        run.meter.reserved -= 1  # nothing was sent: the reservation is not a call
        raise _Lost(exc, None, None) from exc
    run.meter.check_tokens()
    return result, reply_seq


def _reply(result: ChatReply, request: object, where: dict[str, Any]) -> rec.ModelReply:
    """The `model.reply` body of a reply that came back."""
    usage = result.usage
    # What went upstream, when the lease reports it (a relay adds the slot's fields).
    sent = k.safe(dict(getattr(result, "request", None) or {}))
    reply = rec.ModelReply(
        text=result.text,
        finish_reason=result.finish_reason,
        usage=rec.Usage(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
        ),
        timings=ledger_timings(result.timings),
        sent=_differs(request, sent),
        error=None,
        **where,
    )
    remote = getattr(result, "remote", None)
    if remote is not None:  # only then: another tally daemon served it, and where its record has it
        reply.remote = rec.Remote(member=where["member"], **remote)
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
        body = rec.OutputGuard(
            purpose=attempt.purpose,
            attempt=attempt.attempt,
            outcome=attempt.outcome,
            error=attempt.error,
        )
        last_parent = await s.witness(run.id, body, attempt.reply_seq or last_parent)

    return await guard.structured(
        purpose,
        messages,
        ask,
        validate,
        attempts=s.options.guard_attempts,
        on_attempt=witness,
    )


def _differs(witnessed: object, sent: object) -> dict[str, Any] | None:
    """None when the pool sent what model.call witnessed (or did not say what it sent), else
    the body it did send minus its messages, so the ledger never hides a parameter."""
    if not isinstance(sent, dict) or not sent or not isinstance(witnessed, dict):
        return None
    if sent == witnessed:
        return None
    return {key: value for key, value in sent.items() if key != "messages"}
