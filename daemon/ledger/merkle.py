"""RFC 9162 Merkle tree hashing, proof construction and pure proof verifiers.

Leaves are `SHA-256(0x00 || data)`, interior nodes `SHA-256(0x01 || left || right)`; the tree of
n leaves splits at the largest power of two below n (RFC 9162 §2.1.1). Proof construction takes
a `Subtree` callback that returns the hash of an aligned leaf range, so the same code runs over
in-memory leaves (tests) and over the ledger's stored per-level hashes (O(log n) reads).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence

Subtree = Callable[[int, int], bytes]
"""subtree(start, end) -> the Merkle tree hash of leaves [start, end)."""

EMPTY_ROOT = hashlib.sha256(b"").digest()


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def split_point(n: int) -> int:
    """The largest power of two strictly below n (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


class Frontier:
    """The right edge of a growing tree: one complete subtree hash per set bit of the size."""

    def __init__(self, size: int = 0, nodes: Sequence[bytes] = ()) -> None:
        # nodes[i] belongs to the i-th set bit of size counted from the most significant one.
        if len(nodes) != size.bit_count():
            raise ValueError("frontier nodes do not match the size")
        self.size = size
        self._stack: list[tuple[int, bytes]] = []
        levels = [b for b in range(size.bit_length() - 1, -1, -1) if size >> b & 1]
        self._stack = list(zip(levels, nodes, strict=True))

    def copy(self) -> Frontier:
        return Frontier(self.size, [h for _, h in self._stack])

    def snapshot(self) -> tuple[int, tuple[tuple[int, bytes], ...]]:
        """A cheap immutable copy (no hashing): `Frontier.restore` turns it back."""
        return self.size, tuple(self._stack)

    @classmethod
    def restore(cls, snapshot: tuple[int, tuple[tuple[int, bytes], ...]]) -> Frontier:
        return cls(snapshot[0], [h for _, h in snapshot[1]])

    def push(self, leaf: bytes) -> list[tuple[int, int, bytes]]:
        """Add a leaf hash; return the complete nodes it finished as (level, index, hash)."""
        done = [(0, self.size, leaf)]
        level, h = 0, leaf
        stack = self._stack
        while stack and stack[-1][0] == level:
            _, left = stack.pop()
            h = node_hash(left, h)
            level += 1
            done.append((level, self.size >> level, h))
        stack.append((level, h))
        self.size += 1
        return done

    def push_many(self, leaves: Iterable[bytes]) -> list[tuple[int, bytes]]:
        """Add leaf hashes; return the interior nodes they completed as (level, hash), in order.

        Nodes of one level come out in index order (what `Tree.extend` appends to its files).
        """
        done: list[tuple[int, bytes]] = []
        stack = self._stack
        sha256 = hashlib.sha256
        size = self.size
        for h in leaves:
            level = 0
            while stack and stack[-1][0] == level:
                h = sha256(b"\x01" + stack.pop()[1] + h).digest()
                level += 1
                done.append((level, h))
            stack.append((level, h))
            size += 1
        self.size = size
        return done

    def root(self) -> bytes:
        if not self._stack:
            return EMPTY_ROOT
        it = reversed(self._stack)
        h = next(it)[1]
        for _, left in it:
            h = node_hash(left, h)
        return h


def root_from_leaves(leaves: Iterable[bytes]) -> bytes:
    """The tree hash of the given leaf hashes (streaming, O(log n) memory)."""
    frontier = Frontier()
    for leaf in leaves:
        frontier.push(leaf)
    return frontier.root()


def memory_subtree(leaves: Sequence[bytes]) -> Subtree:
    """A `Subtree` over in-memory leaf hashes (for tests and small trees)."""

    def subtree(start: int, end: int) -> bytes:
        n = end - start
        if n == 1:
            return leaves[start]
        k = split_point(n)
        return node_hash(subtree(start, start + k), subtree(start + k, end))

    return subtree


def inclusion_path(index: int, size: int, subtree: Subtree) -> list[bytes]:
    """RFC 9162 §2.1.3.1 PATH(index, D[0:size])."""
    if not 0 <= index < size:
        raise ValueError(f"leaf {index} is not in a tree of size {size}")
    path: list[bytes] = []
    start, end = 0, size
    while end - start > 1:
        k = split_point(end - start)
        if index - start < k:
            path.append(subtree(start + k, end))
            end = start + k
        else:
            path.append(subtree(start, start + k))
            start += k
    path.reverse()
    return path


def consistency_path(old: int, new: int, subtree: Subtree) -> list[bytes]:
    """RFC 9162 §2.1.4.1 PROOF(old, D[0:new]); empty when old is 0 or old == new."""
    if not 0 <= old <= new:
        raise ValueError(f"no consistency proof from size {old} to size {new}")
    if old in (0, new):
        return []
    path: list[bytes] = []
    start, end, m, complete = 0, new, old, True
    while m != end - start:
        k = split_point(end - start)
        if m <= k:
            path.append(subtree(start + k, end))
            end = start + k
        else:
            path.append(subtree(start, start + k))
            start += k
            m -= k
            complete = False
    if not complete:
        path.append(subtree(start, end))
    path.reverse()
    return path


def root_from_inclusion(index: int, size: int, leaf: bytes, path: Sequence[bytes]) -> bytes | None:
    """RFC 9162 §2.1.3.2: the root implied by an inclusion proof, or None if malformed."""
    if not 0 <= index < size:
        return None
    fn, sn, r = index, size - 1, leaf
    for p in path:
        if sn == 0:
            return None
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while not (fn & 1 or fn == 0):
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return r if sn == 0 else None


def verify_inclusion(
    index: int, size: int, leaf: bytes, path: Sequence[bytes], root: bytes
) -> bool:
    return root_from_inclusion(index, size, leaf, path) == root


def verify_consistency(
    old: int, new: int, old_root: bytes, new_root: bytes, path: Sequence[bytes]
) -> bool:
    """RFC 9162 §2.1.4.2; the empty tree is consistent with every tree."""
    if not 0 <= old <= new:
        return False
    if old == 0:
        return not path and old_root == EMPTY_ROOT
    if old == new:
        return not path and old_root == new_root
    proof = list(path)
    if old & (old - 1) == 0:
        proof.insert(0, old_root)
    if not proof:
        return False
    fn, sn = old - 1, new - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = proof[0]
    for c in proof[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while not (fn & 1 or fn == 0):
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and fr == old_root and sr == new_root
