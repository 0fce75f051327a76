"""The pool's options: the timing and bounds every member's servers run under.

Contract: one frozen `PoolOptions` is given to the pool at construction and shared, unchanged,
by every member, instance and queue for the pool's life (a roster reload changes members, not
these). The defaults suit a workstation; tests shrink the timings.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict


class PoolOptions(BaseModel):
    """Timing and bounds of the pool; the defaults suit a workstation."""

    model_config = ConfigDict(frozen=True)

    max_queue: int = 256  # waiting leases per member (a tier: × its members); one more: PoolBusy
    backoff_base_s: float = 0.5  # first restart delay, doubled per failure in the window
    backoff_max_s: float = 30.0
    cooldown_after: int = 3  # failures within failure_window_s that cool a member down
    failure_window_s: float = 60.0
    cooldown_s: float = 30.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    health_failures: int = 3  # consecutive failed health checks that mean "hung"
    # An unreachable external server is probed again after probe_base_s, doubling up to
    # probe_max_s, until it answers: the bound on how late a recovery is noticed.
    probe_base_s: float = 1.0
    probe_max_s: float = 15.0
    ready_poll_s: float = 0.05
    stop_grace_s: float = 5.0
    log_max_bytes: int = 16 * 2**20  # a running server's log is rotated past this size
    host: str = "127.0.0.1"
    roster_dir: Path | None = None  # relative model paths resolve against it
