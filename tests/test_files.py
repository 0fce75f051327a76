"""The one atomic writer (daemon.files) and the state dir's one layout (daemon.layout): crash-
shaped cases (a writer killed before its rename, a failed write), rename atomicity under a
concurrent reader, permission bits of secrets, and every file a ledger and the state writers
create named in the layout."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from daemon import files, layout
from daemon.clients import ClientStore
from daemon.ledger import Ledger
from daemon.runs import snapshot
from daemon.slots.digest import DigestCache
from daemon.tls import ensure_self_signed
from roster.loading import write_atomic as write_roster
from surfaces.auth import load_or_create_token

# A child that dies (SIGKILL, as a power cut would stop it) after its temporary file is written
# and fsynced but before the rename.
KILLED_BEFORE_RENAME = """
import os, signal, sys
from pathlib import Path
from daemon import files
os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)
files.write_atomic(Path(sys.argv[1]), sys.argv[2])
"""


def dead_writer(path: Path, text: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", KILLED_BEFORE_RENAME, str(path), text],
        cwd=Path(__file__).resolve().parents[1],
        check=False,
        timeout=60,
    )
    assert done.returncode == -signal.SIGKILL


def test_a_writer_killed_before_its_rename_leaves_the_old_file_and_the_next_write_sweeps_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "meta.json"
    files.write_atomic(path, b'{"old":1}')
    dead_writer(path, '{"new":1}')
    assert json.loads(path.read_bytes()) == {"old": 1}  # never a part, never the new one
    [left] = files.temporaries(path)
    assert left.read_text() == '{"new":1}'  # the dead writer's whole temporary file
    assert left.stat().st_mode & 0o777 == 0o600
    files.write_atomic(path, b'{"next":1}')
    assert files.temporaries(path) == []  # its writer is gone: swept
    assert sorted(os.listdir(tmp_path)) == ["meta.json"]
    assert json.loads(path.read_bytes()) == {"next": 1}


def test_a_live_writers_temporary_file_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "clients.json"
    mine = path.with_name(f".{path.name}.{os.getpid()}.0badc0de.tmp")  # another thread's
    parent = path.with_name(f".{path.name}.{os.getppid()}.0badc0de.tmp")  # another process's
    other = path.with_name(f".other.json.{2**22 + 7}.0badc0de.tmp")  # another file's
    for tmp in (mine, parent, other):
        tmp.write_bytes(b"in progress")
    files.write_atomic(path, b"{}")
    assert set(files.temporaries(path)) == {mine, parent}
    assert other.exists()


def test_a_failed_write_removes_its_temporary_file_and_keeps_the_old_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "runs.snapshot.json"
    files.write_atomic(path, b"old")

    def full(fd: int, data: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="No space"):
        files.write_atomic(path, b"new" * 1000)
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["runs.snapshot.json"]


def test_a_failed_rename_removes_its_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "roster.toml"
    path.write_text("old")

    def refused(src: object, dst: object) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(OSError, match="disk on fire"):
        files.write_atomic(path, "new")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["roster.toml"]


def test_a_concurrent_reader_sees_the_old_or_the_new_file_never_a_part(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    versions = [bytes([65 + i]) * (256 * 1024) for i in range(2)]  # larger than one write
    files.write_atomic(path, versions[0])
    seen: set[bytes] = set()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            seen.add(path.read_bytes())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(40):
            files.write_atomic(path, versions[i % 2])
    finally:
        stop.set()
        reader.join(timeout=30)
    assert seen <= set(versions)
    assert seen  # it read at least once


def test_a_secret_is_never_readable_by_others_even_while_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = os.umask(0)  # the loosest umask: the bits come from the writer alone
    try:
        modes: list[int] = []
        real_write = os.write

        def watched(fd: int, data: bytes | memoryview) -> int:
            modes.append(os.fstat(fd).st_mode & 0o777)
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", watched)
        key = tmp_path / "checkpoint.key"
        files.write_atomic(key, b"secret")
        assert modes == [0o600]
        assert key.stat().st_mode & 0o777 == 0o600
        files.write_atomic(tmp_path / "checkpoint.vkey", b"public", mode=files.PUBLIC)
        assert (tmp_path / "checkpoint.vkey").stat().st_mode & 0o777 == 0o644
        assert modes == [0o600, 0o600]  # public only once complete
    finally:
        os.umask(old)


def test_mode_none_keeps_the_files_bits_and_follow_keeps_a_link(tmp_path: Path) -> None:
    target = tmp_path / "dotfiles" / "roster.toml"
    target.parent.mkdir()
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "roster.toml"
    link.symlink_to(target)
    write_roster(link, "new")
    assert link.is_symlink()
    assert target.read_text() == "new"
    assert target.stat().st_mode & 0o777 == 0o640
    fresh = tmp_path / "fresh.toml"
    files.write_atomic(fresh, "x", mode=None)
    assert fresh.stat().st_mode & 0o777 == files.PUBLIC
    files.write_atomic(link, "replaced")  # not following: the link itself is replaced
    assert not link.is_symlink()
    assert target.read_text() == "new"


def test_the_file_then_its_directory_are_fsynced_after_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "http.token"
    order: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        order.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    def replace(src: str | Path, dst: str | Path) -> None:
        order.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    files.write_atomic(path, "token\n")
    assert order == ["file", "rename", "dir"]


def undeclared(state_dir: Path) -> list[Path]:
    """The files and directories under `state_dir` that `daemon.layout` does not name."""
    out = []
    for path in state_dir.rglob("*"):
        rel = path.relative_to(state_dir).parts
        if rel[0] == layout.LEDGER and len(rel) == 3:
            ok = rel[1] == layout.TREE and rel[2] == layout.tree_level(int(rel[2][6:8]))
        elif rel[0] == layout.LEDGER and len(rel) == 2:
            ok = rel[1] in layout.LEDGER_FILES | {layout.TREE}
        elif rel[0] == layout.TLS and len(rel) == 2:
            ok = rel[1] in (layout.TLS_CERT, layout.TLS_KEY)
        else:
            ok = len(rel) == 1 and rel[0] in layout.STATE_FILES | layout.STATE_DIRS
        if not ok:
            out.append(path)
    return out


async def test_every_file_the_state_writers_create_is_named_in_the_layout(
    state_dir: Path,
) -> None:
    async with await Ledger.open(state_dir) as ledger:
        for i in range(3):
            await ledger.append(actor="t", kind="note", body={"i": i})
        await ledger.checkpoint()
    load_or_create_token(state_dir)
    ClientStore(state_dir).add("ci", "read")
    snapshot.save(state_dir, b"{}")
    model = state_dir.parent / "model.gguf"
    model.write_bytes(b"GGUF")
    DigestCache(state_dir).sha256(model)
    ensure_self_signed(state_dir, ["localhost"])

    assert undeclared(state_dir) == []
    # The secrets are the owner's alone.
    for secret in (
        state_dir / layout.HTTP_TOKEN,
        state_dir / layout.CLIENTS,
        state_dir / layout.RUNS_SNAPSHOT,
        state_dir / layout.TLS / layout.TLS_KEY,
        state_dir / layout.LEDGER / layout.CHECKPOINT_KEY,
    ):
        assert secret.stat().st_mode & 0o777 == 0o600, secret


def test_a_certificate_split_from_its_key_by_a_crash_is_made_again(state_dir: Path) -> None:
    """Two files, two renames: a crash between them pairs a new key with the old certificate."""
    cert, key = ensure_self_signed(state_dir, ["localhost"])
    old_cert = cert.read_bytes()
    other = state_dir.parent / "other"
    other.mkdir()
    _, other_key = ensure_self_signed(other, ["localhost"])
    files.write_atomic(key, other_key.read_bytes())  # the new key landed, its cert did not
    assert ensure_self_signed(state_dir, ["localhost"]) == (cert, key)
    assert cert.read_bytes() != old_cert  # made again: the pair loads together
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    assert key.stat().st_mode & 0o777 == 0o600


# --- every file name is spelled once: in daemon.layout -------------------------------------

REPO = Path(__file__).resolve().parents[1]
# The layout's names that are file names through and through (a dot in them): one of these as
# a string anywhere in product code is a second spelling of it.
_FILE_NAMES = frozenset(
    value
    for name, value in vars(layout).items()
    if name.isupper() and isinstance(value, str) and "." in value
)
# Every name the layout declares: as an operand of `/` (a path being joined) a plain word such
# as "ledger", "logs" or "lock" is one too (elsewhere it is just a word: a command, a field).
_ALL_NAMES = frozenset(
    value for name, value in vars(layout).items() if name.isupper() and isinstance(value, str)
)
_STILL_SPELLED: set[tuple[str, str]] = set()


def layout_literals(source: str) -> list[tuple[int, str]]:
    """(line, name) of each file name of the layout spelled as a literal in `source`."""
    import ast

    found: list[tuple[int, str]] = []
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    joined = {
        id(side)
        for node in ast.walk(tree)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
        for side in (node.left, node.right)
    }
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
            continue
        if id(node) in docstrings:
            continue
        if node.value in _FILE_NAMES or (id(node) in joined and node.value in _ALL_NAMES):
            found.append((node.lineno, node.value))
    return found


def test_product_code_takes_every_file_name_from_the_layout() -> None:
    spelled = []
    for path in sorted([*REPO.glob("daemon/**/*.py"), *REPO.glob("surfaces/**/*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if rel == "daemon/layout.py":
            continue
        for line, name in layout_literals(path.read_text()):
            if (rel, name) not in _STILL_SPELLED:
                spelled.append(f"{rel}:{line}: {name!r} (use daemon.layout)")
    assert spelled == [], "\n".join(spelled)


def test_the_literal_check_can_fail() -> None:
    caught = layout_literals('root / "ledger" / "entries.jsonl"\nopen("http.token")\n')
    assert sorted(caught) == [(1, "entries.jsonl"), (1, "ledger"), (2, "http.token")]
    assert layout_literals('"""meta.json"""\nparser.add_parser("ledger")\n') == []
