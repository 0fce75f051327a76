"""Taking a workspace's snapshot: its visible files copied into a base dir, and its identity.

Visible: in a git repository, the tracked and untracked-but-not-ignored files; elsewhere every
file (no `.git` dirs). Never: a path matching `hide`, a special file, a symlink whose target
leaves the workspace (kept only when it is relative and stays inside). The copy is made
first (a reflink where the file system shares blocks, else a copy) and the identity is hashed
from the copy, so what is witnessed is exactly what the tasks see.

The copy opens each file one directory at a time without following a symlink, and takes it
only if it is the very file (device, inode) that was listed: a directory swapped for a link
to /etc between the listing and the copy (a process racing the snapshot) is refused, where
`cp a/b/file` would have followed it and copied what the link names.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from daemon.errors import Forbidden, InvalidInput
from daemon.workspace.git import git, toplevel
from daemon.workspace.paths import inside, is_hidden
from daemon.workspace.record import SnapshotBody
from roster.models import WorkspacePolicy

FICLONE = 0x40049409
"""ioctl: make the destination share the source's blocks (btrfs, XFS; else EOPNOTSUPP)."""
CHUNK = 1 << 20


def allowed(path: str, roots: list[Path], hidden: tuple[Path, ...] = ()) -> Path:
    """The workspace's real path, if it is a directory inside an allowed root and holds none
    of the daemon's own dirs; else Forbidden/InvalidInput naming the setting."""
    if not path or "\x00" in path or not path.startswith("/"):
        raise InvalidInput(f"workspace {path[:200]!r}: give an absolute directory path")
    real = Path(os.path.realpath(path))
    if not roots:
        raise Forbidden(
            f"workspace {path!r}: no workspace roots are allowed; the operator allows one with "
            "`tally serve --workspace-root DIR` or `[policy.workspace] roots` in the roster",
            details={"workspace": path, "setting": "[policy.workspace] roots"},
        )
    if not any(inside(real, root) for root in roots):
        listing = ", ".join(str(r) for r in roots[:10])
        raise Forbidden(
            f"workspace {path!r} ({real}) is not inside an allowed root ({listing}); allow it "
            "with `tally serve --workspace-root DIR` or `[policy.workspace] roots`",
            details={"workspace": path, "setting": "[policy.workspace] roots"},
        )
    if not real.is_dir():
        raise InvalidInput(f"workspace {path!r}: not a directory", details={"workspace": path})
    for h in hidden:
        if inside(h, real):
            raise Forbidden(
                f"workspace {path!r} holds {h}, which tasks must never see: name a "
                "directory below it",
                details={"workspace": path},
            )
    return real


@dataclass
class _Listing:
    files: list[str] = field(default_factory=list)
    identity: dict[str, tuple[int, int]] = field(default_factory=dict)
    """(device, inode) of each listed file, as the listing saw it."""
    links: list[tuple[str, str]] = field(default_factory=list)
    hidden: int = 0
    skipped: list[str] = field(default_factory=list)
    bytes: int = 0


def take(workspace: Path, policy: WorkspacePolicy, base: Path) -> SnapshotBody:
    """Copy the workspace's visible files into `base` (created) and return their identity."""
    _unmoved(workspace)  # as `allowed` resolved it: no link on its way now either
    top = toplevel(workspace)
    names = _git_names(workspace) if top is not None else _walk(workspace)
    listing = _Listing()
    for name in names:
        _classify(workspace, name, policy, listing)
        if len(listing.files) + len(listing.links) > policy.max_files:
            raise InvalidInput(
                f"workspace {workspace} has more than {policy.max_files} visible files "
                "([policy.workspace] max_files): name a smaller directory",
                details={"workspace": str(workspace)},
            )
        if listing.bytes > policy.max_bytes:
            raise InvalidInput(
                f"workspace {workspace} holds more than {policy.max_bytes} bytes of visible "
                "files ([policy.workspace] max_bytes): name a smaller directory",
                details={"workspace": str(workspace)},
            )
    base.mkdir(parents=True, exist_ok=False, mode=0o700)
    _copy(workspace, base, listing.files, listing.identity)
    for name, target in listing.links:
        link = base / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, link)
    manifest, hashes = manifest_of(base)
    head, dirty = (None, None)
    if top is not None:
        head, dirty = _git_identity(workspace, base, hashes, policy)
    return SnapshotBody(
        path=str(workspace),
        kind="git" if top is not None else "files",
        head=head,
        dirty=dirty,
        content=manifest,
        files=len(hashes),
        bytes=listing.bytes,
        hidden=listing.hidden,
        skipped=listing.skipped[:50],
    )


def _git_names(workspace: Path) -> list[str]:
    done = git(["ls-files", "-z", "-c", "-o", "--exclude-standard"], workspace)
    names = [n.decode("utf-8", "surrogateescape") for n in done.stdout.split(b"\0") if n]
    return sorted(set(names))


def _walk(workspace: Path) -> list[str]:
    names: list[str] = []
    for dirpath, dirnames, filenames in os.walk(workspace, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d != ".git")
        rel = os.path.relpath(dirpath, workspace)
        for name in filenames:
            names.append(name if rel == "." else f"{rel}/{name}")
        for name in dirnames[:]:
            full = os.path.join(dirpath, name)
            if os.path.islink(full):  # os.walk lists a link to a dir among dirs
                names.append(name if rel == "." else f"{rel}/{name}")
                dirnames.remove(name)
    return sorted(names)


def _utf8(name: str) -> bool:
    """Whether a name (decoded with surrogateescape) is valid UTF-8: only such a name can be
    shown to a model, written in the record or named in a patch."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _classify(workspace: Path, name: str, policy: WorkspacePolicy, listing: _Listing) -> None:
    if is_hidden(name, policy.hide):
        listing.hidden += 1
        return
    if not _utf8(name):  # it once failed every chat task: its listing could not be recorded
        raw = name.encode("utf-8", "surrogateescape")
        listing.skipped.append(f"{raw!r}: a name that is not UTF-8")
        return
    full = workspace / name
    try:
        info = full.lstat()
    except OSError:
        return  # listed by git, deleted since: part of the uncommitted changes
    if stat.S_ISLNK(info.st_mode):
        target = os.readlink(full)
        resolved = os.path.normpath(os.path.join(os.path.dirname(name), target))
        if target.startswith("/") or resolved.startswith("..") or not inside(full, workspace):
            listing.skipped.append(f"{name}: a symlink out of the workspace")
        else:
            listing.links.append((name, target))
        return
    if not stat.S_ISREG(info.st_mode):
        listing.skipped.append(f"{name}: not a regular file")
        return
    listing.files.append(name)
    listing.identity[name] = (info.st_dev, info.st_ino)
    listing.bytes += info.st_size


def _copy(
    workspace: Path, base: Path, names: list[str], identity: dict[str, tuple[int, int]]
) -> None:
    root = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _unmoved(workspace)  # the dir just opened is the one allowed: files are read from it
        for name in names:
            try:
                _copy_one(root, base, name, identity[name])
            except OSError as err:
                why = "a symlink" if err.errno == errno.ELOOP else err.strerror
                raise InvalidInput(
                    f"workspace {workspace}: {name!r} changed while it was copied ({why}); "
                    "submit again once nothing is changing it",
                    details={"workspace": str(workspace), "file": name},
                ) from None
    finally:
        os.close(root)


def _unmoved(workspace: Path) -> None:
    """InvalidInput if a directory on the workspace's (resolved) path was swapped for a link
    since it was allowed: its files would be read from wherever the link points."""
    if os.path.realpath(workspace) != str(workspace):
        raise InvalidInput(
            f"workspace {workspace}: its path now goes through a symlink (it changed after it "
            "was allowed); submit again",
            details={"workspace": str(workspace)},
        )


def _copy_one(root: int, base: Path, name: str, listed: tuple[int, int]) -> None:
    """Copy one listed file, reached from the workspace's fd with no symlink followed."""
    parts = name.split("/")
    opened: list[int] = []
    at = root
    try:
        for part in parts[:-1]:
            at = os.open(
                part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=at
            )
            opened.append(at)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        src = os.open(parts[-1], flags, dir_fd=at)
    finally:
        for fd in opened:
            os.close(fd)
    try:
        st = os.fstat(src)
        if (st.st_dev, st.st_ino) != listed or not stat.S_ISREG(st.st_mode):
            raise OSError(errno.ESTALE, "another file than the one listed")
        target = base / name
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _clone(src, dst, st.st_size)
            os.fchmod(dst, st.st_mode & 0o777)
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _clone(src: int, dst: int, size: int) -> None:
    """The source's bytes into dst: shared blocks where the file system can, else a copy of
    at most `size` bytes (a file that grows while it is copied is cut where it was listed)."""
    try:
        fcntl.ioctl(dst, FICLONE, src)
        if os.fstat(dst).st_size > size:
            os.ftruncate(dst, size)
        return
    except OSError:
        pass  # not a copy-on-write file system (or another one): copy the bytes
    left = size
    while left > 0:
        chunk = os.read(src, min(CHUNK, left))
        if not chunk:
            break
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view) :]
        left -= len(chunk)


def manifest_of(root: Path) -> tuple[str, dict[str, str]]:
    """(SHA-256 of the manifest, {path: content SHA-256}) of every file and link under root."""
    hashes: dict[str, str] = {}
    lines: list[bytes] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames) + [
            d for d in dirnames if os.path.islink(os.path.join(dirpath, d))
        ]:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if os.path.islink(full):
                digest = hashlib.sha256(os.readlink(full).encode()).hexdigest()
                mode = "link"
            else:
                digest = file_sha256(Path(full))
                mode = "exec" if os.stat(full).st_mode & 0o100 else "file"
            hashes[rel] = digest
            lines.append(f"{rel}\0{mode}\0{digest}\n".encode("utf-8", "surrogateescape"))
    lines.sort()
    return hashlib.sha256(b"".join(lines)).hexdigest(), hashes


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _git_identity(
    workspace: Path, base: Path, hashes: dict[str, str], policy: WorkspacePolicy
) -> tuple[str | None, str | None]:
    """HEAD, and the SHA-256 of the visible uncommitted changes (None: none), read with
    plumbing only (no filters or drivers run) and compared blob by blob with the copy."""
    found = git(["rev-parse", "--verify", "-q", "HEAD"], workspace, check=False)
    head = found.stdout.decode().strip() if found.returncode == 0 else None
    committed: dict[str, str] = {}
    if head is not None:
        tree = git(["ls-tree", "-r", "-z", "HEAD"], workspace).stdout
        for record in tree.split(b"\0"):
            if not record:
                continue
            meta, _, raw = record.partition(b"\t")
            parts = meta.split()
            if len(parts) == 3 and parts[1] == b"blob":
                committed[raw.decode("utf-8", "surrogateescape")] = parts[2].decode()
    changes: list[str] = []
    for name in sorted(hashes):
        blob = blob_id(base / name)
        if committed.get(name) != blob:
            changes.append(f"{name}\0{blob}")
    for name in sorted(set(committed) - set(hashes)):
        if not is_hidden(name, policy.hide) and _utf8(name):  # both left out of the copy
            changes.append(f"{name}\0deleted")
    if not changes:
        return head, None
    return head, hashlib.sha256("\n".join(changes).encode("utf-8", "surrogateescape")).hexdigest()


def blob_id(path: Path) -> str:
    """git's object id of a file's content (SHA-1 of `blob <size>\\0<content>`)."""
    data = os.readlink(path).encode() if path.is_symlink() else path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
