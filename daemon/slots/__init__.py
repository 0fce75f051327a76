"""The slot pool of local model servers: processes, leases, faults, the chat client."""

from daemon.slots.errors import (
    ModelError,
    NoHealthyMember,
    NoSuchTarget,
    PoolBusy,
    PoolTimeout,
    ServerStartError,
    SlotLost,
)
from daemon.slots.lease import Lease
from daemon.slots.options import PoolOptions
from daemon.slots.pool import Pool
from daemon.slots.records import (
    ChatResult,
    InstanceStatus,
    MemberStatus,
    PoolStatus,
    SlotEvent,
    TierStatus,
    Usage,
)

__all__ = [
    "ChatResult",
    "InstanceStatus",
    "Lease",
    "MemberStatus",
    "ModelError",
    "NoHealthyMember",
    "NoSuchTarget",
    "Pool",
    "PoolBusy",
    "PoolOptions",
    "PoolStatus",
    "PoolTimeout",
    "ServerStartError",
    "SlotEvent",
    "SlotLost",
    "TierStatus",
    "Usage",
]
