"""The kinds the pool writes (actor "pool"): a member instance's state changes.

Each body is the pool's `SlotEvent` (`daemon.slots.records`): its `kind` again, the member, the
instance index, its port (null for an external server) and a `detail` object whose fields
depend on the event (ledger-safe JSON; see each kind). No run, no parent.
"""

from __future__ import annotations

from typing import Any, ClassVar

from daemon.record.body import Body


class SlotBody(Body):
    """What every slot entry holds; `kind` repeats the entry's kind."""

    ACTORS: ClassVar[tuple[str, ...]] = ("pool",)

    kind: str
    member: str
    instance: int
    port: int | None
    detail: dict[str, Any]


class SlotStarting(SlotBody):
    """An instance is starting (spawned) or first probed (external)."""

    KIND: ClassVar[str] = "slot.starting"


class SlotReady(SlotBody):
    """An instance answers its health check and takes leases."""

    KIND: ClassVar[str] = "slot.ready"


class SlotExited(SlotBody):
    """A spawned server exited (its return code and log tail in `detail`)."""

    KIND: ClassVar[str] = "slot.exited"


class SlotRestarting(SlotBody):
    """A spawned server is started again after `delay_ms`."""

    KIND: ClassVar[str] = "slot.restarting"


class SlotCooldown(SlotBody):
    """A member failed too often: no leases until its cooldown ends."""

    KIND: ClassVar[str] = "slot.cooldown"


class SlotCooldownEnded(SlotBody):
    """A member's cooldown ended."""

    KIND: ClassVar[str] = "slot.cooldown_ended"


class SlotUnloaded(SlotBody):
    """An idle instance was stopped to free its memory."""

    KIND: ClassVar[str] = "slot.unloaded"


class SlotFailed(SlotBody):
    """An instance could not be started (or restarted) and is given up."""

    KIND: ClassVar[str] = "slot.failed"


class SlotLost(SlotBody):
    """A call failed in flight under an instance (`leases` lost with it)."""

    KIND: ClassVar[str] = "slot.lost"


class SlotStopped(SlotBody):
    """An instance stopped (`reason`: pool_stop, cooldown or retired)."""

    KIND: ClassVar[str] = "slot.stopped"


class SlotUnhealthy(SlotBody):
    """An external server stopped answering: probed with backoff, no leases."""

    KIND: ClassVar[str] = "slot.unhealthy"


class SlotRecovered(SlotBody):
    """An unreachable external server answers again."""

    KIND: ClassVar[str] = "slot.recovered"


class SlotFailover(SlotBody):
    """A call moved to another member of its tier after its own failed."""

    KIND: ClassVar[str] = "slot.failover"


SLOT_KINDS: tuple[type[SlotBody], ...] = (
    SlotStarting,
    SlotReady,
    SlotExited,
    SlotRestarting,
    SlotCooldown,
    SlotCooldownEnded,
    SlotUnloaded,
    SlotFailed,
    SlotLost,
    SlotStopped,
    SlotUnhealthy,
    SlotRecovered,
    SlotFailover,
)


def slot_body(event: dict[str, Any]) -> SlotBody:
    """The entry body of a pool event (`SlotEvent.model_dump`): its kind's model."""
    kind = event.get("kind")
    model = next((m for m in SLOT_KINDS if kind == m.KIND), None)
    if model is None:
        raise ValueError(f"{kind!r} is not a slot kind of the record (daemon.record.slots)")
    return model(**event)
