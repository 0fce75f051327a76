"""A compact run-state snapshot, so the daemon's start-up does not grow with its history.

The snapshot is the replay reducer's output (every RunView) after the first `size` ledger
entries, stamped with that size, the Merkle root of those entries and the leaf hash of the
last one. It lives in the state dir (`runs.snapshot.json`), written atomically on stop and
periodically. It is derived data, never the record: on load it counts only if the ledger
still holds that prefix (same root, same last leaf) and no redaction came after it (a
redaction changes what replay reads); otherwise start-up replays the whole ledger.

A stamp alone does not make the views true: anyone who can write the state dir could keep the
stamp and change a run's state, client, request, answer or plan (which `run_resume` continues).
So the file is sealed by the ledger's owner (`Ledger.seal`): an HMAC and an ed25519 signature
with the checkpoint key, over a digest of the encoded file, appended as its last two fields.
The daemon checks the HMAC at start (no signature library loads) and refuses a snapshot whose
seal does not match, replaying the ledger instead; `tally ledger verify` checks the signature
with `checkpoint.vkey` (`check`) and warns, naming the file. Only the daemon holds the key.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ValidationError

from daemon import layout
from daemon.files import PRIVATE, write_atomic
from daemon.runs.state import FINAL, RunView

log = logging.getLogger(__name__)

FILE = layout.RUNS_SNAPSHOT
VERSION = 2  # 2: sealed (a version 1 file is never trusted: the next start replays)
DOMAIN = b"tally/runs-snapshot/v2\n"  # what a seal signs begins so (never a checkpoint note)
_SEALED = re.compile(rb'(.*),"mac":"([0-9a-f]{64})","sig":"([0-9a-f]{128})"\}', re.DOTALL)

Seal = Callable[[bytes], tuple[bytes, bytes]]


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
    def check_mac(self, message: bytes, mac: bytes) -> bool: ...
    def check_signature(self, message: bytes, signature: bytes) -> bool: ...


def stamp(ledger: StampedLedger, size: int, views: list[RunView]) -> Snapshot:
    if size == 0:
        return Snapshot(size=0, root="", leaf="", views=views)
    return Snapshot(size=size, root=ledger.root(size), leaf=ledger.leaf_hash(size - 1), views=views)


def write(
    state_dir: Path, snapshot: Snapshot, summaries: Sequence[bytes] = (), seal: Seal | None = None
) -> None:
    """Encode and save, in a worker thread: no view in `snapshot` may change meanwhile (see
    Engine.snapshot). A finished run is written as its summary (`RunView.compacted`: replay
    reads the rest back on demand); one view at a time, so the event loop gets the GIL back
    between views instead of waiting for the whole encode. `summaries` are views already
    encoded (summaries, oldest first): they go first, as they are. `seal` (the owner's
    `Ledger.seal`) seals it; without one the file is never trusted at start (tests)."""
    head = snapshot.model_dump_json(exclude={"views"}).encode()[:-1]  # without its "}"
    views = list(summaries) + [
        (v.compacted() if v.state in FINAL and not v.summary else v).model_dump_json().encode()
        for v in snapshot.views
    ]
    body = head + b',"views":[' + b",".join(views) + b"]}"
    if seal is not None:
        mac, sig = seal(message(body))
        body = body[:-1] + b',"mac":"%s","sig":"%s"}' % (mac.hex().encode(), sig.hex().encode())
    save(state_dir, body)


def message(body: bytes) -> bytes:
    """What a seal covers: the domain, then the SHA-256 of the file without its seal."""
    return DOMAIN + hashlib.sha256(body).digest()


def unseal(data: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(the file without its seal, MAC, signature), or None for a file with no seal."""
    sealed = _SEALED.fullmatch(data)
    if sealed is None:
        return None
    body, mac, sig = sealed.groups()
    return body + b"}", bytes.fromhex(mac.decode()), bytes.fromhex(sig.decode())


def save(state_dir: Path, data: bytes) -> None:
    """Write atomically: a crash leaves the old snapshot or the new one, never a torn one."""
    write_atomic(state_dir / FILE, data, mode=PRIVATE)


def load(state_dir: Path, ledger: StampedLedger) -> Snapshot | None:
    """The snapshot if its seal is the owner's and it matches the ledger's prefix; None (full
    replay) otherwise."""
    path = state_dir / FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("ignoring the run snapshot %s: %s", path, exc)
        return None
    sealed = unseal(data)
    # The owner checks its MAC; a read-only reader (`tally runs` offline) holds no MAC key, so
    # it checks the signature with `checkpoint.vkey` instead of calling the file edited.
    if sealed is None or not (
        ledger.check_mac(message(sealed[0]), sealed[1])
        or ledger.check_signature(message(sealed[0]), sealed[2])
    ):
        log.warning(
            "ignoring the run snapshot %s: %s; the runs are rebuilt from the ledger",
            path,
            "it is not sealed" if sealed is None else "its seal does not match (edited?)",
        )
        return None
    try:
        snapshot = Snapshot.model_validate_json(sealed[0])
    except (ValidationError, ValueError) as exc:
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


def check(state_dir: Path, ledger: StampedLedger) -> str | None:
    """For `tally ledger verify` (any reader): why the snapshot would not be trusted, naming
    the file, or None if it is sealed by the checkpoint key and matches the ledger (or there is
    none). The daemon refuses such a file at start and rebuilds the runs from the ledger."""
    path = state_dir / FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path}: unreadable ({exc})"
    sealed = unseal(data)
    rebuilt = "the daemon rebuilds the runs from the ledger at its next start"
    if sealed is None:
        return f"{path}: not sealed (edited, or written by an older version): {rebuilt}"
    if not ledger.check_signature(message(sealed[0]), sealed[2]):
        return (
            f"{path}: its signature does not verify with checkpoint.vkey (edited?): the daemon "
            f"refuses it; {rebuilt}"
        )
    try:
        snapshot = Snapshot.model_validate_json(sealed[0])
    except (ValidationError, ValueError) as exc:
        return f"{path}: does not parse ({exc}): {rebuilt}"
    reason = mismatch(snapshot, ledger)
    if reason is not None:
        return f"{path}: does not match the ledger ({reason}): {rebuilt}"
    return None
