"""The pool's options: the timing and bounds every member's servers run under.

Contract: one frozen `PoolOptions` is given to the pool at construction and shared, unchanged,
by every member, instance and queue for the pool's life (a roster reload changes members, not
these). The defaults suit a workstation; tests shrink the timings.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class PoolOptions(BaseModel):
    """Timing and bounds of the pool; the defaults suit a workstation."""

    # Bounds: a zero or negative timing would spin a loop or never wait; checked once here.
    model_config = ConfigDict(frozen=True)

    max_queue: int = Field(
        default=256, ge=1
    )  # waiting leases per member (a tier: × its members); one more: PoolBusy
    backoff_base_s: float = Field(
        default=0.5, gt=0
    )  # first restart delay, doubled per failure in the window
    backoff_max_s: float = Field(default=30.0, gt=0)
    cooldown_after: int = Field(
        default=3, ge=1
    )  # failures within failure_window_s that cool a member down
    failure_window_s: float = Field(default=60.0, gt=0)
    cooldown_s: float = Field(default=30.0, ge=0)
    health_interval_s: float = Field(default=2.0, gt=0)
    health_timeout_s: float = Field(default=5.0, gt=0)
    health_failures: int = Field(
        default=3, ge=1
    )  # consecutive failed health checks that mean "hung"
    # An unreachable external server is probed again after probe_base_s, doubling up to
    # probe_max_s, until it answers: the bound on how late a recovery is noticed.
    probe_base_s: float = Field(default=1.0, gt=0)
    probe_max_s: float = Field(default=15.0, gt=0)
    ready_poll_s: float = Field(default=0.05, gt=0)
    stop_grace_s: float = Field(default=5.0, ge=0)
    log_max_bytes: int = Field(
        default=16 * 2**20, ge=4096
    )  # a running server's log is rotated past this size
    host: str = "127.0.0.1"
    roster_dir: Path | None = None  # relative model paths resolve against it
