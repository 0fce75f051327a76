"""Per-run budgets: model calls and tokens checked around every call, wall clock by timeout.

Calls are reserved before they are made, so parallel tasks cannot overshoot the call limit;
tokens are known only after a reply, so the token limit stops the run at the first reply
that crosses it. The wall clock is enforced by `lifecycle` with `asyncio.timeout`.
"""

from __future__ import annotations

from daemon.runs.state import Limits, Spent
from roster.models import Budget


class BudgetExhausted(Exception):
    def __init__(self, limit: str) -> None:
        super().__init__(f"budget exhausted: {limit}")
        self.limit = limit


def limits(budget: Budget | Limits | dict[str, object] | None, default: Budget) -> Limits:
    """Merge a client's budget over the roster's default, in ledger-safe integers."""
    if isinstance(budget, Limits):
        return budget
    base = default
    if isinstance(budget, Budget):
        base = budget
    elif isinstance(budget, dict):
        base = Budget.model_validate({**default.model_dump(), **budget})
    return Limits(
        model_calls=base.model_calls,
        tokens=base.tokens,
        wall_ms=None if base.wall_s is None else int(base.wall_s * 1000),
    )


class Meter:
    """Counts a run's calls (reserved) against its limits; spent tokens come from the view."""

    def __init__(self, limits: Limits, spent: Spent) -> None:
        self.limits = limits
        self.spent = spent
        self.reserved = spent.model_calls

    def reserve_call(self) -> None:
        if self.limits.model_calls is not None and self.reserved >= self.limits.model_calls:
            raise BudgetExhausted("model_calls")
        if self.limits.tokens is not None and self.spent.tokens >= self.limits.tokens:
            raise BudgetExhausted("tokens")
        self.reserved += 1

    def check_tokens(self) -> None:
        if self.limits.tokens is not None and self.spent.tokens >= self.limits.tokens:
            raise BudgetExhausted("tokens")

    def wall_s(self, elapsed_ms: int) -> float | None:
        if self.limits.wall_ms is None:
            return None
        return max(0.0, (self.limits.wall_ms - elapsed_ms) / 1000)
