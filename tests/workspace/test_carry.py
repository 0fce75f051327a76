"""Carrying recorded diffs onto a fresh snapshot (`daemon.workspace.carry`), with real git.

The original run's views are made from one base, the retry's from another (the workspace as
the user left it): a diff whose files did not change is carried as is; one whose files
changed elsewhere is carried and its files named; one that no longer applies, and every task
that needs it, runs again with why.
"""

from __future__ import annotations

from pathlib import Path

from daemon.workspace.carry import Reused, carry, preimage_changed
from daemon.workspace.view import RunDirs

LINES = "".join(f"line {n}\n" for n in range(1, 21))


def space(root: Path, name: str, files: dict[str, str]) -> RunDirs:
    dirs = RunDirs(root, name)
    dirs.prepare([])
    dirs.base.mkdir()
    for path, text in files.items():
        (dirs.base / path).write_text(text)
    return dirs


def change(dirs: RunDirs, name: str, upstream: list[str], edits: dict[str, str]) -> str:
    """What a task that writes `edits` on the base (plus `upstream`) records as its diff."""
    view = dirs.open(name, upstream, workspace=True)
    for path, text in edits.items():
        (view.path / path).write_text(text)
    diff, _ = dirs.capture(view)
    dirs.close(view)
    return diff


def test_an_unchanged_file_is_carried_and_a_file_changed_elsewhere_is_named(
    tmp_path: Path,
) -> None:
    original = space(tmp_path, "r1", {"util.py": LINES, "other.py": "x = 1\n"})
    fix = change(original, "fix", [], {"util.py": LINES.replace("line 2\n", "line two\n")})
    more = change(original, "more", [fix], {"other.py": "x = 2\n"})
    # the user changed util.py far from the fix's hunk, and added a file
    now = LINES.replace("line 19\n", "line nineteen\n")
    fresh = space(tmp_path, "r2", {"util.py": now, "other.py": "x = 1\n", "new.txt": "n\n"})
    carried = carry(fresh, [Reused("fix", [], fix), Reused("more", ["fix"], more)], {})
    assert carried.redo == {}
    assert carried.changed == {"fix": ["util.py"]}  # carried, and said: not what it saw
    assert carried.files == {"fix": ["util.py"], "more": ["other.py"]}
    combined = fresh.combine([carried.diffs["fix"], carried.diffs["more"]])
    view = fresh.open("check", [carried.diffs["fix"], carried.diffs["more"]], workspace=True)
    text = (view.path / "util.py").read_text()
    assert "line two\n" in text
    assert "line nineteen\n" in text
    assert (view.path / "other.py").read_text() == "x = 2\n"
    assert sorted(combined.files) == ["other.py", "util.py"]
    # the carried diff is against the fresh base: its preimage is what the retry sees
    assert preimage_changed(fresh, fresh.base, carried.diffs["fix"]) == []
    assert preimage_changed(fresh, fresh.base, fix) == ["util.py"]


def test_a_diff_that_no_longer_applies_and_its_dependants_run_again(tmp_path: Path) -> None:
    original = space(tmp_path, "r1", {"calc.py": "a\n", "keep.py": "k\n"})
    add = change(original, "add", [], {"new.py": "made\n"})
    edit = change(original, "edit", [add], {"new.py": "made twice\n"})
    alone = change(original, "alone", [], {"keep.py": "kept\n"})
    empty = change(original, "empty", [], {})
    assert empty == ""
    # the user made new.py themselves meanwhile
    fresh = space(tmp_path, "r2", {"calc.py": "a\n", "keep.py": "k\n", "new.py": "mine\n"})
    carried = carry(
        fresh,
        [
            Reused("add", [], add),
            Reused("edit", ["add"], edit),
            Reused("alone", [], alone),
            Reused("empty", [], empty),
        ],
        {},
    )
    assert set(carried.redo) == {"add", "edit"}
    assert "its recorded diff does not apply" in carried.redo["add"]
    assert "new.py" in carried.redo["add"]
    assert carried.redo["add"].endswith("(its files changed since)")
    assert carried.redo["edit"].startswith("it needs add, which runs again")
    assert set(carried.diffs) == {"alone", "empty"}
    assert carried.diffs["empty"] == ""
    assert (fresh.base / "new.py").read_text() == "mine\n"  # carrying never writes the base
    assert list(fresh.root.glob("carry-*")) == []  # nor leaves its views behind


def test_a_resumed_retry_carries_onto_what_it_took_already(tmp_path: Path) -> None:
    original = space(tmp_path, "r1", {"a.txt": "1\n"})
    first = change(original, "first", [], {"a.txt": "2\n"})
    second = change(original, "second", [first], {"a.txt": "3\n"})
    fresh = space(tmp_path, "r2", {"a.txt": "1\n"})
    carried = carry(fresh, [Reused("second", ["first"], second)], {"first": first})
    assert carried.redo == {}
    assert carried.changed == {}
    assert carried.files == {"second": ["a.txt"]}
