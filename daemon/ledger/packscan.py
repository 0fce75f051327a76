"""One sequential pass over `bodies.pack` for deep verify: which bodies are intact.

Imports a few modules of the standard library only (no dataclasses, no typing: ~10 ms of a
child's start), so that `packjob` can run this file as a small child process (`python -I -S
packscan.py FD`): deep verify then hashes the pack on the other core while the verifying
thread walks the entries. For the same reason the pack's record formats are declared here,
once: `store` imports them from this file. The parent's side (snapshot, child, table audit) is
in `packjob`.

The child reads a request (the pack size and table snapshot the parent took under the store's
lock) and writes its `PackScan`, each through a file the parent passes; `packjob` checks every
part of the reply.
"""

from __future__ import annotations

import binascii
import os
import struct
import sys
from array import array
from hashlib import sha256

PACK_HEADER = struct.Struct("<32sII")  # a pack record: body hash, length, flags, the bytes
REDACTED = 1  # the record's flag for a redacted body (its bytes zeroed)
SLOT = struct.Struct("<QQ")  # a bodies.idx slot: hash prefix (0 -> 1), pack offset + 1 (0 = empty)
READ_BYTES = 1 << 22


class Snapshot:
    """The pack as the store describes it at one instant (`packjob.snapshot` takes it under the
    store's lock, so the table copy and the synced mark describe the same records)."""

    __slots__ = ("end", "fd", "size", "slots")

    def __init__(self, fd: int, size: int, end: int, slots: bytes) -> None:
        self.fd = fd  # the pack, open for reading (-1: no pack)
        self.size = size  # the pack's readable size
        self.end = end  # the table's synced mark, bounded by `size`
        self.slots = slots  # the table's bytes


class PackScan:
    """What one pass over the pack found.

    `order` holds the digests whose newest record is live (not redacted) and whose bytes still
    hash to the digest, as lowercase hex (the form entries name them in), joined, in pack order:
    a body among them needs no further look. Any other body is looked up the old way
    (`BodyStore.read`), so redacted, changed and missing bodies are told apart exactly as
    before. Entries usually name new bodies in the order the pack holds them, so the walk
    first compares a chunk's names with the next stretch of `order` (`follows`), and builds the
    set (`intact`, ~100 bytes per body) only when they differ.
    """

    __slots__ = ("at", "below", "end", "indexed", "known", "order", "slots", "unindexed")

    def __init__(
        self,
        order: bytes = b"",
        indexed: int = 0,
        unindexed: bool = False,
        slots: bytes = b"",
        end: int = 0,
        below: int = 0,
    ) -> None:
        self.order = order
        self.indexed = indexed
        """Records below the table's synced mark, each found in the table from its home slot."""
        self.unindexed = unindexed
        """Some record below the mark is not where a lookup finds it."""
        self.below = below
        """Slots of the table that point at or below the synced mark (`slots_below`)."""
        self.slots = slots  # the table as it was when the scan began (the mark with it)
        self.end = end  # the synced mark, bounded by the pack's size
        self.at = 0  # where in `order` the next chunk's names start
        self.known: set[bytes] | None = None  # `order` as a set, once needed

    def _key(self) -> tuple[bytes, int, bool, bytes, int, int]:
        return self.order, self.indexed, self.unindexed, self.slots, self.end, self.below

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PackScan) and self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # mutable: equal by value, not hashable

    def __repr__(self) -> str:
        return (
            f"PackScan({len(self.order) // 64} intact, indexed={self.indexed}, "
            f"unindexed={self.unindexed}, end={self.end})"
        )

    def follows(self, names: bytes) -> bool:
        """Whether `names` (a chunk's body digests as hex, joined) come next in `order`; then
        each of them is intact, and the next chunk is compared from after them."""
        if not self.order.startswith(names, self.at):
            return False
        self.at += len(names)
        return True

    def resync(self, name: bytes, within: int) -> None:
        """Compare the next chunk from after `name` (the last body a chunk named, which did not
        follow): one body named twice must not send every later chunk to the set. Searched
        forward only (an earlier copy of a body named again would send the cursor back), and
        only `within` bytes on: a name found nowhere near (an old body named again, a missing
        one) must not cost a search of the rest of `order` for every chunk."""
        at = self.order.find(name, self.at, self.at + within)
        if at >= 0 and at % 64 == 0:
            self.at = at + 64

    def intact(self) -> set[bytes]:
        if self.known is None:
            order = self.order
            self.known = {order[i : i + 64] for i in range(0, len(order), 64)}
        return self.known


def scan(snap: Snapshot) -> PackScan:
    """Read the pack front to back in big blocks, hashing every record once, and look each
    record up in the table copy."""
    slots = snap.slots
    words = memoryview(slots[: len(slots) - len(slots) % SLOT.size]).cast("Q")  # a torn tail off
    out = PackScan(slots=slots, end=snap.end, below=slots_below(words, snap.end))
    if snap.fd < 0:
        return out
    digests: list[bytes] = []  # every record's digest, in pack order
    bad: list[int] = []  # the records (indexes into `digests`) redacted or not matching
    pos, size = 0, snap.size
    while pos + PACK_HEADER.size <= size:
        buf = os.pread(snap.fd, min(READ_BYTES, size - pos), pos)
        if len(buf) < PACK_HEADER.size:
            break
        want = PACK_HEADER.unpack_from(buf, 0)[1] + PACK_HEADER.size
        if want > len(buf):  # a record bigger than a block: read it whole
            buf = os.pread(snap.fd, min(want, size - pos), pos)
        used = _scan_block(buf, pos, snap, words, digests, bad, out)
        if used == 0:
            break  # a record cut short: the end of what the store can read
        pos += used
    if bad:
        # The newest record of a body decides, as in `BodyStore.locate`: later ones overwrite.
        # (With none spoilt every record is intact, and a body stored twice is listed twice.)
        spoilt = set(bad)
        newest = {digest: i not in spoilt for i, digest in enumerate(digests)}
        digests = [digest for digest, ok in newest.items() if ok]
    out.order = binascii.hexlify(b"".join(digests))
    return out


def slots_below(words: memoryview, end: int) -> int:
    """How many slots of a table (as 64-bit words: hash prefix, offset + 1, ...) point at a
    record starting below `end` (the synced mark). With as many as the records a scan found
    there from their home slots, each has exactly one slot (records have distinct offsets),
    and the table needs no exact audit. Counted by the scan, so that the child, not the
    verifying thread, pays for it."""
    if not words:
        return 0
    offsets = array("Q", words[1::2].tobytes())
    zeros = offsets.count(0)
    if max(offsets) <= end:
        return len(offsets) - zeros
    return sum(map(end.__ge__, offsets)) - zeros  # slots of records written since the mark


_KEYED = struct.Struct("<Q24xII")  # a record header read as: hash prefix, length, flags


def _scan_block(
    buf: bytes,
    pos: int,
    snap: Snapshot,
    words: memoryview,
    digests: list[bytes],
    bad: list[int],
    out: PackScan,
) -> int:
    """Hash and look up the whole records in `buf` (the pack from `pos`); how many bytes they
    span. The hot loop of deep verify: locals only, one unpack per record, bodies hashed from
    a slice (cheaper than a memoryview's for small records), the home slot read as two words
    of `words` (the table as 64-bit words: no tuple per lookup), nothing but appends to lists
    for the common case."""
    table, header, append = snap.slots, _KEYED.unpack_from, digests.append
    mask = len(table) // SLOT.size - 1
    head, n = PACK_HEADER.size, len(buf)
    last = snap.end - pos - head  # records starting at or below this are under the mark
    start = pos + 1  # a slot holds its record's offset + 1
    indexed, unindexed, at = out.indexed, out.unindexed, 0
    while at + head <= n:
        key, length, flags = header(buf, at)
        stop = at + head + length
        if stop > n:
            break
        digest = buf[at : at + 32]
        append(digest)
        if flags & REDACTED or sha256(buf[at + head : stop]).digest() != digest:
            bad.append(len(digests) - 1)
        if at <= last:
            key = key or 1
            i = (key & mask) << 1
            if mask < 0 or (
                (words[i] != key or words[i + 1] != start + at)
                and not _probe(words, key, start + at, mask)
            ):
                unindexed = True
            indexed += 1
        at = stop
    out.indexed, out.unindexed = indexed, unindexed
    return at


def _probe(words: memoryview, key: int, start: int, mask: int) -> bool:
    """Whether a lookup from `key`'s home slot meets the slot (key, start) before an empty one."""
    i = key & mask
    for _ in range(mask + 1):  # a table with no empty slot (a damaged file) ends too
        if words[2 * i + 1] == 0:
            return False
        if words[2 * i] == key and words[2 * i + 1] == start:
            return True
        i = (i + 1) & mask
    return False


# ---- the child's side of `packjob` ---------------------------------------------------------

REQUEST = struct.Struct("<QQQ")  # pack size, synced mark, length of the table copy
REPLY = struct.Struct("<QQQQQQ")  # echoed size and mark, indexed, unindexed, below, len(order)
MAGIC = b"tally-packscan/2\n"  # 2: the reply carries `below`
TRAILER = b"\nend\n"


def read_request(data: bytes, fd: int) -> Snapshot:
    size, end, table = REQUEST.unpack_from(data)
    slots = data[REQUEST.size :]
    if len(slots) != table:
        raise ValueError("the request is cut short")
    return Snapshot(fd, size, end, slots)


def encode_reply(snap: Snapshot, found: PackScan) -> bytes:
    counts = (
        snap.size,
        snap.end,
        found.indexed,
        int(found.unindexed),
        found.below,
        len(found.order),
    )
    return MAGIC + REPLY.pack(*counts) + found.order + TRAILER


def main(argv: list[str]) -> int:
    """`packscan.py PACK REQUEST REPLY` (descriptors): scan, and write the reply whole."""
    pack, request, reply = map(int, argv[1:4])
    snap = read_request(os.pread(request, os.fstat(request).st_size, 0), pack)
    view = memoryview(encode_reply(snap, scan(snap)))
    while view:
        view = view[os.write(reply, view) :]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
