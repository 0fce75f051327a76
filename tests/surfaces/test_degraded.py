"""A ledger that cannot write says so: `degraded` with the reason in /healthz and `health`, a
gauge in /metrics; a checkpoint that cannot be written is a mapped 503, not a 500.

Faults are injected where the disk would raise them (the ledger's fsync, the checkpoint
write), with a real daemon over a real unix socket."""

from __future__ import annotations

import errno
import os
from typing import Any

import aiohttp
import pytest

import daemon.ledger.log as ledger_log
from daemon.service import Daemon


def _full(*_: Any, **__: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


async def test_checkpoint_on_a_full_disk_is_a_mapped_503(
    daemon: Daemon, unix_session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ledger_log, "save_checkpoint", _full)
    async with unix_session.post(
        "http://tally/v1/tools/ledger_checkpoint", json={"create": True}
    ) as resp:
        assert resp.status == 503
        body = await resp.json()
    assert body["error"]["code"] == "checkpoint_unwritable"
    assert "No space left" in body["error"]["message"]
    async with unix_session.get("http://tally/healthz") as resp:
        assert (await resp.json())["status"] == "ok"  # the record itself is fine


async def test_a_ledger_that_cannot_write_reports_degraded(
    daemon: Daemon, unix_session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "fsync", _full)  # the ledger writer thread's fsync
    async with unix_session.post("http://tally/v1/tools/route", json={"text": "x"}) as resp:
        assert resp.status == 503  # the witnessed preview cannot be written
    async with unix_session.get("http://tally/healthz") as resp:
        health = await resp.json()
    assert health["status"] == "degraded"
    assert "No space left" in health["reason"]
    async with unix_session.post("http://tally/v1/tools/health", json={}) as resp:
        tool = await resp.json()
    assert tool["status"] == "degraded"
    assert "No space left" in tool["reason"]
    async with unix_session.get("http://tally/metrics") as resp:
        assert "tally_ledger_writable 0" in await resp.text()
