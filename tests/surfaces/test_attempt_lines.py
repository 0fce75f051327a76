"""`tally run ID`'s attempt listing reads a workspace task's diff and checks as a person would."""

from __future__ import annotations

import io

from surfaces.cli.stream import Tokens, attempt_lines


def entry(seq: int, kind: str, **body: object) -> dict[str, object]:
    return {"seq": seq, "kind": kind, "content": {"task": "fix", **body}}


def test_a_diff_and_a_check_are_said_in_words_not_dumped() -> None:
    diff = "diff --git a/calc.py b/calc.py\nindex 12ee743..4693ad3 100644\n"
    check = {
        "attempt": 1,
        "argv": ["python3", "-m", "unittest", "-q"],
        "exit_code": 1,
        "timed_out": False,
        "stdout_tail": "",
        "stderr_tail": "=" * 70 + "\nFAIL: test_add\n" + "-" * 70 + "\nAssertionError: -1 != 5",
        "duration_ms": 99,
        "source": "task",
    }
    lines = attempt_lines(
        [
            entry(1, "task.diff", attempt=1, diff=diff, files=["calc.py"]),
            entry(2, "check.run", **check),
            entry(3, "task.diff", attempt=2, diff="", files=[]),
            entry(4, "check.run", **{**check, "exit_code": None, "timed_out": True}),
            entry(5, "task.diff", attempt=3, diff="", files=[], error="git add failed"),
        ]
    )["fix"]
    assert lines == [
        "  changed calc.py  [seq 1]",
        "  check `python3 -m unittest -q` (task): exit 1: "
        "=== FAIL: test_add --- AssertionError: -1 != 5  [seq 2]",
        "  changed no file  [seq 3]",
        "  check `python3 -m unittest -q` (task): timed out: "
        "=== FAIL: test_add --- AssertionError: -1 != 5  [seq 4]",
        "  changes not captured: git add failed  [seq 5]",
    ]


def test_a_retrys_carry_is_said_for_each_task_it_decided_about() -> None:
    carry = {
        "from_run": "r1",
        "from_content": "a",
        "content": "b",
        "carried": ["fix"],
        "changed": {"fix": ["calc.py"]},
        "redo": {"docs": "its recorded diff does not apply: error: patch failed: README.md:1"},
    }
    lines = attempt_lines([{"seq": 7, "kind": "workspace.carry", "content": carry}])
    assert lines == {
        "docs": [
            "not reused from run r1, runs again: its recorded diff does not apply: "
            "error: patch failed: README.md:1  [seq 7]"
        ],
        "fix": [
            "its changes carried onto the workspace as it is now; calc.py changed since  [seq 7]"
        ],
    }


def test_a_body_that_does_not_fit_its_kind_is_shown_by_its_fields_not_misread() -> None:
    """An older or newer daemon's body: a later field is read past, a misfit is not read as
    its kind (its `attempt` is not an attempt number) but listed as it is."""
    start = {"lane": "docs", "executor": "chat", "tier": "cheap", "needs": [], "feedback": []}
    lines = attempt_lines(
        [
            entry(1, "task.start", attempt=2, added_later=True, **start),
            entry(2, "task.start", attempt="two", **start),
            entry(3, "no.such.kind", detail="kept"),
        ]
    )["fix"]
    assert lines[0] == "attempt 2 on cheap  [seq 1]"
    assert lines[1].startswith("  task.start: ")
    assert "attempt=two" in lines[1]
    assert lines[2] == "  no.such.kind: detail=kept  [seq 3]"


def test_following_a_run_notes_a_new_attempt_only_from_a_body_that_fits() -> None:
    out = io.StringIO()
    tokens = Tokens(out)
    start = {"task": "fix", "lane": "docs", "executor": "chat", "tier": "capable",
             "needs": [], "feedback": []}  # fmt: skip
    tokens.entry("task.start", start | {"attempt": 2})
    tokens.entry("task.start", start | {"attempt": "3"})  # not an attempt number: no note
    assert out.getvalue() == "── fix: attempt 2 on capable ──\n"
