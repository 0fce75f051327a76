"""An independent RFC 9162 reference for the tests: written from the RFC's text (§2.1.1 MTH,
§2.1.3.2 inclusion verification), sharing no code with `daemon.ledger.merkle`, so a proof the
ledger serves is judged by something other than the code that built it."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def _h(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def mth(entries: Sequence[bytes]) -> bytes:
    """MTH(D[n]): the Merkle Tree Hash of the leaf inputs, by the RFC's recursive definition."""
    n = len(entries)
    if n == 0:
        return _h(b"")
    if n == 1:
        return _h(b"\x00" + entries[0])
    k = 1
    while k * 2 < n:
        k *= 2
    return _h(b"\x01" + mth(entries[:k]) + mth(entries[k:]))


def verify_inclusion(
    leaf_index: int, tree_size: int, leaf_input: bytes, path: Sequence[bytes], root: bytes
) -> bool:
    """§2.1.3.2, step by step."""
    if leaf_index >= tree_size:
        return False
    fn, sn = leaf_index, tree_size - 1
    r = _h(b"\x00" + leaf_input)
    for p in path:
        if sn == 0:
            return False
        if fn % 2 == 1 or fn == sn:
            r = _h(b"\x01" + p + r)
            if fn % 2 == 0:
                while fn % 2 == 0 and fn != 0:
                    fn >>= 1
                    sn >>= 1
        else:
            r = _h(b"\x01" + r + p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root
