"""Per-client rate limits and token budgets: what a named client may spend, counted in memory.

A client's `Limits` (set with `tally client add NAME --rpm 60 --tpm 40000 --tokens-per-day
200000`) bound, over sliding windows:
- `rpm`: requests in the last 60 s. A gateway call (chat or embeddings) and a run's submit are
  one request each;
- `tpm`: tokens (prompt + completion) in the last 60 s;
- `tokens_per_day`: tokens in the last 24 hours (rolling, not a calendar day).

Tokens are known only once a call ends, so a request is admitted while its client's windows are
under their limits, and its tokens count when the server reports them (LiteLLM does the same):
one call may overshoot a token limit by its own size, never a second one. A run's tokens are its
model calls' (`model.reply` usage), counted as each reply is witnessed.

The windows are buckets (60 of a second, 1,440 of a minute), so a client costs a fixed ~12 KB
whatever its rate. A refusal says when the window will have room (`retry_after`, from the
buckets that must leave it). The day's usage survives a restart: `Daemon` rebuilds it from the
record's last 24 hours of replies when any client has a limit.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from daemon.clients import Client, Limits
from daemon.errors import Busy

MINUTE_S = 60.0
DAY_S = 86_400.0
WITNESS_EVERY_S = 60.0
"""A limit that keeps biting is witnessed once a minute per client and limit, not per refusal:
a client hammering past its limit must not turn into a flood of ledger entries."""


class RateLimited(Busy):
    """A client is over one of its limits; it may retry after `retry_after` seconds."""

    code = "rate_limited"
    status = 429


class _Window:
    """Counts over the last `len(counts)` buckets of `width` seconds, the newest open."""

    def __init__(self, buckets: int, width: float) -> None:
        self.counts = array("q", bytes(8 * buckets))
        self.width = width
        self.head: int | None = None  # the newest bucket's absolute number
        self.total = 0

    def _advance(self, now: float) -> None:
        bucket = int(now // self.width)
        if self.head is None:
            self.head = bucket
            return
        if bucket <= self.head:
            return  # the same bucket (or a clock that stepped back: keep counting in it)
        n = len(self.counts)
        for step in range(1, min(bucket - self.head, n) + 1):
            i = (self.head + step) % n
            self.total -= self.counts[i]
            self.counts[i] = 0
        self.head = bucket

    def add(self, now: float, amount: int) -> None:
        self._advance(now)
        assert self.head is not None
        self.counts[self.head % len(self.counts)] += amount
        self.total += amount

    def sum(self, now: float) -> int:
        self._advance(now)
        return self.total

    def wait(self, now: float, over: int) -> float:
        """Seconds until at least `over` of the counted amount has left the window."""
        self._advance(now)
        n = len(self.counts)
        if self.head is None:
            return 0.0
        freed = 0
        for age in range(n - 1, -1, -1):  # the oldest bucket first
            bucket = self.head - age
            freed += self.counts[bucket % n]
            if freed >= over:
                return max(0.0, (bucket + n) * self.width - now)  # when `bucket` drops out
        return n * self.width


@dataclass
class Usage:
    """One client's windows and what its limits refused."""

    requests: _Window = field(default_factory=lambda: _Window(60, 1.0))
    tokens: _Window = field(default_factory=lambda: _Window(60, 1.0))
    day: _Window = field(default_factory=lambda: _Window(1440, 60.0))
    refused: dict[str, int] = field(default_factory=dict)
    witnessed: dict[str, float] = field(default_factory=dict)


def _readable(seconds: float) -> str:
    """A day's budget says "retry after 86383.2 s": a person reads it as hours and minutes."""
    if seconds < 120:
        return ""
    minutes = int(seconds // 60)
    hours, minutes = divmod(minutes, 60)
    return f" (about {hours} h {minutes} min)" if hours else f" (about {minutes} min)"


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused: the limit, its value, what the window holds, when to retry."""

    client: str
    limit: str
    allowed: int
    used: int
    retry_after: float

    def message(self) -> str:
        window = "24 hours" if self.limit == "tokens_per_day" else "minute"
        unit = ("request" if self.limit == "rpm" else "token") + ("" if self.used == 1 else "s")
        return (
            f"client {self.client!r} is over its {self.limit} limit ({self.used} {unit} in the "
            f"last {window}, {self.allowed} allowed); retry after {self.retry_after:.1f} s"
            f"{_readable(self.retry_after)}"
        )

    def error(self) -> RateLimited:
        return RateLimited(
            self.message(),
            retry_after=self.retry_after,
            details={
                "client": self.client,
                "limit": self.limit,
                "allowed": self.allowed,
                "used": self.used,
                "retry_after_s": round(self.retry_after, 3),
            },
        )


class Quotas:
    """Every client's usage; `admit` before a request, `spend` when its tokens are known."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._usage: dict[str, Usage] = {}

    def usage(self, name: str) -> Usage:
        return self._usage.setdefault(name, Usage())

    def check(self, client: Client) -> Refusal | None:
        """The first limit this client is over right now (None: it may make a request)."""
        limits = client.limits
        if not limits.any():
            return None
        now = self.clock()
        usage = self.usage(client.name)
        return _over(client.name, limits, usage, now)

    def admit(self, client: Client) -> Refusal | None:
        """Count one request of `client` unless a limit refuses it (then the refusal)."""
        refusal = self.check(client)
        if refusal is not None:
            usage = self.usage(client.name)
            usage.refused[refusal.limit] = usage.refused.get(refusal.limit, 0) + 1
            return refusal
        self.usage(client.name).requests.add(self.clock(), 1)
        return None

    def spend(self, name: str, tokens: int, at: float | None = None) -> None:
        """Count `tokens` against `name`'s windows (at `at`, a Unix time; now by default)."""
        if tokens <= 0:
            return
        now = self.clock() if at is None else at
        usage = self.usage(name)
        usage.tokens.add(now, tokens)
        usage.day.add(now, tokens)

    def witness_due(self, refusal: Refusal) -> bool:
        """True once a minute per (client, limit): whether this refusal goes into the record."""
        usage = self.usage(refusal.client)
        now = self.clock()
        last = usage.witnessed.get(refusal.limit)
        if last is not None and now - last < WITNESS_EVERY_S:
            return False
        usage.witnessed[refusal.limit] = now
        return True

    def snapshot(self, name: str) -> dict[str, int]:
        """What `name` used: requests and tokens in the last minute, tokens in the last day."""
        now = self.clock()
        usage = self._usage.get(name)
        if usage is None:
            return {"requests_minute": 0, "tokens_minute": 0, "tokens_day": 0}
        return {
            "requests_minute": usage.requests.sum(now),
            "tokens_minute": usage.tokens.sum(now),
            "tokens_day": usage.day.sum(now),
        }

    def refused(self) -> dict[tuple[str, str], int]:
        """Refusals since the daemon started, by (client, limit)."""
        return {
            (name, limit): n
            for name, usage in sorted(self._usage.items())
            for limit, n in sorted(usage.refused.items())
        }


def _over(name: str, limits: Limits, usage: Usage, now: float) -> Refusal | None:
    checks = (
        ("rpm", limits.rpm, usage.requests),
        ("tpm", limits.tpm, usage.tokens),
        ("tokens_per_day", limits.tokens_per_day, usage.day),
    )
    for limit, allowed, window in checks:
        if allowed is None:
            continue
        used = window.sum(now)
        if used >= allowed:
            retry = window.wait(now, used - allowed + 1)
            return Refusal(name, limit, allowed, used, max(retry, 0.001))
    return None
