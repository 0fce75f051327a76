"""Derived files are checked, not trusted: a corrupted tree level, leaf/offset index or body
table is reported by `verify`, rebuilt by a writer, and never makes a wrong proof served (each
proof is judged by an independent RFC 9162 reference against the root of the entries' lines and
the signed checkpoint)."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from pathlib import Path

import pytest

from daemon.ledger import Ledger, LedgerCorrupt
from surfaces.cli import main
from tests.ledger import rfc9162

N = 300  # 256 + 32 + 8 + 4: the frontier is level 8 node 0, 5/8, 3/36, 2/74


async def build(state_dir: Path, n: int = N) -> None:
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    for i in range(n):
        await ledger.append(actor="t", kind="note", body={"i": i})
    await ledger.close()  # a checkpoint at n: the signed root


def lines(state_dir: Path) -> list[bytes]:
    return (state_dir / "ledger" / "entries.jsonl").read_bytes().split(b"\n")[:-1]


def signed_root(state_dir: Path) -> bytes:
    note = (state_dir / "ledger" / "checkpoint").read_text().splitlines()
    return base64.b64decode(note[2])


def flip(path: Path, at: int) -> bytes:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    return bytes(data)


def level(state_dir: Path, k: int) -> Path:
    return state_dir / "ledger" / "tree" / f"level-{k:02d}.bin"


def check_proof(state_dir: Path, proof: dict[str, object]) -> None:
    """The proof verifies independently against the entries' own root and the signed one."""
    data = lines(state_dir)
    size = int(proof["tree_size"])  # type: ignore[call-overload]
    seq = int(proof["leaf_index"])  # type: ignore[call-overload]
    root = rfc9162.mth(data[:size])
    assert bytes.fromhex(str(proof["root"])) == root
    path = [bytes.fromhex(p) for p in proof["path"]]  # type: ignore[attr-defined]
    assert rfc9162.verify_inclusion(seq, size, data[seq], path, root), proof


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = await asyncio.to_thread(main, list(argv))  # the CLI runs its own event loop
    return code, capsys.readouterr().out


async def test_a_corrupt_interior_node_is_reported_and_never_served(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await build(state_dir)
    assert rfc9162.mth(lines(state_dir)) == signed_root(state_dir)
    # Node 4 of level 2 (entries 16..19) is on the path of entries 20..23, not on the frontier.
    flip(level(state_dir, 2), 4 * 32 + 7)
    s = ["--state", str(state_dir)]
    code, out = await cli(capsys, "ledger", "verify", "--json", *s)
    report = json.loads(out)
    assert code == 1
    assert report["ok"] is False
    assert report["first_bad_seq"] is None  # the entries are intact
    assert report["derived"] == [
        "tree/level-02.bin: node 4 (entries 16..19) does not match the entries"
    ]
    code, out = await cli(capsys, "ledger", "verify", *s)
    assert "DERIVED files do not match the entries" in out
    assert "tree/level-02.bin: node 4 (entries 16..19)" in out
    # The read-only CLI serves only proofs that verify (rebuilt in memory), never the bad node.
    for seq in (16, 21, 150, 299):
        code, out = await cli(capsys, "ledger", "proof", "inclusion", str(seq), "--json", *s)
        assert code == 0, out
        check_proof(state_dir, json.loads(out))
    code, out = await cli(capsys, "ledger", "verify", "--json", *s)
    assert json.loads(out)["derived"] == report["derived"]  # a reader fixes nothing on disk
    # The daemon's ledger: the first proof that touches the node rebuilds the stored tree.
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    for seq in range(N):
        check_proof(state_dir, (await ledger.inclusion_proof(seq)).model_dump())
    assert (await ledger.verify()).ok
    await ledger.close()
    code, out = await cli(capsys, "ledger", "verify", "--json", *s)
    assert (code, json.loads(out)["derived"]) == (0, [])


@pytest.mark.parametrize("readonly", [False, True])
async def test_a_corrupt_frontier_node_is_rebuilt_at_open(state_dir: Path, readonly: bool) -> None:
    await build(state_dir)
    flip(level(state_dir, 5), 8 * 32 + 3)  # on the frontier: the root it implies is wrong
    ledger = await Ledger.open(state_dir, readonly=readonly, checkpoint_interval=None)
    assert ledger.root(N) == signed_root(state_dir).hex()
    for seq in (0, 100, 270, 299):
        check_proof(state_dir, (await ledger.inclusion_proof(seq)).model_dump())
    proof = await ledger.consistency_proof(100, N)
    assert proof.new_root == signed_root(state_dir).hex()
    assert proof.old_root == rfc9162.mth(lines(state_dir)[:100]).hex()
    report = await ledger.verify()
    # A writer fixed the file at open; a reader reports what is on disk.
    assert report.ok is not readonly
    assert bool(report.derived) is readonly
    await ledger.close()


async def test_a_wrong_offset_in_the_index_is_reported_and_its_proof_refused(
    state_dir: Path,
) -> None:
    await build(state_dir)
    index = state_dir / "ledger" / "index.bin"
    data = bytearray(index.read_bytes())
    struct.pack_into("<Q", data, 40 * 40 + 32, struct.unpack_from("<Q", data, 40 * 40 + 32)[0] + 3)
    index.write_bytes(bytes(data))
    ledger = await Ledger.open(state_dir, readonly=True)
    report = await ledger.verify()
    assert not report.ok
    assert report.first_bad_seq is None
    assert report.derived[0].startswith("index.bin: entry 40 ends at offset")
    # The leaf of entry 41 is read through the wrong offset: the proof cannot check out.
    with pytest.raises(LedgerCorrupt) as err:
        await ledger.inclusion_proof(41)
    assert "the proof is refused" in err.value.message
    check_proof(state_dir, (await ledger.inclusion_proof(200)).model_dump())
    await ledger.close()


async def test_a_corrupt_body_table_is_reported_and_rebuilt(state_dir: Path) -> None:
    await build(state_dir, 50)
    table = state_dir / "ledger" / "bodies.idx"
    data = bytearray(table.read_bytes())
    slots = [i for i in range(0, len(data), 16) if any(data[i + 8 : i + 16])]
    assert len(slots) == 50
    data[slots[7] + 8 : slots[7] + 16] = struct.pack("<Q", 2)  # points into a record's middle
    table.write_bytes(bytes(data))
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    report = await ledger.verify(deep=True)
    assert not report.ok
    assert any("is not in the table" in p for p in report.derived), report.derived
    assert any(f"slot {slots[7] // 16} points at offset 1" in p for p in report.derived)
    assert report.rebuilt == ["bodies.idx"]
    after = await ledger.verify(deep=True)
    assert after.ok, after
    assert [(await ledger.body(e.body)).value for e in await ledger.entries(0, 50)] == [
        {"i": i} for i in range(50)
    ]
    await ledger.close()


async def test_nodes_synced_after_the_last_checkpoint_are_recomputed_at_open(
    state_dir: Path,
) -> None:
    await build(state_dir)  # signed at 300
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    for i in range(100):
        await ledger.append(actor="t", kind="note", body={"j": i})
    # The derived files are synced (as every SYNC_EVERY entries) but nothing signs size 400.
    await asyncio.get_running_loop().run_in_executor(ledger._executor, ledger._sync_derived)
    await ledger.abandon()
    flip(level(state_dir, 7), 2 * 32 + 9)  # node 2 (entries 256..383): on the frontier at 400
    again = await Ledger.open(state_dir, checkpoint_interval=None)
    assert again.root(400) == rfc9162.mth(lines(state_dir)).hex()
    for seq in (0, 260, 399):
        check_proof(state_dir, (await again.inclusion_proof(seq)).model_dump())
    checkpoint = await again.checkpoint()  # what it signs is the entries' root, not the cache's
    assert checkpoint.root == rfc9162.mth(lines(state_dir)).hex()
    assert (await again.verify()).ok
    await again.close()


async def test_the_owners_verify_rebuilds_a_wrong_offset_in_the_index(state_dir: Path) -> None:
    await build(state_dir)
    index = state_dir / "ledger" / "index.bin"
    data = bytearray(index.read_bytes())
    struct.pack_into("<Q", data, 40 * 40 + 32, struct.unpack_from("<Q", data, 40 * 40 + 32)[0] + 3)
    index.write_bytes(bytes(data))
    owner = await Ledger.open(state_dir, checkpoint_interval=None)
    report = await owner.verify()
    assert report.derived[0].startswith("index.bin: entry 40 ends at offset")
    assert report.rebuilt == ["index.bin"]  # the leaves were right: no tree node to fix
    check_proof(state_dir, (await owner.inclusion_proof(41)).model_dump())
    await owner.close()
    reader = await Ledger.open(state_dir, readonly=True)
    assert (await reader.verify()).ok
    await reader.close()
