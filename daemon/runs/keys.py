"""Idempotency keys: which run an `Idempotency-Key` names, bounded in time and in number.

A key is claimed (a future) before its run's request is witnessed and resolved with the run
id once it is, so a second submit with the same key waits for the first instead of starting
another run; a failed witness forgets the key. A key lives `ttl_s` and at most `limit` are
kept, the oldest forgotten first.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict


class Keys:
    def __init__(self, ttl_s: float, limit: int) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        # key -> (its run id, once witnessed; when it was made, wall-clock s), oldest first
        self._keys: OrderedDict[str, tuple[asyncio.Future[str], float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def get(self, key: str | None) -> asyncio.Future[str] | None:
        """The run a key names, unless it is unknown or past its TTL."""
        if key is None or (found := self._keys.get(key)) is None:
            return None
        if time.time() - found[1] > self.ttl_s:
            del self._keys[key]
            return None
        return found[0]

    def remember(self, key: str, run: asyncio.Future[str], at: float) -> None:
        self._keys[key] = (run, at)
        self._keys.move_to_end(key)
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def forget(self, key: str) -> None:
        self._keys.pop(key, None)
