from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.ledger.merkle import (
    EMPTY_ROOT,
    consistency_path,
    inclusion_path,
    leaf_hash,
    memory_subtree,
    root_from_leaves,
    verify_consistency,
    verify_inclusion,
)


def leaves(n: int) -> list[bytes]:
    return [leaf_hash(i.to_bytes(4, "big")) for i in range(n)]


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


def test_known_vectors() -> None:
    # RFC 6962 / 9162 reference: empty tree and the leaf-hash prefix.
    assert root_from_leaves([]) == hashlib.sha256(b"").digest() == EMPTY_ROOT
    assert leaf_hash(b"") == bytes.fromhex(
        "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"
    )


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3000), st.data())
def test_inclusion_proofs_verify_and_flips_fail(n: int, data: st.DataObject) -> None:
    hashes = leaves(n)
    subtree = memory_subtree(hashes)
    root = subtree(0, n)
    assert root == root_from_leaves(hashes)
    for i in {0, n - 1, data.draw(st.integers(0, n - 1))}:
        path = inclusion_path(i, n, subtree)
        assert len(path) <= n.bit_length()
        assert verify_inclusion(i, n, hashes[i], path, root)
        bad_leaf = flip(hashes[i], data.draw(st.integers(0, 31)))
        assert not verify_inclusion(i, n, bad_leaf, path, root)
        assert not verify_inclusion(i, n, hashes[i], path, flip(root, 7))
        if path:
            k = data.draw(st.integers(0, len(path) - 1))
            bad = [*path[:k], flip(path[k], data.draw(st.integers(0, 31))), *path[k + 1 :]]
            assert not verify_inclusion(i, n, hashes[i], bad, root)
        if n > 1:
            assert not verify_inclusion((i + 1) % n, n, hashes[i], path, root)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3000), st.data())
def test_consistency_proofs_verify_and_flips_fail(n: int, data: st.DataObject) -> None:
    hashes = leaves(n)
    subtree = memory_subtree(hashes)
    new_root = subtree(0, n)
    for m in {1, n, data.draw(st.integers(1, n))}:
        old_root = subtree(0, m)
        path = consistency_path(m, n, subtree)
        assert verify_consistency(m, n, old_root, new_root, path)
        assert not verify_consistency(m, n, flip(old_root, 3), new_root, path)
        assert not verify_consistency(m, n, old_root, flip(new_root, 30), path)
        if path:
            k = data.draw(st.integers(0, len(path) - 1))
            bad = [*path[:k], flip(path[k], data.draw(st.integers(0, 31))), *path[k + 1 :]]
            assert not verify_consistency(m, n, old_root, new_root, bad)
    assert verify_consistency(0, n, EMPTY_ROOT, new_root, [])


def test_every_proof_of_small_trees() -> None:
    for n in range(1, 70):
        hashes = leaves(n)
        subtree = memory_subtree(hashes)
        root = subtree(0, n)
        for i in range(n):
            assert verify_inclusion(i, n, hashes[i], inclusion_path(i, n, subtree), root)
        for m in range(1, n + 1):
            path = consistency_path(m, n, subtree)
            assert verify_consistency(m, n, subtree(0, m), root, path)
