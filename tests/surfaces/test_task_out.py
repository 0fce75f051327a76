"""The published shapes say everything and only what tally sends or takes: a run's tasks
(TaskOut) and a plan's executors (no test-only `stub`)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from daemon.plans import Plan, Task
from daemon.runs.state import RunView, TaskView
from daemon.tools.tool import RunOut, TaskOut, run_out


def test_task_out_publishes_every_field_of_a_task_and_nothing_else() -> None:
    assert set(TaskOut.model_fields) == set(TaskView.model_fields)
    schema = TaskOut.model_json_schema()
    assert set(schema["properties"]) == set(TaskView.model_fields)
    assert schema.get("additionalProperties") is not True


def test_a_run_out_carries_its_tasks_fields_and_drops_none_undescribed() -> None:
    task = TaskView(id="t", lane="backend", state="done", steps=3, last_tool="read_file")
    view = RunView(id="r", request="x", request_seq=0, created_at_us=1, updated_at_us=1)
    view.tasks.append(task)
    out = run_out(view).model_dump(mode="json")
    assert out["tasks"] == [task.model_dump(mode="json")]
    extra = RunOut.model_validate(
        {**out, "tasks": [{**out["tasks"][0], "undescribed": 1}]}
    ).model_dump(mode="json")
    assert "undescribed" not in extra["tasks"][0]


def test_the_plan_schema_offers_only_the_real_executors() -> None:
    schema = Plan.model_json_schema()
    executor = schema["$defs"]["Task"]["properties"]["executor"]
    assert set(executor["enum"]) == {"chat", "command", "agent"}
    assert "stub" not in str(schema)
    with pytest.raises(ValidationError, match="executor"):
        Task.model_validate({"id": "t", "lane": "x", "instruction": "y", "executor": "stub"})
