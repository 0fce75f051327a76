"""`DiskQuota` measures any directory a task writes (its own dir, or a workspace view bound
into the sandbox): real files on the real filesystem, no sandbox needed."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from daemon.runs.limits import MB, DiskQuota, detect_memory_cgroup, disk_usage
from daemon.runs.sandbox import address_space_mb, remove_task_dir, tmpfs_sizes
from roster.models import CommandPolicy


def _write(path: Path, size: int) -> None:
    path.write_bytes(b"\x01" * size)


def test_usage_counts_allocated_bytes_once_and_follows_no_link(tmp_path: Path) -> None:
    tree = tmp_path / "view"
    (tree / "a" / "b").mkdir(parents=True)
    _write(tree / "a" / "b" / "one", 3 * MB)
    os.link(tree / "a" / "b" / "one", tree / "hardlink")  # the same blocks: counted once
    outside = tmp_path / "outside"
    _write(outside, 8 * MB)
    (tree / "link").symlink_to(outside)  # not followed
    with (tree / "sparse").open("wb") as sparse:  # 1 GiB apparent, nothing allocated
        sparse.truncate(1 << 30)
    used = disk_usage(tree)
    assert used.complete
    assert used.entries == 6  # a, a/b, a/b/one, hardlink, link, sparse
    assert 3 * MB <= used.bytes < 3 * MB + 64 * 1024


def test_a_quota_names_the_limit_it_is_past(tmp_path: Path) -> None:
    quota = DiskQuota(tmp_path, max_bytes=2 * MB, max_entries=10, label="the view")
    _write(tmp_path / "f", MB)
    assert quota.check() is None
    _write(tmp_path / "g", 2 * MB)
    message = quota.check()
    assert message is not None
    assert "disk quota of 2 MiB in the view ([policy.command] disk_mb)" in message
    for i in range(20):
        (tmp_path / f"empty{i}").touch()
    files = DiskQuota(tmp_path, max_bytes=1 << 40, max_entries=10, entries_setting="the view's cap")
    assert (
        files.check()
        == "the task exceeded its quota of 10 files and dirs in its working dir (the view's cap)"
    )


def test_a_walk_of_a_hostile_tree_stops_at_the_limit(tmp_path: Path) -> None:
    for i in range(300):
        (tmp_path / f"f{i}").touch()
    used = disk_usage(tmp_path, stop_entries=50)
    assert not used.complete
    assert used.entries == 51


async def test_watch_reports_a_writer_soon_after_it_passes(tmp_path: Path) -> None:
    """The writer runs in a thread, as a task would in its own process; the watch returns
    once the total is past the quota, having called back exactly once."""
    stop = threading.Event()
    written: list[int] = []

    def writer() -> None:
        i = 0
        while not stop.is_set() and i < 500:
            _write(tmp_path / f"chunk{i}", MB)
            i += 1
            written.append(i)
            stop.wait(0.005)

    calls: list[str] = []
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        message = await asyncio.wait_for(
            DiskQuota(tmp_path, 8 * MB, 10_000).watch(calls.append), 20
        )
    finally:
        stop.set()
        thread.join()
    assert calls == [message]
    assert "8 MiB" in message
    assert 8 <= written[-1] < 500


def test_the_cgroup_probe_answers_either_way() -> None:
    """On a machine without a reachable systemd manager (containers, this CI) the probe says
    why there is no cgroup limit; with one, it names the mechanism. It never raises."""
    cgroup, said = detect_memory_cgroup()
    if cgroup is None:
        assert said.startswith("no cgroup memory limit: ")
    else:
        assert "MemoryMax" in said
        assert cgroup.prefix(64)[-5:] == [
            "-p",
            f"MemoryMax={64 * MB}",
            "-p",
            "MemorySwapMax=0",
            "--",
        ]


def test_the_in_memory_dirs_are_a_share_of_memory_mb() -> None:
    """tmpfs sizes add up to `tmpfs_mb` (a quarter of `memory_mb` by default), and what is
    left is each process's address space; a share that leaves too little is refused."""
    for policy in (
        CommandPolicy(),
        CommandPolicy(memory_mb=16),
        CommandPolicy(memory_mb=512, tmpfs_mb=100),
    ):
        sizes = tmpfs_sizes(policy)
        assert sum(sizes.values()) == policy.tmpfs_total_mb * MB
        assert all(size > 0 and size % 4096 == 0 for size in sizes.values())
        assert address_space_mb(policy) + policy.tmpfs_total_mb == policy.memory_mb
    assert CommandPolicy().tmpfs_total_mb == 512
    assert address_space_mb(CommandPolicy(sandbox="none")) == 2048  # no tmpfs: all of it
    with pytest.raises(ValidationError, match="leaves less than 12 MiB of memory_mb = 64"):
        CommandPolicy(memory_mb=64, tmpfs_mb=60)


def test_a_tree_too_deep_to_measure_is_past_the_quota(tmp_path: Path) -> None:
    """A task can nest dirs past PATH_MAX (by relative paths): what lies below cannot be
    measured by path, so the quota names it rather than count it as nothing."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1100):  # > PATH_MAX, and deeper than shutil.rmtree's recursion
            os.mkdir("dir", dir_fd=fd)
            deeper = os.open("dir", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = deeper
        hidden = os.open("hidden", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd)
        os.write(hidden, b"\x01" * (4 * MB))
        os.close(hidden)
    finally:
        os.close(fd)
    try:
        used = disk_usage(tmp_path)
        assert used.unmeasured == os.strerror(errno.ENAMETOOLONG)
        message = DiskQuota(tmp_path, 64 * MB, 100_000).check()
        assert message is not None
        assert "unreadable to its disk quota check (File name too long)" in message
    finally:
        # deeper than shutil.rmtree's recursion: the task dir's own remover takes it
        remove_task_dir(tmp_path)
    assert not tmp_path.exists()
