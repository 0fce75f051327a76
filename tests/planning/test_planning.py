"""Plan validation (every problem, cycles as paths) and waves."""

from __future__ import annotations

import graphlib
import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.errors import InvalidInput
from daemon.plans import (
    ContainsAssertion,
    JsonSchemaAssertion,
    Plan,
    PlanInvalid,
    Task,
    check_plan,
    parse_plan,
    problems,
    waves,
)
from surfaces.cli import main


def plan(*specs: tuple[str, list[str]], lane: str = "backend") -> Plan:
    return Plan(tasks=[Task(id=i, lane=lane, instruction="do", needs=n) for i, n in specs])


def test_issue_example() -> None:
    p = plan(("T1", []), ("T2", ["T1"]), ("T3", ["T1"]))
    check_plan(p, ["backend"])
    assert waves(p).model_dump() == {
        "waves": [["T1"], ["T2", "T3"]],
        "critical_path": 2,
        "total_tasks": 3,
    }
    assert waves(p, 1).waves == [["T1"], ["T2"], ["T3"]]


def test_levels_are_longest_paths_in_plan_order() -> None:
    p = plan(("D", ["B", "C"]), ("A", []), ("B", ["A"]), ("C", []), ("E", ["A"]))
    result = waves(p)
    assert result.waves == [["A", "C"], ["B", "E"], ["D"]]
    assert result.critical_path == 3


def test_every_problem_is_reported_together() -> None:
    p = Plan(
        tasks=[
            Task(id="T1", lane="backend", instruction="x"),
            Task(id="T2", lane="nope", instruction="x", needs=["T3", "T1"]),
            Task(id="T3", lane="backend", instruction="x", needs=["T2"]),
            Task(id="T4", lane="backend", instruction="x", needs=["T4", "T9"]),
            Task(id="T1", lane="backend", instruction="x"),
        ]
    )
    found = [(p.code, p.tasks) for p in problems(p, ["backend"])]
    assert found == [
        ("duplicate_id", ["T1"]),
        ("unknown_lane", ["T2"]),
        ("cycle", ["T4", "T4"]),
        ("unknown_need", ["T4", "T9"]),
        ("cycle", ["T2", "T3", "T2"]),
    ]
    with pytest.raises(PlanInvalid) as caught:
        check_plan(p, ["backend"])
    assert isinstance(caught.value, InvalidInput)
    assert len(caught.value.details["errors"]) == 5
    assert caught.value.details["errors"][4]["message"].startswith("cycle: T2 -> T3 -> T2")
    assert caught.value.details["errors"][2]["message"].startswith("cycle: T4 -> T4")


def test_each_cycle_is_named_once_with_a_tail_ignored() -> None:
    p = plan(
        ("A", ["B"]),
        ("B", ["C"]),
        ("C", ["A"]),
        ("X", ["Y"]),
        ("Y", ["X"]),
        ("tail", ["A"]),  # below a cycle, not in one
        ("ok", []),
    )
    cycles = [p.tasks for p in problems(p) if p.code == "cycle"]
    assert cycles == [["A", "B", "C", "A"], ["X", "Y", "X"]]


def test_cycle_path_is_a_real_cycle_in_a_dense_component() -> None:
    p = plan(("A", ["B", "C"]), ("B", ["C"]), ("C", ["D"]), ("D", ["A", "B"]))
    [cycle] = [p.tasks for p in problems(p) if p.code == "cycle"]
    assert cycle == ["A", "C", "D", "A"]  # BFS: the shortest through the first task


def test_a_10k_long_cycle_needs_no_recursion() -> None:
    n = 10_000
    p = plan(*[(f"T{i}", [f"T{(i + 1) % n}"]) for i in range(n)])
    [cycle] = problems(p)
    assert cycle.code == "cycle"
    assert len(cycle.tasks) == n + 1
    assert cycle.tasks[0] == cycle.tasks[-1] == "T0"


def test_waves_refuses_an_invalid_plan() -> None:
    with pytest.raises(PlanInvalid, match="cycle: A -> B -> A"):
        waves(plan(("A", ["B"]), ("B", ["A"])))
    with pytest.raises(PlanInvalid, match="needs 'Z'"):
        waves(plan(("A", ["Z"])))
    with pytest.raises(PlanInvalid, match="used 2 times"):
        waves(plan(("A", []), ("A", [])))
    with pytest.raises(InvalidInput, match="max_parallel"):
        waves(plan(("A", [])), 0)


def test_lanes_none_skips_the_lane_check() -> None:
    assert problems(plan(("A", []), lane="anything"), None) == []


def test_parse_plan_reports_schema_errors_with_task_ids() -> None:
    with pytest.raises(PlanInvalid) as caught:
        parse_plan(
            '{"tasks": [{"id": "A", "lane": "b"}, {"id": "B", "lane": "b", "instruction": 1}]}'
        )
    errors = caught.value.details["errors"]
    assert [(e["code"], e["tasks"]) for e in errors] == [("schema", ["A"]), ("schema", ["B"])]
    assert errors[0]["message"] == "tasks[0].instruction: Field required"
    with pytest.raises(PlanInvalid, match="Invalid JSON"):
        parse_plan("{nope")
    with pytest.raises(PlanInvalid, match="at least 1"):
        parse_plan({"tasks": []})


def test_assertions_are_a_discriminated_union() -> None:
    task = Task.model_validate(
        {
            "id": "A",
            "lane": "b",
            "instruction": "x",
            "assertions": [
                {"type": "json_schema", "schema": {"type": "object"}},
                {"type": "contains", "text": "ok"},
                {"type": "regex", "pattern": "^a+$"},
                {"type": "max_length", "chars": 10},
                {"type": "exit_code", "code": 0},
            ],
        }
    )
    assert isinstance(task.assertions[0], JsonSchemaAssertion)
    assert task.assertions[0].json_schema == {"type": "object"}
    assert isinstance(task.assertions[1], ContainsAssertion)
    assert task.model_dump()["assertions"][0] == {
        "type": "json_schema",
        "schema": {"type": "object"},
    }
    for bad in (
        {"type": "json_schema", "schema": {"type": "nonsense"}},
        {"type": "regex", "pattern": "("},
        {"type": "telepathy"},
    ):
        with pytest.raises(ValueError):
            Task.model_validate({"id": "A", "lane": "b", "instruction": "x", "assertions": [bad]})


# -- properties ------------------------------------------------------------------------------


@st.composite
def dags(draw: st.DrawFn) -> Plan:
    """Random DAGs: needs point to earlier nodes, then the task list is shuffled."""
    n = draw(st.integers(1, 40))
    specs = []
    for i in range(n):
        needs = draw(st.lists(st.integers(0, i - 1), max_size=4, unique=True)) if i else []
        specs.append((f"T{i}", [f"T{j}" for j in needs]))
    order = draw(st.permutations(specs))
    return plan(*order)


def longest_path(p: Plan) -> int:
    needs = {t.id: t.needs for t in p.tasks}
    depth: dict[str, int] = {}
    for tid in graphlib.TopologicalSorter(needs).static_order():
        depth[tid] = 1 + max((depth[n] for n in needs[tid]), default=0)
    return max(depth.values())


@settings(max_examples=200, deadline=None)
@given(dags(), st.integers(1, 6) | st.none())
def test_waves_properties(p: Plan, max_parallel: int | None) -> None:
    assert problems(p, ["backend"]) == []
    result = waves(p, max_parallel)
    seen = [tid for wave in result.waves for tid in wave]
    assert sorted(seen) == sorted(t.id for t in p.tasks)  # each task in exactly one wave
    wave_of = {tid: i for i, wave in enumerate(result.waves) for tid in wave}
    for task in p.tasks:
        assert all(wave_of[need] < wave_of[task.id] for need in task.needs)
    if max_parallel is not None:
        assert all(len(wave) <= max_parallel for wave in result.waves)
    assert result.critical_path == longest_path(p)
    assert result.total_tasks == len(p.tasks)
    if max_parallel is None:
        assert len(result.waves) == longest_path(p)


@st.composite
def graphs(draw: st.DrawFn) -> Plan:
    n = draw(st.integers(1, 12))
    ids = [f"T{i}" for i in range(n)]
    return plan(*[(i, draw(st.lists(st.sampled_from(ids), max_size=3, unique=True))) for i in ids])


@settings(max_examples=200, deadline=None)
@given(graphs())
def test_cycles_are_real_and_found_exactly_when_there_are_some(p: Plan) -> None:
    needs = {t.id: set(t.needs) for t in p.tasks}
    cycles = [pr.tasks for pr in problems(p) if pr.code == "cycle"]
    for cycle in cycles:
        assert cycle[0] == cycle[-1]
        assert len(set(cycle[:-1])) == len(cycle) - 1
        assert all(b in needs[a] for a, b in itertools.pairwise(cycle))
    try:
        graphlib.TopologicalSorter(needs).prepare()
        acyclic = True
    except graphlib.CycleError:
        acyclic = False
    assert acyclic == (not cycles)
    # Distinct cycles lie in distinct components: no task appears in two of them (a task that
    # needs itself is reported apart, and may also sit in a longer cycle).
    members = [tid for cycle in cycles if len(cycle) > 2 for tid in cycle[:-1]]
    assert len(members) == len(set(members))


# -- the command -----------------------------------------------------------------------------


def write(tmp_path: Path, data: Any) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_plan_command_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tasks = [
        {"id": "T1", "lane": "backend", "instruction": "a", "needs": []},
        {"id": "T2", "lane": "backend", "instruction": "b", "needs": ["T1"]},
        {"id": "T3", "lane": "backend", "instruction": "c", "needs": ["T1"]},
    ]
    assert main(["plan", write(tmp_path, {"tasks": tasks}), "--any-lane", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "waves": [["T1"], ["T2", "T3"]],
        "critical_path": 2,
        "total_tasks": 3,
    }
    assert main(["plan", write(tmp_path, {"tasks": tasks}), "--any-lane"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "wave 1: T1",
        "wave 2: T2, T3",
        "2 waves, critical path 2, 3 tasks",
    ]


def test_plan_command_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.roster.conftest import GOOD

    roster = tmp_path / "roster.toml"
    roster.write_text(GOOD)
    tasks = [
        {"id": "T2", "lane": "nope", "instruction": "a", "needs": ["T3"]},
        {"id": "T3", "lane": "backend", "instruction": "b", "needs": ["T2"]},
    ]
    argv = ["plan", write(tmp_path, {"tasks": tasks}), "--roster", str(roster), "--json"]
    assert main(argv) == 1
    errors = json.loads(capsys.readouterr().out)["errors"]
    assert [(e["code"], e["tasks"]) for e in errors] == [
        ("unknown_lane", ["T2"]),
        ("cycle", ["T2", "T3", "T2"]),
    ]
    assert main(argv[:-1]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "task 'T2': unknown lane 'nope' (known: backend, frontend)",
        "cycle: T2 -> T3 -> T2 (each task needs the next)",
    ]


def test_plan_command_uses_the_roster_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.roster.conftest import GOOD  # max_parallel = 3

    roster = tmp_path / "roster.toml"
    roster.write_text(GOOD)
    tasks = [{"id": f"T{i}", "lane": "backend", "instruction": "x"} for i in range(5)]
    assert main(["plan", write(tmp_path, {"tasks": tasks}), "--roster", str(roster), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["waves"] == [["T0", "T1", "T2"], ["T3", "T4"]]


def test_plan_command_usage_errors(tmp_path: Path) -> None:
    assert main(["plan", str(tmp_path / "absent.json"), "--any-lane"]) == 2
    with pytest.raises(SystemExit) as caught:
        main(["plan", "x.json", "--max-parallel", "0"])
    assert caught.value.code == 2


def test_random_large_dag_waves_quickly_enough_to_not_matter() -> None:
    rng = random.Random(7)
    specs = [
        (f"T{i}", [f"T{j}" for j in rng.sample(range(max(0, i - 30), i), min(i, 3))])
        for i in range(2000)
    ]
    p = plan(*specs)
    check_plan(p, ["backend"])
    assert waves(p, 8).total_tasks == 2000


def test_a_plan_file_nested_past_jsons_limit_is_a_problem_not_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `tally plan deep.json` once ended in a RecursionError (json.loads re-read the text to
    # name the problem's place after pydantic had refused it).
    from surfaces.cli import main

    deep = tmp_path / "deep.json"
    deep.write_text('{"tasks": ' + "[" * 30_000 + "]" * 30_000 + "}")
    assert main(["plan", str(deep)]) != 0
    said = capsys.readouterr()
    assert "recursion limit exceeded" in said.out + said.err
    assert "RecursionError" not in said.out + said.err


def test_a_plan_file_that_is_not_text_or_too_deep_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from surfaces.cli import main

    binary = tmp_path / "plan.json"
    binary.write_bytes(b"\xa7\x00\xff garbage")
    assert main(["plan", str(binary)]) == 2
    assert f"{binary} is not UTF-8 text" in capsys.readouterr().err
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 30_000 + "]" * 30_000)
    nowhere = str(tmp_path / "no.sock")
    assert main(["submit", "--socket", nowhere, "--plan", str(deep), "--detach", "x"]) == 2
    assert f"cannot read the plan {deep}" in capsys.readouterr().err


def test_an_endless_or_huge_attachment_is_refused_without_reading_it_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--file /dev/zero` once read until memory ran out before the size was checked.
    import subprocess
    import sys

    from surfaces.cli import main

    nowhere = str(tmp_path / "no.sock")
    assert main(["submit", "--socket", nowhere, "--file", "/dev/zero", "x"]) == 2
    assert "attached files may hold 90000 in all" in capsys.readouterr().err
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from surfaces.cli import main\n"
        f"sys.exit(main(['submit', '--socket', {nowhere!r}, '-']))\n"
    )
    with open("/dev/zero", "rb") as zeros:  # stdin that never ends; the child's memory is bound
        done = subprocess.run(
            [sys.executable, "-c", code],
            stdin=zeros,
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2, done.stderr
    assert "the request is over 100000 characters" in done.stderr
