"""`ledger_proof` over HTTP while a tree level is corrupted under the running daemon: every
proof it serves verifies under an independent RFC 9162 reference (it rebuilds the level), and
`health` reports the ledger writable."""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import TestClient

from daemon.service import Daemon
from tests.ledger import rfc9162


async def test_a_proof_over_http_is_never_served_from_a_corrupt_level(
    daemon: Daemon, client: TestClient[Any, Any]
) -> None:
    for i in range(40):
        await daemon.ledger.append(actor="t", kind="note", body={"i": i})
    await daemon.ledger.checkpoint()  # the levels are on disk now
    size = daemon.ledger.size
    root = daemon.settings.state_dir / "ledger"
    level = root / "tree" / "level-02.bin"
    data = bytearray(level.read_bytes())
    data[4 * 32 + 5] ^= 0xFF  # node 4: entries 16..19, on the path of 20..23
    level.write_bytes(bytes(data))
    lines = (root / "entries.jsonl").read_bytes().split(b"\n")[:size]
    expected = rfc9162.mth(lines)
    for seq in (21, 17, 0, size - 1):
        r = await client.post(
            "/v1/tools/ledger_proof", json={"kind": "inclusion", "seq": seq, "size": size}
        )
        assert r.status == 200, await r.text()
        proof = await r.json()
        assert bytes.fromhex(proof["root"]) == expected
        path = [bytes.fromhex(p) for p in proof["path"]]
        assert rfc9162.verify_inclusion(seq, size, lines[seq], path, expected), seq
    assert level.read_bytes()[4 * 32 + 5] != data[4 * 32 + 5]  # rebuilt on disk
    r = await client.post("/v1/tools/health", json={})
    health = await r.json()
    assert (health["status"], health["ledger_writable"], health["reason"]) == ("ok", True, None)
