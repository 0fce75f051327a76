"""Reads off the event loop: a body's state is told apart (present, null, redacted, missing,
tampered, none), batches are read in one worker-thread hop, and the body table's lock is never
held while the writer waits for the disk."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from daemon.ledger import Ledger
from daemon.ledger import store as stores
from daemon.ledger.entry import Body


async def test_a_body_is_told_apart_by_its_state(state_dir: Path) -> None:
    async with await Ledger.open(state_dir) as ledger:
        kept = await ledger.append(actor="t", kind="note", body={"k": 1})
        null = await ledger.append(actor="t", kind="note", body=None)
        gone = await ledger.append(actor="t", kind="note", body={"secret": 2})
        changed = await ledger.append(actor="t", kind="note", body={"k": 3})
        await ledger.redact(gone.body or "", actor="admin", reason="pii")
        where = ledger.bodies.locate(bytes.fromhex(changed.body or ""))
        assert where is not None
        os.pwrite(ledger.bodies.pack, b"X", where[0] + stores.PACK_HEADER.size)
        bodies = await ledger.read_bodies(
            [kept.body, null.body, gone.body, changed.body, "ab" * 32, "not hex"]
        )
        assert bodies == [
            Body("present", {"k": 1}),
            Body("none"),
            Body("redacted"),
            Body("tampered"),
            Body("missing"),
            Body("missing"),
        ]
        assert await ledger.body(kept.body) == Body("present", {"k": 1})


async def test_a_json_null_body_is_present(state_dir: Path) -> None:
    async with await Ledger.open(state_dir) as ledger:
        # A body of JSON null has no hash (no body); a list holding null is a body.
        entry = await ledger.append(actor="t", kind="note", body=[None])
        assert await ledger.body(entry.body) == Body("present", [None])


async def test_a_batch_is_one_thread_hop(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with await Ledger.open(state_dir) as ledger:
        entries = [await ledger.append(actor="t", kind="note", body={"i": i}) for i in range(50)]
        hops = 0
        real = asyncio.to_thread

        async def counted(func: Any, /, *args: Any, **kwargs: Any) -> Any:
            nonlocal hops
            hops += 1
            return await real(func, *args, **kwargs)

        monkeypatch.setattr(asyncio, "to_thread", counted)
        bodies = await ledger.read_bodies([e.body for e in entries])
        assert hops == 1
        assert [b.value for b in bodies] == [{"i": i} for i in range(50)]
        loop_thread = threading.get_ident()
        seen: list[int] = []
        read = ledger.read_body

        def spy(body_hash: str | None) -> Body:
            seen.append(threading.get_ident())
            return read(body_hash)

        monkeypatch.setattr(ledger, "read_body", spy)
        await ledger.body(entries[0].body)
        await ledger.read_bodies([entries[1].body])
        assert seen
        assert loop_thread not in seen


def _lock_free(store: stores.BodyStore) -> bool:
    """Whether another thread could take the store's lock right now."""
    got: list[bool] = []

    def probe() -> None:
        taken = store.lock.acquire(timeout=1)
        got.append(taken)
        if taken:
            store.lock.release()

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return got[0]


async def test_the_table_grows_and_redaction_syncs_outside_the_lock(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with await Ledger.open(state_dir) as ledger:
        store = ledger.bodies
        held: list[bool] = []
        real_fsync = os.fsync

        def watched(fd: int) -> None:
            if fd in (store.pack, store.table) or fd > 2:
                held.append(not _lock_free(store))
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", watched)  # the module store.py calls it through
        slots = store.slots
        # Enough bodies to double the table once (it grows at half full).
        n = slots // 2 + 1
        batch = 512
        first = None
        for start in range(0, n, batch):
            done = await asyncio.gather(
                *(
                    ledger.append(actor="t", kind="note", body={"i": i})
                    for i in range(start, min(n, start + batch))
                )
            )
            first = first or done[0]
        assert store.slots > slots
        assert first is not None
        await ledger.redact(first.body or "", actor="admin", reason="gone")
        assert held
        assert not any(held)
        again = await ledger.read_bodies([first.body])
        assert again == [Body("redacted")]
