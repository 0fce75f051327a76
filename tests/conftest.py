"""Shared fixtures."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from daemon.slots import states as slot_states


def pytest_configure(config: pytest.Config) -> None:
    """The suite never reads a user's TALLY_* settings: `make test` passes while a daemon runs
    with TALLY_SOCKET, TALLY_STATE_DIR, TALLY_URL... exported. Tests that need one set it."""
    for name in [n for n in os.environ if n.startswith("TALLY_")]:
        del os.environ[name]
    # Nor a running daemon's default socket: `tally route`, `status`... look for the daemon in
    # the default runtime dir when no socket is given, so the session gets an empty one of its
    # own (a user's daemon on /run/user/UID or $XDG_RUNTIME_DIR is never reached).
    os.environ.pop("RUNTIME_DIRECTORY", None)
    os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tally-test-run-")
    # An illegal slot state change fails the test that made it (production logs it loudly).
    slot_states.STRICT = True


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test`'s two workers (`-n 2 --dist loadgroup`) share the suite as tests/workers.py
    says: the tests that start real model servers one after another on one worker."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from tests.workers import SharedWorkers

    return SharedWorkers(config, log)


@pytest.fixture(autouse=True)
def _record_vocabulary(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every body product code writes in a test is its kind's model in `daemon.record`, byte
    for byte: a kind written but not registered there fails the test that wrote it."""
    try:
        from tests.record.corpus import misfits, watching
    except ModuleNotFoundError as err:
        if err.name != "tests":
            raise
        yield  # a copy of this file outside the repository (tests/test_ci_honesty.py)
        return
    watch = watching(monkeypatch)
    yield
    found = misfits(watch)
    assert not found, "the record's vocabulary:\n" + "\n".join(found)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    return path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Under CI (`CI` set, as `.ci/run` does) a skipped test is a failure that names what is
    missing: CI installs everything the suite needs, so a skip there can only hide a problem
    (a missing npm tool, model package, bwrap, schemathesis...)."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI") and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, which must install what this test needs: {reason}"
