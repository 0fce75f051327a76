"""One sequential pass over `bodies.pack` for deep verify: which bodies are intact.

Imports the standard library only, so that `packjob` can run this file as a small child
process (`python -I -S packscan.py FD`): deep verify then hashes the pack on the other core
while the verifying thread walks the entries. The pack's layout is restated here for the same
reason; a test holds it equal to `store`'s.

The child reads a request (the pack size and table snapshot the parent took under the store's
lock) on stdin and writes its `PackScan` on stdout; `packjob` checks every part of the reply.
"""

from __future__ import annotations

import binascii
import os
import struct
import sys
from array import array
from dataclasses import dataclass, field
from hashlib import sha256
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from daemon.ledger.store import BodyStore

PACK_HEADER = struct.Struct("<32sII")  # as in store: body hash, length, flags
REDACTED = 1  # as in store: the record's flag for a redacted body
SLOT = struct.Struct("<QQ")  # as in store: a bodies.idx slot, hash prefix (0 -> 1), offset + 1
READ_BYTES = 1 << 22


@dataclass(slots=True)
class Snapshot:
    """The pack as the store describes it at one instant: taken under its lock, so the table
    copy and the synced mark describe the same records."""

    fd: int  # the pack, open for reading (-1: no pack)
    size: int  # the pack's readable size
    end: int  # the table's synced mark, bounded by `size`
    slots: bytes  # the table's bytes


def snapshot(bodies: BodyStore) -> Snapshot:
    with bodies.lock:
        slots = bodies.map[:] if bodies.map is not None else b""
        size = bodies.pack_size
        return Snapshot(bodies.pack, size, min(bodies.mark, size), slots)


@dataclass(slots=True)
class PackScan:
    """What one pass over the pack found.

    `intact` holds, as lowercase hex (the form entries name them in), the digests whose newest
    record is live (not redacted) and whose bytes still hash to the digest: a body in it needs
    no further look. Any other body is looked up the old way (`BodyStore.read`), so redacted,
    changed and missing bodies are told apart exactly as before. Costs about 100 bytes of memory
    per distinct body while deep verify runs.
    """

    intact: set[bytes] = field(default_factory=set)
    indexed: int = 0
    """Records below the table's synced mark, each found in the table from its home slot."""
    unindexed: bool = False
    """Some record below the mark is not where a lookup finds it."""
    slots: bytes = b""  # the table as it was when the scan began (the mark with it)
    end: int = 0  # the synced mark, bounded by the pack's size


def scan(snap: Snapshot) -> PackScan:
    """Read the pack front to back in big blocks, hashing every record once, and look each
    record up in the table copy."""
    out = PackScan(slots=snap.slots, end=snap.end)
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
        used = _scan_block(buf, pos, snap, digests, bad, out)
        if used == 0:
            break  # a record cut short: the end of what the store can read
        pos += used
    if bad or len(set(digests)) != len(digests):
        # The newest record of a body decides, as in `BodyStore.locate`: later ones overwrite.
        spoilt = set(bad)
        newest = {digest: i not in spoilt for i, digest in enumerate(digests)}
        digests = [digest for digest, ok in newest.items() if ok]
    if digests:
        out.intact = set(binascii.hexlify(b"".join(digests), b" ", 32).split(b" "))
    return out


_KEYED = struct.Struct("<Q24xII")  # a record header read as: hash prefix, length, flags


def _scan_block(
    buf: bytes, pos: int, snap: Snapshot, digests: list[bytes], bad: list[int], out: PackScan
) -> int:
    """Hash and look up the whole records in `buf` (the pack from `pos`); how many bytes they
    span. The hot loop of deep verify: locals only, one unpack per record, bodies hashed in
    place through a memoryview, nothing but appends to lists for the common case."""
    table, header, slot, append = snap.slots, _KEYED.unpack_from, SLOT.unpack_from, digests.append
    mask = len(table) // SLOT.size - 1
    head, n, view = PACK_HEADER.size, len(buf), memoryview(buf)
    last = snap.end - pos - head  # records starting at or below this are under the mark
    indexed, unindexed, at = out.indexed, out.unindexed, 0
    while at + head <= n:
        key, length, flags = header(buf, at)
        stop = at + head + length
        if stop > n:
            break
        digest = buf[at : at + 32]
        append(digest)
        if flags & REDACTED or sha256(view[at + head : stop]).digest() != digest:
            bad.append(len(digests) - 1)
        if at <= last:
            key = key or 1
            if mask < 0 or (
                slot(table, (key & mask) << 4) != (key, pos + at + 1)
                and not _probe(table, key, pos + at + 1, mask)
            ):
                unindexed = True
            indexed += 1
        at = stop
    out.indexed, out.unindexed = indexed, unindexed
    return at


def _probe(table: bytes, key: int, start: int, mask: int) -> bool:
    """Whether a lookup from `key`'s home slot meets the slot (key, start) before an empty one."""
    i = key & mask
    while True:
        k, off = SLOT.unpack_from(table, i << 4)
        if off == 0:
            return False
        if k == key and off == start:
            return True
        i = (i + 1) & mask


def audit_table(bodies: BodyStore, found: PackScan | None) -> list[str]:
    """`BodyStore.audit` in bulk: when every record below the table's synced mark is found
    from its home slot (`scan`) and no other slot points below the mark, there is nothing
    to report; otherwise the exact audit names the problems."""
    if found is None or found.unindexed or not found.slots:
        return bodies.audit()
    offsets = array("Q", found.slots)[1::2]
    zeros = offsets.count(0)
    if max(offsets) <= found.end:
        below = len(offsets) - zeros
    else:  # slots of records written since the mark: count only the ones below it
        below = sum(map(found.end.__ge__, offsets)) - zeros
    # Records have distinct offsets, so as many slots as found records means one slot each.
    return bodies.audit() if below != found.indexed else []


# ---- the child's side of `packjob` ---------------------------------------------------------

REQUEST = struct.Struct("<QQQ")  # pack size, synced mark, length of the table copy
REPLY = struct.Struct("<QQQQQ")  # echoed size and mark, indexed, unindexed, intact digests
MAGIC = b"tally-packscan/1\n"
TRAILER = b"\nend\n"


def read_request(stream: BinaryIO, fd: int) -> Snapshot:
    head = stream.read(REQUEST.size)
    size, end, table = REQUEST.unpack(head)
    slots = stream.read(table)
    if len(slots) != table:
        raise ValueError("the request is cut short")
    return Snapshot(fd, size, end, slots)


def encode_reply(snap: Snapshot, found: PackScan) -> bytes:
    digests = b" ".join(found.intact)
    counts = (snap.size, snap.end, found.indexed, int(found.unindexed), len(found.intact))
    return MAGIC + REPLY.pack(*counts) + digests + TRAILER


def main(argv: list[str]) -> int:
    fd = int(argv[1])
    snap = read_request(sys.stdin.buffer, fd)
    sys.stdout.buffer.write(encode_reply(snap, scan(snap)))
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
