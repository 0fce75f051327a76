"""Snapshots and patches on real directories and real git: identity, hiding, refusals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from daemon.errors import Forbidden, InvalidInput
from daemon.ledger.canonical import check_json
from daemon.workspace import patch as workspace_patch
from daemon.workspace.record import PatchBody
from daemon.workspace.snapshot import allowed, take
from daemon.workspace.view import RunDirs, hashes
from roster.models import WorkspacePolicy
from tests.workspace.repo import FIXED, git, project

POLICY = WorkspacePolicy()


def test_a_git_snapshot_is_head_plus_the_uncommitted_changes(tmp_path: Path) -> None:
    ws = project(tmp_path)
    head = git(ws, "rev-parse", "HEAD").strip()
    clean = take(ws, POLICY, tmp_path / "b1")
    assert (clean.kind, clean.head, clean.dirty) == ("git", head, None)
    assert clean.hidden == 2  # .env and deploy.pem are never copied
    assert sorted(os.listdir(tmp_path / "b1")) == [".gitignore", "calc.py", "test_calc.py"]
    (ws / "calc.py").write_text(FIXED)
    dirty = take(ws, POLICY, tmp_path / "b2")
    assert dirty.head == head
    assert dirty.dirty is not None
    assert dirty.content != clean.content
    (ws / ".env").write_text("SECRET=changed\n")  # hidden: not part of what tasks see
    again = take(ws, POLICY, tmp_path / "b3")
    assert (again.dirty, again.content) == (dirty.dirty, dirty.content)


def test_a_plain_dir_snapshot_hashes_its_visible_files_and_drops_links_out(tmp_path: Path) -> None:
    ws = project(tmp_path, repo=False)
    secret = tmp_path / "outside.txt"
    secret.write_text("not for tasks\n")
    (ws / "out").symlink_to(secret)
    (ws / "up").symlink_to("../outside.txt")
    (ws / "same").symlink_to("calc.py")
    body = take(ws, POLICY, tmp_path / "base")
    assert body.kind == "files"
    assert body.head is None
    assert sorted(os.listdir(tmp_path / "base")) == ["calc.py", "same", "test_calc.py"]
    assert len(body.skipped) == 2
    assert all("symlink out" in s for s in body.skipped)


@pytest.mark.parametrize("repo", [True, False])
def test_a_name_that_is_not_utf8_is_left_out_and_said(tmp_path: Path, repo: bool) -> None:
    # A new user's workspace with such a file failed every chat task: its listing went into a
    # model.call entry the ledger cannot store. It is left out of the copy, like a link out.
    ws = project(tmp_path, repo=repo)
    raw = os.fsencode(ws) + b"/bad\xffname.txt"
    with open(raw, "wb") as f:
        f.write(b"x\n")
    if repo:
        git(ws, "add", "-A")
        git(ws, "commit", "-qm", "bad name")
    body = take(ws, POLICY, tmp_path / "base")
    check_json(body.model_dump())  # storable: the record holds no lone surrogate
    assert "calc.py" in os.listdir(tmp_path / "base")
    assert not any(n.startswith("bad") for n in os.listdir(tmp_path / "base"))
    assert body.skipped == ["b'bad\\xffname.txt': a name that is not UTF-8"]
    if repo:
        assert body.dirty is None  # left out is not "deleted": the commit is all there is


def test_caps_and_roots_are_refused_with_the_setting_named(tmp_path: Path) -> None:
    ws = project(tmp_path)
    with pytest.raises(InvalidInput, match="max_files"):
        take(ws, WorkspacePolicy(max_files=2), tmp_path / "b")
    with pytest.raises(InvalidInput, match="max_bytes"):
        take(ws, WorkspacePolicy(max_bytes=10), tmp_path / "c")
    with pytest.raises(Forbidden, match="--workspace-root"):
        allowed(str(ws), [])
    with pytest.raises(Forbidden, match="not inside an allowed root"):
        allowed(str(ws), [tmp_path / "elsewhere"])
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "link").symlink_to(ws)  # resolved: the link does not let it in
    with pytest.raises(Forbidden):
        allowed(str(tmp_path / "elsewhere" / "link"), [tmp_path / "elsewhere"])
    with pytest.raises(Forbidden, match="must never see"):
        allowed(str(tmp_path), [tmp_path], hidden=(ws / "state",))
    assert allowed(str(ws), [tmp_path]) == Path(os.path.realpath(ws))


def _patch_for(tmp_path: Path, ws: Path) -> PatchBody:
    """The patch a task fixing calc.py makes, through the run dirs tally uses."""
    space = RunDirs(tmp_path / "tasks", "rtest")
    space.prepare(POLICY.hide)
    take(ws, POLICY, space.base)
    view = space.open("v", [], workspace=True)
    (view.path / "calc.py").write_text(FIXED)
    diff, files = space.capture(view)
    combined = space.combine([diff])
    assert combined.files == files == ["calc.py"]
    return PatchBody(
        patch=combined.diff,
        files=combined.files,
        tasks=["t"],
        before=combined.before,
        after=combined.after,
    )


def test_a_patch_applies_once_and_refuses_a_workspace_changed_under_it(tmp_path: Path) -> None:
    ws = project(tmp_path)
    body = _patch_for(tmp_path, ws)
    (ws / "calc.py").write_text("def add(a, b):\n    return 0\n")
    with pytest.raises(workspace_patch.ApplyRefused, match="changed since the run's snapshot"):
        workspace_patch.apply(ws, body, check=True)
    git(ws, "checkout", "--", "calc.py")
    assert workspace_patch.apply(ws, body, check=True).method == "git-3way"
    assert (ws / "calc.py").read_text() != FIXED  # a check writes nothing
    assert workspace_patch.apply(ws, body, check=False).method == "git-3way"
    assert (ws / "calc.py").read_text() == FIXED
    assert workspace_patch.apply(ws, body, check=False).already


def test_a_committed_change_still_refuses_and_the_advice_is_stash_not_commit(
    tmp_path: Path,
) -> None:
    # The check compares the files with the snapshot, so committing a change leaves it stale:
    # the message must not send the user to commit (a new user tried that; it still refused).
    ws = project(tmp_path)
    body = _patch_for(tmp_path, ws)
    (ws / "calc.py").write_text("def add(a, b):\n    return 0\n")
    git(ws, "commit", "-qam", "mine")
    with pytest.raises(workspace_patch.ApplyRefused) as refused:
        workspace_patch.apply(ws, body, check=True)
    assert "git stash" in str(refused.value)
    assert "committing them does not help" in str(refused.value)


def _evil(name: str) -> PatchBody:
    diff = (
        f"diff --git a/{name} b/{name}\nnew file mode 100644\n--- /dev/null\n+++ b/{name}\n"
        "@@ -0,0 +1 @@\n+owned\n"
    )
    return PatchBody(patch=diff, files=[name], tasks=["t"], before={name: None}, after={})


@pytest.mark.parametrize("name", ["../escape.txt", "/tmp/tally-escape.txt", "a/../../escape.txt"])
def test_a_patch_with_a_path_out_of_the_workspace_is_refused(tmp_path: Path, name: str) -> None:
    ws = project(tmp_path, repo=False)
    with pytest.raises(workspace_patch.ApplyRefused):
        workspace_patch.apply(ws, _evil(name), check=False)
    assert not (tmp_path / "escape.txt").exists()
    assert not Path("/tmp/tally-escape.txt").exists()


def test_a_patch_through_a_symlink_out_is_refused(tmp_path: Path) -> None:
    ws = project(tmp_path, repo=False)
    outside = tmp_path / "outside"
    outside.mkdir()
    (ws / "link").symlink_to(outside)
    with pytest.raises(workspace_patch.ApplyRefused, match="symlink"):
        workspace_patch.apply(ws, _evil("link/x.txt"), check=False)
    assert list(outside.iterdir()) == []
    link = (
        "diff --git a/l b/l\nnew file mode 120000\n--- /dev/null\n+++ b/l\n@@ -0,0 +1 @@\n"
        "+/etc\n\\ No newline at end of file\n"
    )
    body = PatchBody(patch=link, files=["l"], tasks=["t"], before={"l": None}, after={})
    with pytest.raises(workspace_patch.ApplyRefused, match="symlink"):
        workspace_patch.apply(ws, body, check=False)
    assert hashes(ws, ["l"]) == {"l": None}


@pytest.mark.parametrize("merge_driver", [False, True])
def test_a_repository_s_own_filters_and_merge_driver_never_run(
    tmp_path: Path, merge_driver: bool
) -> None:
    # `git apply` reads and writes the working files through the repository's content
    # filters (`.git/config` names the command, attributes pick it): a hostile workspace once
    # ran its clean and smudge commands as the daemon when a run's patch was applied.
    ws = project(tmp_path)
    body = _patch_for(tmp_path, ws)
    marks = tmp_path / "marks"
    marks.mkdir()
    drivers = ["evil", "we.ird=x"]
    (ws / ".git" / "info" / "attributes").write_text(
        "".join(f"* filter={d} merge={d}\n" for d in drivers)
    )
    for number, driver in enumerate(drivers):
        for key in ("clean", "smudge", "process"):
            git(ws, "config", f"filter.{driver}.{key}", f"touch {marks}/{key}{number}; cat")
        git(ws, "config", f"filter.{driver}.required", "true")
        if merge_driver:
            git(ws, "config", f"merge.{driver}.driver", f"touch {marks}/merge{number}; false")
    assert workspace_patch.apply(ws, body, check=True).files == ["calc.py"]
    applied = workspace_patch.apply(ws, body, check=False)
    assert applied.method == ("git-apply" if merge_driver else "git-3way")
    assert (ws / "calc.py").read_text() == FIXED
    assert sorted(os.listdir(marks)) == []


@pytest.mark.parametrize("swap", ["dir", "file", "fifo"])
def test_a_path_swapped_for_a_link_between_listing_and_copy_is_refused(
    tmp_path: Path, swap: str
) -> None:
    # The race: a process swaps a listed directory (or file) for a symlink out of the
    # workspace after the listing; `cp a/b/file` once followed it and copied what it names.
    from daemon.workspace import snapshot

    secret = tmp_path / "secret"
    (secret / "sub").mkdir(parents=True)
    (secret / "sub" / "key.txt").write_text("the daemon's secret\n")
    ws = project(tmp_path, repo=False)
    (ws / "sub").mkdir()
    (ws / "sub" / "key.txt").write_text("harmless\n")
    listing = snapshot._Listing()
    for name in snapshot._walk(ws):
        snapshot._classify(ws, name, POLICY, listing)
    assert "sub/key.txt" in listing.files
    if swap == "dir":
        os.rename(ws / "sub", tmp_path / "moved")
        (ws / "sub").symlink_to(secret / "sub")
    elif swap == "file":
        (ws / "sub" / "key.txt").unlink()
        (ws / "sub" / "key.txt").symlink_to(secret / "sub" / "key.txt")
    else:
        (ws / "sub" / "key.txt").unlink()
        os.mkfifo(ws / "sub" / "key.txt")
    base = tmp_path / "base"
    base.mkdir()
    with pytest.raises(InvalidInput, match=r"'sub/key\.txt' changed while it was copied"):
        snapshot._copy(ws, base, listing.files, listing.identity)
    copied = [p.read_text() for p in base.rglob("*") if p.is_file()]
    assert "the daemon's secret\n" not in copied


def test_the_copy_keeps_modes_times_and_bytes(tmp_path: Path) -> None:
    ws = project(tmp_path, repo=False)
    tool = ws / "bin" / "run.sh"
    tool.parent.mkdir()
    tool.write_bytes(b"#!/bin/sh\necho \x00binary\n")
    tool.chmod(0o755)
    os.utime(tool, ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    space = RunDirs(tmp_path / "tasks", "rcopy")
    space.prepare(POLICY.hide)
    take(ws, POLICY, space.base)
    copied = space.base / "bin" / "run.sh"
    assert copied.read_bytes() == tool.read_bytes()
    assert copied.stat().st_mode & 0o777 == 0o755
    assert copied.stat().st_mtime_ns == 1_600_000_000_000_000_000


def test_a_workspace_swapped_for_a_link_after_it_was_allowed_is_refused(tmp_path: Path) -> None:
    ws = project(tmp_path, repo=False)
    real = allowed(str(ws), [tmp_path])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.txt").write_text("not the workspace's\n")
    os.rename(ws, tmp_path / "moved")
    ws.symlink_to(elsewhere)  # the path `allowed` resolved now leads elsewhere
    with pytest.raises(InvalidInput, match="now goes through a symlink"):
        take(real, POLICY, tmp_path / "base")
    assert not (tmp_path / "base").exists()
