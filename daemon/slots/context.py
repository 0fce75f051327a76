"""What every member shares with the pool: the options, one chat session, the event sink.

Contract: one `PoolContext` per pool, created by the pool and handed down to its members and
their instances and queues; nothing in it belongs to a single member. `background` tasks are
owned here so the pool can cancel them all when it stops; `arrivals` numbers waiters pool-wide
so FIFO order holds across queues.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.slots.chat import ChatClient
from daemon.slots.digest import DigestCache
from daemon.slots.options import PoolOptions
from daemon.slots.records import SlotEvent


@dataclass
class PoolContext:
    """What members share with the pool: options, the chat session, events, tasks."""

    options: PoolOptions
    state_dir: Path
    client: ChatClient
    emit: Callable[[SlotEvent], Awaitable[None]]
    digests: DigestCache
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    arrivals: Iterator[int] = field(default_factory=itertools.count)

    def background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
