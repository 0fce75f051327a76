"""A verifier never writes, and names what was edited: every kind of edit to a stopped ledger's
files is named by `tally ledger verify` with its first seq (or is a derived file the record
rebuilds), no read-only command changes a byte of the state dir, and the owner's open restores
only what a crash can leave: anything else it refuses, naming the seq, and changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import io
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.ledger import Ledger, LedgerCorrupt
from surfaces.cli import main
from tests.ledger.files import hashes

N = 1000
RECORD = ("ledger/entries.jsonl", "ledger/bodies.pack", "ledger/wal", "ledger/checkpoint")


async def build(state_dir: Path, n: int, bodies_every: int = 3) -> None:
    """A stopped ledger as the daemon leaves it: `n` entries by actor "a" in batches of 50,
    every `bodies_every`-th with a body, checkpointed, closed cleanly (the journal rotated)."""
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    for start in range(0, n, 50):
        await asyncio.gather(
            *(
                ledger.append(
                    actor="a", kind="note", body={"i": i} if i % bodies_every == 0 else None
                )
                for i in range(start, min(n, start + 50))
            )
        )
        if start == n // 2:
            await ledger.checkpoint()
    await ledger.close()


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    state = tmp_path_factory.mktemp("evidence") / "state"
    state.mkdir()
    asyncio.run(build(state, N))
    return state


@pytest.fixture
def stopped(template: Path, tmp_path: Path) -> Path:
    state = tmp_path / "state"
    shutil.copytree(template, state)
    return state


def run_cli(*argv: str) -> tuple[int, str, str]:
    """`tally …` in this process, its stdout and stderr captured (no traceback may reach them)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


READERS = (
    ("ledger", "verify"),
    ("ledger", "verify", "--deep"),
    ("ledger", "verify", "--json"),
    ("ledger", "get", "10"),
    ("ledger", "show", "--tail", "3"),
    ("ledger", "proof", "inclusion", "10"),
    ("ledger", "checkpoint"),
)


QUICK = (READERS[0], READERS[1], READERS[3], READERS[5])


def read_only_everything(
    state: Path, commands: tuple[tuple[str, ...], ...] = READERS
) -> dict[tuple[str, ...], str]:
    """Read-only commands on `state`; asserts none changed a byte and none printed a
    traceback. Returns each command's output."""
    before = hashes(state)
    outputs = {}
    for argv in commands:
        code, out, err = run_cli(*argv, "--state", str(state))
        assert "Traceback" not in out + err, (argv, out, err)
        assert code in (0, 1), (argv, code, out, err)
        outputs[argv] = out
    assert hashes(state) == before, "a read-only command changed the state dir"
    return outputs


def lines_of(state: Path) -> list[bytes]:
    return (state / "ledger" / "entries.jsonl").read_bytes().splitlines(keepends=True)


def rewrite(state: Path, lines: list[bytes]) -> None:
    (state / "ledger" / "entries.jsonl").write_bytes(b"".join(lines))


def edit_line(at: int, old: bytes, new: bytes) -> Callable[[list[bytes]], list[bytes]]:
    def edit(lines: list[bytes]) -> list[bytes]:
        assert old in lines[at]
        lines[at] = lines[at].replace(old, new, 1)
        return lines

    return edit


def swap(lines: list[bytes]) -> list[bytes]:
    lines[500], lines[501] = lines[501], lines[500]
    return lines


def insert(lines: list[bytes]) -> list[bytes]:
    forged = lines[500].replace(b'"kind":"note"', b'"kind":"forged"')
    return [*lines[:500], forged, *lines[500:]]


def cut_inside(at: int) -> Callable[[list[bytes]], list[bytes]]:
    def cut(lines: list[bytes]) -> list[bytes]:
        return [*lines[:at], lines[at][: len(lines[at]) // 2]]

    return cut


EDITS: list[tuple[str, Callable[[list[bytes]], list[bytes]], int]] = [
    ("same length", edit_line(500, b'"actor":"a"', b'"actor":"b"'), 500),
    ("different length", edit_line(500, b'"actor":"a"', b'"actor":"mallory"'), 500),
    ("shorter", edit_line(500, b'"kind":"note"', b'"kind":"n"'), 500),
    ("last line, longer", edit_line(N - 1, b'"actor":"a"', b'"actor":"mallory"'), N - 1),
    ("first line", edit_line(0, b'"actor":"a"', b'"actor":"zz"'), 0),
    ("line added", insert, 500),
    ("line removed", lambda lines: lines[:500] + lines[501:], 500),
    ("last line removed", lambda lines: lines[:-1], N - 1),
    ("lines swapped", swap, 500),
    ("truncated inside a line", cut_inside(500), 500),
    ("truncated inside the last line", cut_inside(N - 1), N - 1),
    ("a line appended", lambda lines: [*lines, b'{"hello":"world"}\n'], N),
    ("a copy appended", lambda lines: [*lines, lines[-1]], N),
    ("a newline removed", lambda lines: [*lines[:500], lines[500][:-1], *lines[501:]], 500),
]


@pytest.mark.parametrize(("name", "edit", "seq"), EDITS, ids=[e[0] for e in EDITS])
async def test_every_edit_of_the_entries_is_named_and_nothing_is_written(
    stopped: Path, name: str, edit: Callable[[list[bytes]], list[bytes]], seq: int
) -> None:
    rewrite(stopped, edit(lines_of(stopped)))
    verdict = (await asyncio.to_thread(read_only_everything, stopped, QUICK))[READERS[0]]
    assert verdict.startswith(f"FAILED at seq {seq}: "), verdict
    record = {k: v for k, v in hashes(stopped).items() if k in RECORD}
    # The owner (the daemon's open) refuses as well, naming the same seq, and writes nothing.
    with pytest.raises(LedgerCorrupt) as err:
        await Ledger.open(stopped)
    assert err.value.seq == seq, err.value.message
    assert {k: v for k, v in hashes(stopped).items() if k in RECORD} == record


async def test_the_reported_case_names_seq_500_and_changes_no_file(stopped: Path) -> None:
    """Issue 27, finding 6: `"actor":"a"` -> `"actor":"mallory"` at seq 500 of 1,000 made a
    read-only verify rewrite the record files from the journal, then die on a JSONDecodeError."""
    lines = lines_of(stopped)
    lines[500] = lines[500].replace(b'"actor":"a"', b'"actor":"mallory"')
    rewrite(stopped, lines)
    before = hashes(stopped)
    code, out, err = await asyncio.to_thread(run_cli, "ledger", "verify", "--state", str(stopped))
    assert code == 1
    assert out.splitlines()[0] == (
        "FAILED at seq 500: entry bytes do not match the recorded leaf hash"
    ), out
    assert "entries 0..499 intact before it" in out
    assert "Traceback" not in out + err
    assert hashes(stopped) == before
    with pytest.raises(LedgerCorrupt) as refused:
        await Ledger.open(stopped)
    assert refused.value.seq == 500
    assert "changed nothing" in refused.value.message
    after = hashes(stopped)
    del after["ledger/lock"], before["ledger/lock"]  # the owner's pid, which it took
    assert after == before


async def test_an_intact_stopped_ledger_verifies_and_nothing_changes(stopped: Path) -> None:
    verdicts = await asyncio.to_thread(read_only_everything, stopped)
    assert verdicts[READERS[0]].startswith(f"ok: {N} entries"), verdicts


# ---------------------------------------------------------------- random edits of every file

FILES = (
    "ledger/entries.jsonl",
    "ledger/bodies.pack",
    "ledger/index.bin",
    "ledger/tree/level-01.bin",
    "ledger/tree/level-03.bin",
    "ledger/wal",
)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    state = tmp_path_factory.mktemp("small") / "state"
    state.mkdir()
    asyncio.run(build(state, 120, bodies_every=2))
    wal = state / "ledger" / "wal"  # less of its zero fill to copy and hash per example
    with wal.open("r+b") as f:
        f.truncate(len(wal.read_bytes().rstrip(b"\0")) + 4096)
    return state


@st.composite
def damage(draw: st.DrawFn) -> tuple[str, str, float, bytes]:
    name = draw(st.sampled_from(FILES))
    kind = draw(st.sampled_from(["overwrite", "insert", "delete", "truncate"]))
    where = draw(st.floats(min_value=0.0, max_value=1.0, allow_nan=False))
    data = draw(st.binary(min_size=1, max_size=24))
    return name, kind, where, data


def apply(path: Path, kind: str, where: float, data: bytes) -> bool:
    """Edit `path` in place; False if the edit changed nothing."""
    old = path.read_bytes()
    if name_is_wal(path):
        old_used = old.rstrip(b"\0")  # edit what the journal holds, not its zero fill
        at = int(where * max(len(old_used) - 1, 0))
    else:
        at = int(where * max(len(old) - 1, 0))
    if kind == "overwrite":
        new = old[:at] + data + old[at + len(data) :]
    elif kind == "insert":
        new = old[:at] + data + old[at:]
    elif kind == "delete":
        new = old[:at] + old[at + len(data) :]
    else:
        new = old[:at]
    path.write_bytes(new)
    return new != old


def name_is_wal(path: Path) -> bool:
    return path.name == "wal"


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(edit=damage())
def test_random_edits_are_named_or_rebuilt_and_readers_write_nothing(
    small: Path, tmp_path_factory: pytest.TempPathFactory, edit: tuple[str, str, float, bytes]
) -> None:
    name, kind, where, data = edit
    state = tmp_path_factory.mktemp("edited") / "state"
    shutil.copytree(small, state)
    if not apply(state / name, kind, where, data):
        return
    verdicts = read_only_everything(state, QUICK)
    plain, deep = verdicts[READERS[0]], verdicts[READERS[1]]
    first = plain.splitlines()[0]
    record = {k: v for k, v in hashes(state).items() if k in RECORD}
    try:
        owner_size: int | None = asyncio.run(owner_opens(state))
    except LedgerCorrupt as err:
        owner_size = None
        refused = err
        # A refusal changes nothing of the record.
        assert {k: v for k, v in hashes(state).items() if k in RECORD} == record
    if name == "ledger/entries.jsonl":
        # The record itself: a failure with its seq, the same seq the owner refuses with.
        assert first.startswith("FAILED at seq "), (edit, plain)
        assert owner_size is None, (edit, plain)
        assert first.startswith(f"FAILED at seq {refused.seq}: "), (edit, plain, refused)
    elif name == "ledger/bodies.pack":
        # Bodies are re-hashed by --deep: named (a seq), or a lost body refuses the open.
        assert not deep.startswith("ok: "), (edit, deep)
        assert deep.startswith("FAILED at seq ") or "first entry with a tampered body: seq" in deep
    else:
        # A derived file or the journal: rebuilt from the record (in memory by a reader, which
        # lists what it rebuilt), and by the owner (at its open, or its verify), after which a
        # reader finds it all in order.
        assert first.startswith(("ok: 120 entries", "FAILED: 120 entries")), (edit, plain)
        if first.startswith("FAILED"):
            assert "DERIVED" in plain, plain
        assert owner_size == 120, edit
        assert run_cli("ledger", "verify", "--state", str(state))[1].startswith("ok: 120 "), edit


async def owner_opens(state: Path) -> int:
    """The daemon's open, a verify (the owner's rebuilds what is derived) and close: the size
    it opened with, or LedgerCorrupt."""
    ledger = await Ledger.open(state, checkpoint_interval=None)
    size = ledger.size
    await ledger.verify()
    await ledger.close()
    return size
