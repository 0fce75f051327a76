"""The pool's boundary records: events, chat results and status (pydantic)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

EventKind = Literal[
    "slot.starting",
    "slot.ready",
    "slot.exited",
    "slot.restarting",
    "slot.cooldown",
    "slot.cooldown_ended",
    "slot.unloaded",
    "slot.failed",
    "slot.lost",
    "slot.stopped",
    "slot.unhealthy",
    "slot.recovered",
    "slot.failover",
]

# Why a `slot.stopped` instance stopped (an idle unload has its own `slot.unloaded`).
StopReason = Literal["pool_stop", "cooldown", "retired"]


def _ledger_safe(value: Any, where: str) -> None:
    if value is None or isinstance(value, bool | str):
        return
    if isinstance(value, int):
        if abs(value) >= 2**53:
            raise ValueError(f"{where}: integer out of the ledger's range")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _ledger_safe(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: keys must be strings")
            _ledger_safe(item, f"{where}.{key}")
        return
    raise ValueError(f"{where}: {type(value).__name__} is not ledger-safe (no floats)")


class SlotEvent(BaseModel):
    """A state change of a member instance; `detail` holds only ledger-safe JSON (no floats)."""

    model_config = ConfigDict(frozen=True)

    kind: EventKind
    member: str
    instance: int
    port: int | None = None
    detail: dict[str, Any] = Field(default_factory=dict)

    @field_validator("detail")
    @classmethod
    def _no_floats(cls, value: dict[str, Any]) -> dict[str, Any]:
        _ledger_safe(value, "detail")
        return value


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class ChatResult(BaseModel):
    """One chat completion as the server returned it. `timings` is llama.cpp's, verbatim."""

    text: str
    finish_reason: str | None
    usage: Usage
    timings: dict[str, Any] = Field(default_factory=dict)
    member: str
    instance: int
    id_slot: int
    request: dict[str, Any]
    model: str | None = None
    remote: dict[str, int] | None = None
    """When the member is another tally daemon's gateway: its reply entry's `seq` and the size
    of its latest signed checkpoint (`checkpoint`), so the call can be proven in its ledger."""


# "unhealthy": an external server that does not answer; it is probed (with backoff), never
# restarted, and gets no leases until a probe finds it ready again.
InstanceState = Literal[
    "stopped", "starting", "ready", "backoff", "cooldown", "stopping", "unhealthy"
]


class InstanceStatus(BaseModel):
    index: int
    state: InstanceState
    port: int | None
    pid: int | None
    url: str | None
    slots_total: int
    slots_busy: int
    slots_idle: int
    n_ctx: int | None
    restarts: int
    last_error: str | None


class MemberStatus(BaseModel):
    name: str
    external: bool
    state: str
    queue: int
    max_queue: int
    leases: int
    restarts: int
    failures: int
    cooldown_remaining_ms: int
    last_error: str | None
    instances: list[InstanceStatus]
    healthy: bool = True
    """False while the member can take no lease: cooling down, or (external) unreachable."""
    unhealthy_ms: int = 0
    """How long an external member has been unreachable (0 while it answers)."""
    next_probe_ms: int | None = None
    """When an unreachable external member is probed next."""
    downs: int = 0
    """Times an external member became unreachable."""
    recoveries: int = 0
    """Times it answered again after that."""


class TierStatus(BaseModel):
    """A tier's shared queue: its waiters are served by whichever member frees a slot first
    (they are not in the members' `queue`, which counts leases aimed at that member)."""

    name: str
    members: list[str]
    queue: int
    max_queue: int
    healthy: list[str] = []
    """Members that can take a lease now (not cooling down, not unreachable)."""
    failovers: int = 0
    """Leases aimed at this tier that a higher rung served because no member here could."""
    in_flight_failovers: int = 0
    """Calls moved to another member of this tier after their own failed under them."""


class PoolStatus(BaseModel):
    members: list[MemberStatus]
    tiers: list[TierStatus] = []

    @property
    def queued(self) -> int:
        """Every waiting lease, member-targeted or tier-targeted."""
        return sum(m.queue for m in self.members) + sum(t.queue for t in self.tiers)

    def member(self, name: str) -> MemberStatus | None:
        return next((m for m in self.members if m.name == name), None)


def ledger_timings(raw: object) -> dict[str, int]:
    """llama.cpp's timings as ledger integers: `*_ms` durations become `*_us`, counts stay.

    Hashed bodies hold no floats; the per-token and per-second rates are dropped because they
    follow from the counts and durations.
    """
    out: dict[str, int] = {}
    for name, value in dict(raw or {}).items():  # type: ignore[call-overload]
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        if not -(2**43) < value < 2**43:  # NaN, infinities, and what no ledger integer holds
            continue
        name = str(name)
        if name.endswith(("_per_token_ms", "_per_second")):
            continue
        if name.endswith("_ms"):
            out[name[:-3] + "_us"] = round(value * 1000)
        else:
            out[name] = round(value)
    return out
