"""Durable file writes: every small file tally writes whole (state, keys, roster, snapshots).

The lowest layer of the code: it imports only the standard library, so the roster, the ledger
and the surfaces all write through it and a file tally writes has one set of guarantees:

- a reader (or a crash, or a power cut) sees the old content or the new one, never a part:
  a temporary file in the same directory, written, fsynced, renamed over the target, and the
  directory fsynced so the rename itself survives;
- the temporary file is created 0600 and gets its final mode before the rename, so a secret
  is never readable by others, not even for an instant;
- a failed write (a full disk, a quota) removes its temporary file: it must not keep the space;
- a crash between create and rename leaves a `.NAME.PID.RANDOM.tmp` file. No reader ever opens
  one, and the next write of the same file removes those whose process is gone (the PID in the
  name), so they do not pile up; a live writer's temporary file is never touched.

Files appended to or patched in place (the ledger's entries, journal, pack) are not written
here: `daemon.ledger.store` owns those.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path

PUBLIC = 0o644  # a file anyone may read: a verifying key, a checkpoint, the roster
PRIVATE = 0o600  # the default: state, keys, tokens


def fsync_dir(path: Path) -> None:
    """fsync a directory, so the entries created or renamed in it survive a power cut."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_dir(path: Path) -> None:
    """mkdir (0700, with its parents) + fsync of the parent, so the new directory survives."""
    if not path.exists():
        path.mkdir(mode=0o700, parents=True)
        fsync_dir(path.parent)


def write_atomic(
    path: Path, data: bytes | str, mode: int | None = PRIVATE, *, follow: bool = False
) -> None:
    """Replace `path` with `data` (str is UTF-8), so a crash leaves the old or the new content.

    `mode`: the file's permission bits; None keeps the existing file's (PUBLIC for a new file:
    a file a person edits, like the roster). `follow`: a symlink at `path` stays a link and its
    target is replaced (a person's dotfiles); otherwise the link itself is replaced.
    """
    if follow:
        path = Path(os.path.realpath(path))
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = PUBLIC
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)  # after the bytes: a secret is written while the file is 0600
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)
    sweep(path)


def temporaries(path: Path) -> list[Path]:
    """The temporary files of writes of `path` that have not (yet) been renamed over it."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.[0-9a-f]+\.tmp")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    return [path.with_name(n) for n in sorted(names) if pattern.fullmatch(n)]


def sweep(path: Path) -> None:
    """Remove the temporary files of `path` left by writers that died before their rename.

    Best effort: a file that cannot be removed stays, and is still never read.
    """
    for tmp in temporaries(path):
        pid = int(tmp.name[len(path.name) + 2 :].split(".", 1)[0])
        if pid == os.getpid() or _alive(pid):
            continue  # a write in progress (this process's other threads, or another process)
        with contextlib.suppress(OSError):
            tmp.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    return True
