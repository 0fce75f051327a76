from __future__ import annotations

import hashlib

from hypothesis import example, given, settings
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


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 400))
@example(256)
@example(257)
@example(400)
def test_every_inclusion_proof_verifies_and_flips_fail(n: int) -> None:
    hashes = leaves(n)
    subtree = memory_subtree(hashes)
    root = root_from_leaves(hashes)
    assert subtree(0, n) == root
    byte = n % 32  # which byte the flips hit
    for i in range(n):
        path = inclusion_path(i, n, subtree)
        assert len(path) <= n.bit_length()
        assert verify_inclusion(i, n, hashes[i], path, root), i
        assert not verify_inclusion(i, n, flip(hashes[i], byte), path, root), i
        assert not verify_inclusion(i, n, hashes[i], path, flip(root, byte)), i
        if path:
            k = i % len(path)
            bad = [*path[:k], flip(path[k], byte), *path[k + 1 :]]
            assert not verify_inclusion(i, n, hashes[i], bad, root), i
        if n > 1:
            assert not verify_inclusion((i + 1) % n, n, hashes[i], path, root), i


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 400))
@example(256)
@example(257)
@example(400)
def test_every_consistency_proof_verifies_and_flips_fail(n: int) -> None:
    hashes = leaves(n)
    subtree = memory_subtree(hashes)
    new_root = root_from_leaves(hashes)
    byte = n % 32  # which byte the flips hit
    assert verify_consistency(0, n, EMPTY_ROOT, new_root, [])
    for m in range(1, n + 1):
        old_root = root_from_leaves(hashes[:m])
        path = consistency_path(m, n, subtree)
        assert verify_consistency(m, n, old_root, new_root, path), m
        assert not verify_consistency(m, n, flip(old_root, byte), new_root, path), m
        assert not verify_consistency(m, n, old_root, flip(new_root, byte), path), m
        if path:
            k = m % len(path)
            bad = [*path[:k], flip(path[k], byte), *path[k + 1 :]]
            assert not verify_consistency(m, n, old_root, new_root, bad), m


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
