"""The cached Merkle tree is checked, not trusted: a corrupted level file never yields a proof
that an independent RFC 9162 verifier (root from the entry lines themselves) would reject."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.ledger import Ledger
from daemon.ledger.errors import LedgerCorrupt
from daemon.ledger.merkle import (
    leaf_hash,
    root_from_inclusion,
    root_from_leaves,
    verify_consistency,
)

N = 64


async def _filled(state_dir: Path) -> list[bytes]:
    ledger = await Ledger.open(state_dir)
    for i in range(N):
        await ledger.append(actor="t", kind="note", body={"i": i})
    await ledger.close()
    lines = (state_dir / "ledger" / "entries.jsonl").read_bytes().split(b"\n")[:-1]
    assert len(lines) == N
    return [leaf_hash(line) for line in lines]


@pytest.mark.parametrize("level", [1, 2, 3])
async def test_a_corrupted_level_file_is_refused_never_served(tmp_path: Path, level: int) -> None:
    leaves = await _filled(tmp_path)
    true_root = root_from_leaves(leaves)
    column = tmp_path / "ledger" / "tree" / f"level-{level:02d}.bin"
    data = bytearray(column.read_bytes())
    data[5] ^= 0xFF  # the first node of that level
    column.write_bytes(bytes(data))
    ledger = await Ledger.open(tmp_path)
    try:
        report = await ledger.verify()
        assert not report.ok
        assert f"level {level}" in (report.reason or "")
        assert report.first_bad_seq == 0  # the first node of the level covers seq 0
        refused = served = 0
        for seq in range(N):
            try:
                proof = await ledger.inclusion_proof(seq, N - 1 if seq < N - 1 else N)
            except LedgerCorrupt:
                refused += 1
                continue
            served += 1
            size = proof.tree_size
            root = root_from_leaves(leaves[:size])
            path = [bytes.fromhex(p) for p in proof.path]
            assert root_from_inclusion(seq, size, leaves[seq], path) == root, seq
        assert refused > 0  # the damaged node sits in some proofs
        assert served > 0
        for old in range(1, N):
            try:
                c = await ledger.consistency_proof(old, N)
            except LedgerCorrupt:
                continue
            cpath = [bytes.fromhex(p) for p in c.path]
            old_root = root_from_leaves(leaves[:old])
            assert verify_consistency(old, N, old_root, true_root, cpath), old
    finally:
        await ledger.close()
