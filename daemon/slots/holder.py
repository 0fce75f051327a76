"""What a slot knows of the lease on it: `LeaseHolder`, the tenant told when the slot is lost.

Contract: a slot's server holds at most one lease per slot; when the server dies, hangs or is
stopped, it calls `lose(reason)` on that lease once, synchronously, before the slot is
forgotten, and never touches the lease again. The lease (`daemon.slots.lease`) is built on top
of slots and instances; this protocol is the only thing of it they see, so the modules below
the lease never import it.
"""

from __future__ import annotations

from typing import Protocol


class LeaseHolder(Protocol):
    def lose(self, reason: str) -> None:
        """The server under the slot died or hung: fail the lease's call in flight, if any."""
