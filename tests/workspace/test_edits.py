"""The edit format's parser and its application to a view: what a model's answer may do."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.workspace import edits
from daemon.workspace.edits import EditError

HIDE = [".env*", "*.pem", "*.key", "id_*"]


def test_whole_files_with_their_paths_in_several_spellings(tmp_path: Path) -> None:
    answer = (
        "Here you go.\n\ncalc.py\n```python\ndef add(a, b):\n    return a + b\n```\n\n"
        "**pkg/util.py**\n```\nX = 1\n```\n\n```python path=pkg/more.py\nY = 2\n```\n"
    )
    found = edits.parse(answer)
    assert [(e.path, e.search) for e in found] == [
        ("calc.py", None),
        ("pkg/util.py", None),
        ("pkg/more.py", None),
    ]
    changed = edits.apply(tmp_path, found, HIDE)
    assert changed == ["calc.py", "pkg/util.py", "pkg/more.py"]
    assert (tmp_path / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    assert (tmp_path / "pkg/more.py").read_text() == "Y = 2\n"


def test_search_replace_blocks_change_part_of_a_file(tmp_path: Path) -> None:
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b\n\n\nZ = 3\n")
    answer = (
        "calc.py\n```python\n<<<<<<< SEARCH\n    return a - b\n=======\n    return a + b\n"
        ">>>>>>> REPLACE\n```\n"
    )
    edits.apply(tmp_path, edits.parse(answer), HIDE)
    assert (tmp_path / "calc.py").read_text() == "def add(a, b):\n    return a + b\n\n\nZ = 3\n"


def test_a_unified_diff_applies_by_content_not_line_numbers(tmp_path: Path) -> None:
    (tmp_path / "calc.py").write_text("import os\n\ndef add(a, b):\n    return a - b\n")
    answer = (
        "```diff\n--- a/calc.py\n+++ b/calc.py\n@@ -40,2 +40,2 @@\n def add(a, b):\n"
        "-    return a - b\n+    return a + b\n```\n"
    )
    edits.apply(tmp_path, edits.parse(answer), HIDE)
    assert (tmp_path / "calc.py").read_text() == "import os\n\ndef add(a, b):\n    return a + b\n"


def test_a_new_file_from_a_diff(tmp_path: Path) -> None:
    answer = "```diff\n--- /dev/null\n+++ b/new.txt\n@@ -0,0 +1,2 @@\n+one\n+two\n```\n"
    edits.apply(tmp_path, edits.parse(answer), HIDE)
    assert (tmp_path / "new.txt").read_text() == "one\ntwo\n"


def test_an_answer_in_prose_changes_no_file() -> None:
    assert edits.parse("The tests cover add() only; nothing needs to change.") == []


@pytest.mark.parametrize(
    "answer",
    [
        "```python\nprint('a block without a path')\n```",
        "calc.py\n<<<<<<< SEARCH\nx\n=======\ny\n",
    ],
)
def test_an_answer_without_a_usable_edit_says_how_to_answer(answer: str) -> None:
    with pytest.raises(EditError) as caught:
        edits.parse(answer)
    assert "path" in str(caught.value) or "REPLACE" in str(caught.value)


def test_a_search_that_is_not_in_the_file_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    answer = (
        "calc.py\n<<<<<<< SEARCH\n    return nothing\n=======\n    return a + b\n>>>>>>> REPLACE\n"
    )
    with pytest.raises(EditError, match=r"calc.py: the SEARCH lines are not in the file"):
        edits.apply(tmp_path, edits.parse(answer), HIDE)


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("../escape.py", "'..'"),
        ("a/../../escape.py", "'..'"),
        ("/etc/passwd", "absolute"),
        (".git/config", ".git"),
        (".env", "hidden"),
        ("keys/server.pem", "hidden"),
    ],
)
def test_edits_outside_the_view_or_to_hidden_paths_are_refused(
    tmp_path: Path, path: str, why: str
) -> None:
    view = tmp_path / "view"
    view.mkdir()
    found = [edits.Edit(path=path, search=None, replace="x\n")]
    with pytest.raises(EditError, match=why):
        edits.apply(view, found, HIDE)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["view"]


def test_an_edit_through_a_symlink_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    view = tmp_path / "view"
    view.mkdir()
    (view / "link").symlink_to(outside)
    with pytest.raises(EditError, match="symlink"):
        edits.apply(view, [edits.Edit(path="link/x.py", search=None, replace="x\n")], HIDE)
    assert not (outside / "x.py").exists()
