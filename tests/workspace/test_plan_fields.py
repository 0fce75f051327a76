"""A plan's `files`, `output_file` and `run` checks: checked when the plan is, located."""

from __future__ import annotations

from typing import Any

import pytest

from daemon.plans import PlanInvalid, check_plan, parse_plan


def task(**fields: Any) -> dict[str, Any]:
    return {"tasks": [{"id": "t", "lane": "backend", "instruction": "x", **fields}]}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"files": {"../x.py": ""}}, "tasks[0].files: '../x.py': '..' would leave"),
        ({"files": {"/etc/cron.d/x": ""}}, "an absolute path"),
        ({"files": {".git/hooks/pre-commit": ""}}, "inside .git"),
        ({"output_file": "a/../../b"}, "tasks[0].output_file"),
        ({"files": {"big.txt": "x" * 1_000_001}}, "at most 1000000"),
        ({"assertions": [{"type": "run", "argv": []}]}, "argv"),
        ({"assertions": [{"type": "run", "argv": ["true"], "timeout_s": 0}]}, "timeout_s"),
    ],
)
def test_bad_fields_are_refused_with_their_place(fields: dict[str, Any], message: str) -> None:
    # the schema's problems when the plan is parsed, the paths' with the plan's others
    with pytest.raises(PlanInvalid) as caught:
        check_plan(parse_plan(task(**fields)), None)
    assert message in caught.value.message


def test_good_fields_are_kept_normalized() -> None:
    plan = parse_plan(
        task(
            files={"tests/test_x.py": "def test(): pass\n"},
            output_file="./src//x.py",
            assertions=[{"type": "run", "argv": ["pytest", "-q"], "timeout_s": 30}],
        )
    )
    (only,) = plan.tasks
    assert only.output_file == "src/x.py"
    assert only.assertions[0].type == "run"


def test_every_bad_file_path_is_named_at_once_and_two_names_for_one_file_are_refused() -> None:
    # A new user's plan with several bad paths learnt of them one fix at a time.
    files = {"../up": "", "/abs": "", "ok.py": "", "a/./b.py": "", "a/b.py": "", ".git/x": ""}
    with pytest.raises(PlanInvalid) as caught:
        check_plan(parse_plan(task(files=files)), None)
    message = caught.value.message
    for bad in ("'../up'", "'/abs'", "'.git/x'", "'a/b.py' and 'a/./b.py' name the same file"):
        assert bad in message
    assert "'ok.py'" not in message
