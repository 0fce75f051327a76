"""One checkpoint timer, driven by the daemon's `checkpoint_interval_s`; nothing is re-signed
while the tree has not grown."""

from __future__ import annotations

import asyncio
from pathlib import Path

from daemon.ledger import Ledger
from daemon.service import Daemon
from tests.runs.model_server import roster_toml, settings_for


async def _grown(ledger: Ledger, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while (cp := ledger.latest_checkpoint()) is None or cp.size != ledger.size:
            await asyncio.sleep(0.01)


async def test_the_timer_signs_growth_once_and_never_an_unchanged_tree(tmp_path: Path) -> None:
    ledger = await Ledger.open(tmp_path, checkpoint_interval=0.05)
    try:
        await ledger.append(actor="t", kind="k", body={"n": 1})
        await _grown(ledger)
        signed = ledger.latest_checkpoint()
        assert signed is not None
        await asyncio.sleep(0.3)  # six periods, no growth
        assert ledger.latest_checkpoint() is signed
        assert signed.note == (tmp_path / "ledger" / "checkpoint").read_text()
        await ledger.append(actor="t", kind="k", body={"n": 2})
        await _grown(ledger)
        again = ledger.latest_checkpoint()
        assert again is not None
        assert again.size == signed.size + 1
    finally:
        await ledger.close()


async def test_the_daemon_checkpoints_at_its_setting(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, roster_toml("http://127.0.0.1:9/v1"))
    daemon = Daemon(settings.model_copy(update={"checkpoint_interval_s": 0.05}))
    await daemon.start()
    try:
        await daemon.ledger.append(actor="t", kind="k")
        await _grown(daemon.ledger)
    finally:
        await daemon.stop()


async def test_a_long_setting_signs_nothing_meanwhile(tmp_path: Path) -> None:
    daemon = Daemon(settings_for(tmp_path, roster_toml("http://127.0.0.1:9/v1")))  # 3600 s
    await daemon.start()
    try:
        before = daemon.ledger.latest_checkpoint()
        await daemon.ledger.append(actor="t", kind="k")
        await asyncio.sleep(0.3)
        assert daemon.ledger.latest_checkpoint() is before
    finally:
        await daemon.stop()
