"""The repetition guard, and a looping synthesis that must not replace the work."""

from __future__ import annotations

import pytest

from daemon.runs import entries as k
from daemon.runs.repetition import cut_loop
from tests.runs.conftest import Factory
from tests.runs.dag import DAG, DAG_RULES, bodies


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("in Python 3.11.7 " * 6, "in Python 3.11.7"),
        (
            "Intro. The parser reads tokens one by one. The parser reads tokens one by one. "
            "The parser reads tokens one by one. The end.",
            "Intro. The parser reads tokens one by one",
        ),
        ("line of code here\n" * 5, "line of code here"),
    ],
)
def test_a_loop_is_cut_where_it_starts(text: str, kept: str) -> None:
    assert cut_loop(text) == (kept, True)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "t0 t1 t2 t3 t4 t5 t6 t7 t8 t9 t10 t11 t12",
        "A normal answer. It has two different sentences.",
        "def f():\n    return 1\n\ndef g():\n    return 2\n",
        "ha ha ha ha",  # shorter than a loop worth cutting
    ],
)
def test_text_without_a_loop_is_unchanged(text: str) -> None:
    assert cut_loop(text) == (text, False)


def test_the_guard_is_linear_enough_for_a_long_text() -> None:
    text = "".join(f"word{i} " for i in range(3000))  # 25k characters, no loop
    assert cut_loop(text) == (text, False)


async def test_a_looping_synthesis_keeps_the_task_results(fleet: Factory) -> None:
    looping = "Summary: all good. " + "It uses Python 3.11.7 everywhere. " * 12
    rules = [("Combine", looping, 0.0), *DAG_RULES[1:]]
    daemon, _ = await fleet(rules)
    view = await daemon.engine.wait((await daemon.engine.submit("x", plan=DAG)).id, timeout=20)
    assert view.state == "done", view.error
    assert view.answer is not None
    assert view.answer.count("Python 3.11.7") == 1
    for result in ("GET /items", "docs for GET /items", "tests for GET /items"):
        assert result in view.answer
    (answer,) = await bodies(daemon, k.ANSWER, view.id)
    assert answer["looped"] is True
    assert answer["source"] == "synthesis"
