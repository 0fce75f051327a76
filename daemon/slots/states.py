"""The states of a server instance and the one table of the changes between them.

An instance changes state only through `Instance.enter`, which checks the change here first
(as llama-swap checks each change through one `isValidTransition`):

    stopped   -> starting                      ensure_running
    starting  -> ready                         a spawned server answered /health and /props;
                                               an external one answered
    starting  -> backoff | cooldown            a start failed (the member's failure policy)
    starting  -> unhealthy                     an external server did not answer its first probe
    ready     -> backoff | cooldown            a spawned server exited, hung or was reported
    ready     -> unhealthy                     an external server stopped answering
    unhealthy -> ready                         it answers again
    backoff   -> starting                      the delay is over
    cooldown  -> starting                      the member's cooldown is over (a start asked)
    cooldown  -> stopped                       the cooldown is over (`Member._cooled`)
    any       -> stopping                      `stop` (pool stop, cooldown, retirement), unload
    stopping  -> stopped | cooldown            the server is gone

Staying in a state is no change (the spawned loop re-enters `starting`). Any other change is a
bug in the lifecycle code, not a condition of the world: a test must fail on it, so under the
test suite (`STRICT`, set by tests/conftest.py) it raises `IllegalTransition`. In production it
is logged at ERROR with its stack and then made anyway: the caller has already acted on the
world (killed the process, started one), and a state that disagrees with the process would be
worse than an unlisted edge; the log line is the evidence to fix the table or the caller.
Legal changes are logged at DEBUG (the slot events the instance emits witness the ones that
matter to a reader of the ledger: ready, exited, unhealthy, stopped...).
"""

from __future__ import annotations

import logging
from typing import Final

from daemon.slots.records import InstanceState

log = logging.getLogger("tally.slots")

STATES: Final[tuple[InstanceState, ...]] = (
    "stopped",
    "starting",
    "ready",
    "backoff",
    "cooldown",
    "stopping",
    "unhealthy",
)

TRANSITIONS: Final[dict[InstanceState, frozenset[InstanceState]]] = {
    "stopped": frozenset({"starting", "stopping"}),
    "starting": frozenset({"ready", "backoff", "cooldown", "unhealthy", "stopping"}),
    "ready": frozenset({"backoff", "cooldown", "unhealthy", "stopping"}),
    "unhealthy": frozenset({"ready", "stopping"}),
    "backoff": frozenset({"starting", "stopping"}),
    "cooldown": frozenset({"starting", "stopped", "stopping"}),
    "stopping": frozenset({"stopped", "cooldown"}),
}

STRICT = False
"""Raise on an illegal change instead of logging it (the test suite sets it)."""


class IllegalTransition(RuntimeError):
    def __init__(self, who: str, old: InstanceState, new: InstanceState) -> None:
        super().__init__(f"{who}: illegal state change {old} -> {new}")
        self.old, self.new = old, new


def legal(old: InstanceState, new: InstanceState) -> bool:
    return old == new or new in TRANSITIONS[old]


def check(who: str, old: InstanceState, new: InstanceState) -> None:
    """Refuse (STRICT) or log loudly an illegal change; log a legal one at DEBUG."""
    if old == new:
        return
    if new in TRANSITIONS[old]:
        log.debug("%s: %s -> %s", who, old, new)
        return
    if STRICT:
        raise IllegalTransition(who, old, new)
    log.error("%s: illegal state change %s -> %s (made anyway)", who, old, new, stack_info=True)
