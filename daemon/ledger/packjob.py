"""Deep verify's pack scan, run on the other core while the verifying thread walks the entries.

The scan (`packscan.scan`) is Python bound by the GIL, so a thread would not overlap it with
the walk; a child process does. Verify runs in a worker thread of a multi-threaded daemon, so
the child is never a fork of the daemon: `subprocess` starts a fresh interpreter (`-I -S`, so
~10 ms) on `packscan.py`, which imports a little of the standard library only. It inherits a
read-only descriptor of the pack (`pass_fds`; the same file, reopened through /proc, never the
daemon's read-write one) and reads the table snapshot from an anonymous file, so it scans
exactly the records the parent's snapshot describes; it writes its reply to another.

The child's answer is used only if it is whole and consistent (magic, trailer, echoed size and
mark, counts, hex digests, exit status 0); otherwise the parent scans the pack itself from the
same snapshot. A child that dies or answers garbage therefore costs time, never a wrong report.
Small packs are scanned in the parent: below `CHILD_MIN_BYTES` starting a child costs more
than it saves.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from daemon.ledger import packscan
from daemon.ledger.packscan import REPLY, PackScan, Snapshot, scan
from daemon.ledger.store import write_all

if TYPE_CHECKING:
    from daemon.ledger.store import BodyStore

log = logging.getLogger(__name__)

CHILD_MIN_BYTES = 4 << 20
"""Smallest pack scanned in a child: ~35k small records, ~50 ms of scanning in the parent."""
CHILD_ARGS = [sys.executable, "-I", "-S", str(Path(packscan.__file__).resolve())]
_HEX = b"0123456789abcdef"


def start_scan(bodies: BodyStore) -> PackJob:
    """Begin scanning the pack: in a child when it pays, else here and now."""
    snap = snapshot(bodies)
    job = PackJob(snap)
    if snap.fd >= 0 and snap.size >= CHILD_MIN_BYTES and _cores() >= 2:
        job.spawn()
    else:
        job.found = scan(snap)
    return job


def snapshot(bodies: BodyStore) -> Snapshot:
    """The pack as the store describes it now: under its lock, so the table copy and the synced
    mark describe the same records."""
    with bodies.lock:
        slots = bodies.map[:] if bodies.map is not None else b""
        size = bodies.pack_size
        return Snapshot(bodies.pack, size, min(bodies.mark, size), slots)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class PackJob:
    """A pack scan that may still be running in a child: `ready`, `result`, `close`."""

    def __init__(self, snap: Snapshot, found: PackScan | None = None) -> None:
        self.snap = snap
        self.found = found
        self.proc: subprocess.Popen[bytes] | None = None
        self.thread: threading.Thread | None = None
        self.files: tuple[int, ...] = ()  # the child's pack, request and reply, while it runs

    @classmethod
    def finished(cls, found: PackScan) -> PackJob:
        """A job whose result is already known (tests, callers that scanned themselves)."""
        return cls(Snapshot(-1, 0, found.end, found.slots), found)

    def spawn(self) -> None:
        """Start the child and a thread that waits for it and reads its reply.

        The request and the reply pass through anonymous files, not pipes: a pipe is drained
        64 KiB at a time by a thread that needs the GIL for each read, and the verifying thread
        holds the GIL, so megabytes through a pipe would trickle at one switch interval (5 ms)
        per 64 KiB. A file is written and read whole, once."""
        snap = self.snap
        try:
            self.files = (os.open(f"/proc/self/fd/{snap.fd}", os.O_RDONLY | os.O_CLOEXEC),)
            self.files += (_anonymous_file("packscan-request"),)
            self.files += (_anonymous_file("packscan-reply"),)
            # Header and table apart: one more copy of the table would cost its size again.
            write_all(self.files[1], packscan.REQUEST.pack(snap.size, snap.end, len(snap.slots)))
            write_all(self.files[1], snap.slots)
            self.proc = subprocess.Popen(
                [*CHILD_ARGS, *map(str, self.files)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=self.files,
            )
        except OSError as err:
            log.warning("ledger: pack scan child did not start (%s); scanning in-process", err)
            self._close_files()
            return
        self.thread = threading.Thread(target=self._collect, name="packscan", daemon=True)
        self.thread.start()

    def _collect(self) -> None:
        proc, snap = self.proc, self.snap
        assert proc is not None
        try:
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise ValueError(f"exit status {proc.returncode}: {err[-500:]!r}")
            reply = self.files[2]
            self.found = decode_reply(os.pread(reply, os.fstat(reply).st_size, 0), snap)
        except (OSError, ValueError) as problem:
            log.warning("ledger: pack scan child failed (%s); scanning in-process", problem)
        finally:
            self._close_files()

    def _close_files(self) -> None:
        for fd in self.files:
            os.close(fd)
        self.files = ()

    def ready(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def result(self) -> PackScan:
        """The scan; waits for the child, and scans here if it did not answer in full."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.found is None:
            self.found = scan(self.snap)
        return self.found

    def close(self) -> None:
        """Stop a child whose answer is no longer wanted (verify ended early)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.thread is not None:
            self.thread.join()
            self.thread = None


def _anonymous_file(name: str) -> int:
    """A file with no name (in memory where the system allows), closed on exec unless passed."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, os.MFD_CLOEXEC)
    with tempfile.TemporaryFile() as f:
        return os.dup(f.fileno())


def decode_reply(out: bytes, snap: Snapshot) -> PackScan:
    """The child's `PackScan`, or ValueError if any part of the reply is off."""
    magic, trailer = packscan.MAGIC, packscan.TRAILER
    if not out.startswith(magic) or not out.endswith(trailer):
        raise ValueError("reply without its magic or trailer")
    if len(out) < len(magic) + REPLY.size + len(trailer):
        raise ValueError("reply cut short")
    size, end, indexed, unindexed, below, length = REPLY.unpack_from(out, len(magic))
    order = out[len(magic) + REPLY.size : len(out) - len(trailer)]  # the one copy kept
    if (size, end) != (snap.size, snap.end) or unindexed > 1:
        raise ValueError("reply about another pack")
    if below > len(snap.slots) // packscan.SLOT.size:
        raise ValueError("reply counts more slots than the table has")
    if len(order) != length or length % 64 or order.translate(None, _HEX):
        raise ValueError("reply's digests malformed")
    return PackScan(order, indexed, bool(unindexed), snap.slots, snap.end, below)


def audit_table(bodies: BodyStore, found: PackScan | None) -> list[str]:
    """`BodyStore.audit` in bulk: when every record below the table's synced mark is found
    from its home slot (`scan`) and no other slot points below the mark, there is nothing
    to report; otherwise the exact audit names the problems."""
    if found is None or found.unindexed or not found.slots:
        return bodies.audit()
    return bodies.audit() if found.below != found.indexed else []
