"""A compact run-state snapshot, so the daemon's start-up does not grow with its history.

The snapshot is the replay reducer's output (every RunView) after the first `size` ledger
entries, stamped with that size, the Merkle root of those entries and the leaf hash of the
last one. It lives in the state dir (`runs.snapshot.json`), written atomically on stop and
periodically. It is derived data, never the record: on load it counts only if the ledger
still holds that prefix (same root, same last leaf) and no redaction came after it (a
redaction changes what replay reads); otherwise start-up replays the whole ledger.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ValidationError

from daemon.runs.state import FINAL, RunView

log = logging.getLogger(__name__)

FILE = "runs.snapshot.json"
VERSION = 1


class Snapshot(BaseModel):
    version: int = VERSION
    size: int
    """The views are the reduction of entries [0, size)."""
    root: str
    """The ledger's Merkle root at `size` ("" when size is 0)."""
    leaf: str
    """The leaf hash of entry size - 1 ("" when size is 0)."""
    views: list[RunView]


class StampedLedger(Protocol):
    @property
    def size(self) -> int: ...
    def root(self, size: int | None = None) -> str: ...
    def leaf_hash(self, seq: int) -> str: ...


def stamp(ledger: StampedLedger, size: int, views: list[RunView]) -> Snapshot:
    if size == 0:
        return Snapshot(size=0, root="", leaf="", views=views)
    return Snapshot(size=size, root=ledger.root(size), leaf=ledger.leaf_hash(size - 1), views=views)


def write(state_dir: Path, snapshot: Snapshot, summaries: Sequence[bytes] = ()) -> None:
    """Encode and save, in a worker thread: no view in `snapshot` may change meanwhile (see
    Engine.snapshot). A finished run is written as its summary (`RunView.compacted`: replay
    reads the rest back on demand); one view at a time, so the event loop gets the GIL back
    between views instead of waiting for the whole encode. `summaries` are views already
    encoded (summaries, oldest first): they go first, as they are."""
    head = snapshot.model_dump_json(exclude={"views"}).encode()[:-1]  # without its "}"
    views = list(summaries) + [
        (v.compacted() if v.state in FINAL and not v.summary else v).model_dump_json().encode()
        for v in snapshot.views
    ]
    save(state_dir, head + b',"views":[' + b",".join(views) + b"]}")


def save(state_dir: Path, data: bytes) -> None:
    """Write atomically: a crash leaves the old snapshot or the new one, never a torn one."""
    path = state_dir / FILE
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(state_dir: Path, ledger: StampedLedger) -> Snapshot | None:
    """The snapshot if it matches the ledger's prefix; None (full replay) otherwise."""
    path = state_dir / FILE
    try:
        snapshot = Snapshot.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError, ValueError) as exc:
        log.warning("ignoring the run snapshot %s: %s", path, exc)
        return None
    reason = mismatch(snapshot, ledger)
    if reason is not None:
        log.warning("ignoring the run snapshot %s: %s", path, reason)
        return None
    return snapshot


def mismatch(snapshot: Snapshot, ledger: StampedLedger) -> str | None:
    if snapshot.version != VERSION:
        return f"version {snapshot.version}, expected {VERSION}"
    if snapshot.size > ledger.size:
        return f"it covers {snapshot.size} entries, the ledger holds {ledger.size}"
    if snapshot.size == 0:
        return None
    if ledger.leaf_hash(snapshot.size - 1) != snapshot.leaf:
        return f"the leaf hash at seq {snapshot.size - 1} differs"
    if ledger.root(snapshot.size) != snapshot.root:
        return f"the root at size {snapshot.size} differs"
    return None
