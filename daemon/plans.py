"""Plans: tasks with lanes and dependencies, their validation, and their waves.

A plan is a DAG of tasks (`needs` point at the tasks that must finish first). `problems`
reports everything wrong with a plan at once, each problem naming its task ids; a cycle is
named as a concrete path (`T2 -> T3 -> T2`). `waves` groups tasks into longest-path levels
(a task's level is one more than the deepest of its needs), each split into chunks of at
most `max_parallel`. Everything is O(tasks + needs): a Kahn pass orders the graph, and only
the tasks it cannot order (cycles and what hangs below them) go through Tarjan's algorithm.

One module past 600 lines: the plan's models and every check on them change together (a field
is a model field, its problems and its message), and `problems` reads the whole plan at once.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Collection, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from daemon.errors import InvalidInput
from daemon.ledger.canonical import MAX_SAFE_INT
from daemon.patterns import MAX_PATTERN, compile_pattern, schema_patterns
from daemon.workspace.paths import check_relative
from roster.models import Whole

ProblemCode = Literal[
    "schema", "duplicate_id", "unknown_need", "unknown_lane", "cycle", "bad_path", "executor"
]

MAX_TASK_TIMEOUT_S = 86_400.0
MAX_TASK_FILES_CHARS = 1_000_000
MAX_AGENT_STEPS = 200


class _Model(BaseModel):
    # Strict (no coercion: `"1"` is not 1, `0` is not false) and finite: plans come from
    # clients and from models' structured output, and their numbers reach timers and the
    # ledger, so what the published schema says is exactly what is accepted.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _unstorable(value: Any, path: str) -> str | None:
    """Why the ledger cannot hold a free-form value (None if it can): a non-finite number, an
    integer beyond ±(2**53 - 1) or an object key outside the Basic Multilingual Plane."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path}: numbers must be finite"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SAFE_INT:
        return f"{path}: integer outside ±(2**53 - 1)"
    items: list[tuple[str, Any]] = []
    if isinstance(value, list):
        items = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
    elif isinstance(value, dict):
        for key, item in value.items():
            if any(ord(c) > 0xFFFF for c in key):
                return f"{path}: object key {key!r} is outside the Basic Multilingual Plane"
            items.append((f"{path}.{key}", item))
    for where, item in items:
        why = _unstorable(item, where)
        if why is not None:
            return why
    return None


class JsonSchemaAssertion(_Model):
    """The output parses as JSON and validates against `schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    type: Literal["json_schema"]
    # Not named `schema`: that would shadow a (deprecated) BaseModel attribute.
    json_schema: dict[str, Any] = Field(alias="schema")

    @field_validator("json_schema")
    @classmethod
    def _valid_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        # jsonschema (~30 ms to import) loads with the first plan that declares a schema,
        # not with the daemon: start-up does not need it.
        from jsonschema import SchemaError
        from jsonschema.validators import validator_for

        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as exc:
            raise ValueError(f"not a valid JSON schema: {exc.message}") from None
        for pattern in schema_patterns(schema):  # PatternError is a ValueError: a 422
            compile_pattern(pattern)
        return schema


class ContainsAssertion(_Model):
    type: Literal["contains"]
    text: str = Field(min_length=1)


class RegexAssertion(_Model):
    """The RE2 `pattern` finds a match in the output (linear time: no backreferences or
    lookaround; see daemon.patterns)."""

    type: Literal["regex"]
    pattern: str = Field(max_length=MAX_PATTERN, json_schema_extra={"format": "regex"})

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        compile_pattern(pattern)  # PatternError is a ValueError: a located 422
        return pattern


class MaxLengthAssertion(_Model):
    type: Literal["max_length"]
    chars: Annotated[int, Field(ge=0, le=MAX_SAFE_INT), Whole]


class ExitCodeAssertion(_Model):
    """For the command executor: the process exited with `code`."""

    type: Literal["exit_code"]
    code: Annotated[int, Field(ge=-255, le=255), Whole] = Field(
        description="Negative: killed by that signal."
    )


class RunAssertion(_Model):
    """Runs `argv` (no shell) in the sandbox, in the task's view, after the task: passes on
    exit 0. Its output's tail is witnessed and is the next attempt's feedback."""

    type: Literal["run"]
    argv: list[str] = Field(min_length=1, max_length=256)
    timeout_s: float = Field(default=120.0, gt=0, le=MAX_TASK_TIMEOUT_S)


class _PlainOneOf:
    """Publish a tagged union as plain JSON Schema 2020-12 `oneOf`, without OpenAPI's
    `discriminator` keyword (strict validators such as Ajv refuse unknown keywords). Each
    branch's `type` is a required `const`, so the branches still exclude each other."""

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core_schema)
        schema.pop("discriminator", None)
        return schema


Assertion = Annotated[
    JsonSchemaAssertion
    | ContainsAssertion
    | RegexAssertion
    | MaxLengthAssertion
    | ExitCodeAssertion
    | RunAssertion,
    Field(discriminator="type"),
    _PlainOneOf,
]


class Task(_Model):
    # The published schema says what `_command_has_argv` checks: a command task has an argv.
    model_config = ConfigDict(
        json_schema_extra={
            "if": {
                "type": "object",
                "properties": {"executor": {"const": "command"}},
                "required": ["executor"],
            },
            "then": {
                "type": "object",
                "required": ["argv"],
                "properties": {"argv": {"type": "array"}},
            },
        }
    )

    id: str = Field(min_length=1, max_length=128)
    lane: str = Field(min_length=1)
    instruction: str
    needs: list[str] = []
    assertions: list[Assertion] = []
    executor: Literal["chat", "command", "agent"] = Field(
        default="chat",
        description="chat: one model call; command: `argv` in the sandbox; agent: a bounded "
        "tool-calling loop (list, read, search, write, edit, run, finish) on the task's "
        "workspace view.",
    )
    argv: list[str] | None = Field(default=None, min_length=1)
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_TASK_TIMEOUT_S)
    network: bool = False
    """A command task that needs the network; refused unless the roster's policy allows it."""
    files: dict[str, str] = Field(default={}, max_length=64)
    """Files (relative path -> content) written into the task's view before it runs."""
    output_file: str | None = Field(default=None, min_length=1, max_length=4096)
    """Where in the view the task's output is written before its checks run: the first
    fenced code block of the output if it has one, else the whole output."""
    max_steps: Annotated[int, Field(ge=1, le=MAX_AGENT_STEPS), Whole] | None = Field(
        default=None,
        description="An agent task's model calls per attempt (default 30); the run's budget "
        "bounds them too.",
    )

    @field_validator("files")
    @classmethod
    def _files_bounded(cls, files: dict[str, str]) -> dict[str, str]:
        total = sum(len(path) + len(content) for path, content in files.items())
        if total > MAX_TASK_FILES_CHARS:
            raise ValueError(f"files hold {total} characters; at most {MAX_TASK_FILES_CHARS}")
        return files

    @field_validator("output_file")
    @classmethod
    def _output_normalized(cls, path: str | None) -> str | None:
        # Normalized when usable ("./src//x.py" is "src/x.py"); a path that is not is kept as
        # sent, for `problems` to name with the plan's other problems.
        if path is None:
            return None
        try:
            return check_relative(path)
        except ValueError:
            return path

    @model_validator(mode="after")
    def _command_has_argv(self) -> Task:
        # Refused here, with the plan, not when the task runs (after the tasks before it).
        if self.executor == "command" and self.argv is None:
            raise ValueError(
                "a command task needs `argv`, the program and its arguments "
                '(e.g. "argv": ["pytest", "-q"])'
            )
        return self


class Plan(_Model):
    tasks: list[Task] = Field(min_length=1)


class PlanProblem(BaseModel):
    """One problem; `tasks` names the task ids involved (a cycle: its path, closed)."""

    code: ProblemCode
    tasks: list[str]
    message: str


class PlanInvalid(InvalidInput):
    code = "invalid_plan"

    def __init__(self, problems: list[PlanProblem]) -> None:
        self.problems = problems
        super().__init__(
            "\n".join(p.message for p in problems),
            details={"errors": [p.model_dump() for p in problems]},
        )


class Waves(BaseModel):
    waves: list[list[str]]
    critical_path: int
    total_tasks: int


def parse_plan(data: str | bytes | dict[str, Any]) -> Plan:
    """Validate a plan from JSON (text or parsed); schema errors become `PlanInvalid`."""
    try:
        if isinstance(data, dict):
            return Plan.model_validate(data)
        return Plan.model_validate_json(data)
    except ValidationError as exc:
        raw: Any = data
        if not isinstance(data, dict):
            try:
                raw = json.loads(data)
            except (ValueError, RecursionError):  # nested past json's limit
                raw = None
        raise PlanInvalid([_schema_problem(err, raw) for err in exc.errors()]) from None


def report(
    data: str | bytes | dict[str, Any] | Any, lanes: Collection[str] | None = None
) -> tuple[Plan | None, list[PlanProblem]]:
    """Every problem with a plan given as JSON (text or parsed), in one pass: the schema's
    (an unknown field with its "did you mean"), and, read from the tasks despite them, the
    duplicate ids, unknown lanes and needs, and cycles. (The plan, or None; the problems.)"""
    try:
        if isinstance(data, str | bytes):
            plan = Plan.model_validate_json(data)
        else:
            plan = Plan.model_validate(data)
    except ValidationError as exc:
        raw: Any = data
        if isinstance(data, str | bytes):
            try:
                raw = json.loads(data)
            except (ValueError, RecursionError):  # nested past json's limit
                raw = None
        found = [_schema_problem(err, raw) for err in exc.errors()]
        return None, found + _readable_problems(raw, lanes)
    return plan, problems(plan, lanes)


def _readable_problems(raw: Any, lanes: Collection[str] | None) -> list[PlanProblem]:
    """The graph's and the lanes' problems among the tasks of a plan that failed its schema:
    each task with a string id counts, with what can be read of its lane and needs (what
    cannot be read is the schema's problem, said already)."""
    tasks = raw.get("tasks") if isinstance(raw, dict) else None
    if not isinstance(tasks, list):
        return []
    readable: list[Task] = []
    unread_lane: set[str] = set()
    for item in tasks:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str) or not item["id"]:
            continue
        lane = item.get("lane")
        if not isinstance(lane, str) or not lane:
            unread_lane.add(item["id"])
            lane = ""
        needs = item.get("needs")
        needs = [n for n in needs if isinstance(n, str)] if isinstance(needs, list) else []
        readable.append(Task.model_construct(id=item["id"], lane=lane, needs=needs, instruction=""))
    if not readable:
        return []
    found = problems(Plan.model_construct(tasks=readable), lanes)
    return [p for p in found if not (p.code == "unknown_lane" and p.tasks[0] in unread_lane)]


def problems(plan: Plan, lanes: Collection[str] | None = None) -> list[PlanProblem]:
    """Every problem with the plan; `lanes=None` skips the lane check."""
    found: list[PlanProblem] = []
    positions: dict[str, list[int]] = {}
    for i, task in enumerate(plan.tasks):
        positions.setdefault(task.id, []).append(i)
    for tid, where in positions.items():
        if len(where) > 1:
            places = ", ".join(f"tasks[{i}]" for i in where)
            found.append(
                PlanProblem(
                    code="duplicate_id",
                    tasks=[tid],
                    message=f"task id {tid!r} is used {len(where)} times ({places})",
                )
            )
    known = set(lanes) if lanes is not None else None
    for task in plan.tasks:
        sound = (known is None or task.lane in known) and all(
            need in positions and need != task.id for need in task.needs
        )
        if not sound:  # the common case skips building anything
            found.extend(_task_problems(task, positions, known))
    found.extend(_unstorable_assertions(plan.tasks))
    found.extend(_unusable_paths(plan.tasks))
    found.extend(_executor_problems(plan.tasks))
    ids, deps = _graph(plan.tasks)
    order, _ = _topological(deps)
    if len(order) < len(ids):
        found.extend(_cycles(ids, deps, order))
    return found


def _unusable_paths(tasks: Sequence[Task]) -> list[PlanProblem]:
    """`files` and `output_file` paths that would leave the task's view (absolute, `..`,
    `.git`), and two names for one file ("a/b", "a/./b"), every one in one pass. A problem
    like a lane's, not a schema error: the `plan` tool lists it, `submit` refuses it, and the
    view checks each path again as it writes (`daemon.workspace.paths`)."""
    found: list[PlanProblem] = []
    for i, task in enumerate(tasks):
        seen: dict[str, str] = {}
        for path in task.files:
            try:
                rel = check_relative(path)
            except ValueError as refused:  # PathRefused: the path and why
                found.append(_path_problem(task, i, "files", str(refused)))
                continue
            if rel in seen:
                why = f"{path!r} and {seen[rel]!r} name the same file {rel!r}"
                found.append(_path_problem(task, i, "files", why))
            seen.setdefault(rel, path)
        if task.output_file is not None:
            try:
                check_relative(task.output_file)
            except ValueError as refused:
                found.append(_path_problem(task, i, "output_file", str(refused)))
    return found


def _executor_problems(tasks: Sequence[Task]) -> list[PlanProblem]:
    """Fields an executor does not use, said rather than silently ignored: `argv` belongs to
    command tasks, `max_steps` to agent tasks; an agent writes files itself, so it has no
    `output_file` (its output is its finish summary)."""
    found: list[PlanProblem] = []
    for i, task in enumerate(tasks):
        why = None
        if task.executor == "agent" and task.output_file is not None:
            why = (
                "an agent task edits the files itself and its output is its finish summary; "
                "drop `output_file` (or use a chat task)"
            )
        elif task.executor == "agent" and task.argv is not None:
            why = "`argv` is a command task's; an agent runs commands with its `run` tool"
        elif task.executor != "agent" and task.max_steps is not None:
            why = f"`max_steps` is an agent task's; this task's executor is {task.executor!r}"
        if why is not None:
            found.append(
                PlanProblem(code="executor", tasks=[task.id], message=f"tasks[{i}]: {why}")
            )
    return found


def agent_needs_view(plan: Plan, workspace: bool) -> None:
    """Refuse (`PlanInvalid`) agent tasks with nothing to work on: an agent reads and edits a
    view of the run's workspace, or (no workspace) a dir holding the task's `files`."""
    found = [
        PlanProblem(
            code="executor",
            tasks=[task.id],
            message=f"tasks[{i}]: task {task.id!r} runs the agent executor, which works on "
            "a workspace; submit the run with `workspace` (`tally submit --workspace DIR`), "
            "or give the task `files` to start from",
        )
        for i, task in enumerate(plan.tasks)
        if task.executor == "agent" and not workspace and not task.files
    ]
    if found:
        raise PlanInvalid(found)


def _path_problem(task: Task, index: int, field: str, why: str) -> PlanProblem:
    return PlanProblem(code="bad_path", tasks=[task.id], message=f"tasks[{index}].{field}: {why}")


def _unstorable_assertions(tasks: Sequence[Task]) -> list[PlanProblem]:
    # A plan goes into the ledger with the run, so a JSON schema in it must be ledger data.
    # Reported as a problem rather than refused by the model: the `plan` tool lists it with
    # the others, and a schema-valid plan is never a 422 of `plan` itself.
    found = []
    for task in tasks:
        for i, a in enumerate(task.assertions):
            if isinstance(a, JsonSchemaAssertion):
                why = _unstorable(a.json_schema, f"assertions[{i}].schema")
                if why is not None:
                    message = f"task {task.id!r}: {why}"
                    found.append(PlanProblem(code="schema", tasks=[task.id], message=message))
    return found


def check_plan(plan: Plan, lanes: Collection[str] | None) -> None:
    """Raise `PlanInvalid` with every problem, or return when the plan is sound."""
    found = problems(plan, lanes)
    if found:
        raise PlanInvalid(found)


def waves(plan: Plan, max_parallel: int | None = None) -> Waves:
    """Longest-path levels in plan order, each split into chunks of at most `max_parallel`.

    Raises `PlanInvalid` when the plan is not a DAG of unique, known ids (lanes are not
    checked here). `max_parallel=None` leaves levels whole.
    """
    if max_parallel is not None and max_parallel < 1:
        raise InvalidInput(f"max_parallel must be at least 1, not {max_parallel}")
    tasks = plan.tasks
    ids, deps = _graph(tasks)
    order, level = _topological(deps)
    if len(ids) < len(tasks) or len(order) < len(ids) or _has_loose_needs(tasks, ids):
        raise PlanInvalid(problems(plan, None))
    depth = max(level, default=0)
    levels: list[list[str]] = [[] for _ in range(depth)]
    for node, tid in enumerate(ids):
        levels[level[node] - 1].append(tid)
    step = max_parallel or max(len(tasks), 1)
    chunks = [group[i : i + step] for group in levels for i in range(0, len(group), step)]
    return Waves(waves=chunks, critical_path=depth, total_tasks=len(tasks))


# -- the graph ------------------------------------------------------------------------------


def _task_problems(
    task: Task, positions: dict[str, list[int]], known: set[str] | None
) -> list[PlanProblem]:
    found: list[PlanProblem] = []
    tid = task.id
    if known is not None and task.lane not in known:
        listing = ", ".join(sorted(known)[:30]) or "none"
        close = difflib.get_close_matches(task.lane, sorted(known), n=1, cutoff=0.7)
        hint = f"; did you mean `{close[0]}`?" if close else ""
        found.append(
            PlanProblem(
                code="unknown_lane",
                tasks=[tid],
                message=f"task {tid!r}: unknown lane {task.lane!r}{hint} (known: {listing})",
            )
        )
    for need in dict.fromkeys(task.needs):
        if need == tid:
            found.append(  # the shortest cycle, named like the others
                PlanProblem(
                    code="cycle",
                    tasks=[tid, tid],
                    message=f"cycle: {tid} -> {tid} (task {tid!r} needs itself)",
                )
            )
        elif need not in positions:
            found.append(
                PlanProblem(
                    code="unknown_need",
                    tasks=[tid, need],
                    message=f"task {tid!r} needs {need!r}, which is not a task in the plan",
                )
            )
    return found


def _graph(tasks: Sequence[Task]) -> tuple[list[str], list[list[int]]]:
    """Unique ids (first occurrence wins) and each one's needs as node numbers.

    Unknown needs and self-dependencies are left out: they are reported on their own.
    """
    index: dict[str, int] = {}
    unique: list[Task] = []
    for task in tasks:
        if task.id not in index:
            index[task.id] = len(unique)
            unique.append(task)
    deps = [[index[n] for n in dict.fromkeys(t.needs) if n != t.id and n in index] for t in unique]
    return [t.id for t in unique], deps


def _has_loose_needs(tasks: Sequence[Task], ids: list[str]) -> bool:
    """True when some need was left out of the graph (unknown or the task itself)."""
    known = set(ids)
    return any(need == t.id or need not in known for t in tasks for need in t.needs)


def _topological(deps: list[list[int]]) -> tuple[list[int], list[int]]:
    """Kahn's algorithm: the nodes it can order, and each ordered node's level (1-based)."""
    count = len(deps)
    waiting = [len(d) for d in deps]
    dependents: list[list[int]] = [[] for _ in range(count)]
    for node, needs in enumerate(deps):
        for need in needs:
            dependents[need].append(node)
    level = [1] * count
    order = [node for node in range(count) if not waiting[node]]
    for node in order:  # `order` grows while we walk it: it is the queue
        next_level = level[node] + 1
        for dependent in dependents[node]:
            if level[dependent] < next_level:
                level[dependent] = next_level
            waiting[dependent] -= 1
            if not waiting[dependent]:
                order.append(dependent)
    return order, level


def _cycles(ids: list[str], deps: list[list[int]], ordered: list[int]) -> list[PlanProblem]:
    """One concrete cycle per strongly connected component among the unordered nodes."""
    inside = [True] * len(ids)
    for node in ordered:
        inside[node] = False
    found: list[PlanProblem] = []
    components = _components(deps, inside)
    for component in sorted(components, key=min):
        if len(component) < 2:
            continue  # a lone node hanging below a cycle, not a cycle itself
        path = _cycle_path(deps, set(component))
        names = [ids[node] for node in path]
        found.append(
            PlanProblem(
                code="cycle",
                tasks=names,
                message=f"cycle: {' -> '.join(names)} (each task needs the next)",
            )
        )
    return found


def _components(deps: list[list[int]], inside: list[bool]) -> list[list[int]]:
    """Tarjan's strongly connected components of the `inside` nodes, without recursion."""
    count = len(deps)
    index = [-1] * count
    low = [0] * count
    on_stack = [False] * count
    stack: list[int] = []
    result: list[list[int]] = []
    counter = 0
    for root in range(count):
        if not inside[root] or index[root] >= 0:
            continue
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack[root] = True
        work: list[tuple[int, int]] = [(root, 0)]
        while work:
            node, at = work[-1]
            needs = deps[node]
            descended = False
            while at < len(needs):
                other = needs[at]
                at += 1
                if not inside[other]:
                    continue
                if index[other] < 0:
                    work[-1] = (node, at)
                    index[other] = low[other] = counter
                    counter += 1
                    stack.append(other)
                    on_stack[other] = True
                    work.append((other, 0))
                    descended = True
                    break
                if on_stack[other] and index[other] < low[node]:
                    low[node] = index[other]
            if descended:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                if low[node] < low[parent]:
                    low[parent] = low[node]
            if low[node] == index[node]:
                component: list[int] = []
                while True:
                    member = stack.pop()
                    on_stack[member] = False
                    component.append(member)
                    if member == node:
                        break
                result.append(component)
    return result


def _cycle_path(deps: list[list[int]], component: set[int]) -> list[int]:
    """The shortest cycle through the component's first node (BFS), closed: [a, ..., a]."""
    start = min(component)
    parent: dict[int, int] = {start: start}
    frontier = [start]
    while frontier:
        following: list[int] = []
        for node in frontier:
            for need in deps[node]:
                if need == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    path.reverse()
                    return [*path, start]
                if need in component and need not in parent:
                    parent[need] = node
                    following.append(need)
        frontier = following
    raise AssertionError("a strongly connected component always has a cycle")


def _schema_problem(err: Any, data: Any) -> PlanProblem:
    loc = err["loc"]
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    tasks: list[str] = []
    if isinstance(data, dict) and len(loc) >= 2 and loc[0] == "tasks" and isinstance(loc[1], int):
        raw = data.get("tasks")
        if isinstance(raw, list) and loc[1] < len(raw) and isinstance(raw[loc[1]], dict):
            tid = raw[loc[1]].get("id")
            if isinstance(tid, str):
                tasks = [tid]
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden" and loc:
        message = _unknown_field(str(loc[-1]), _fields_at(tuple(loc[:-1])))
    return PlanProblem(code="schema", tasks=tasks, message=f"{path or 'plan'}: {message}")


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The field names a plan allows at `loc` (the object an unknown field was found in)."""
    model: type[BaseModel] | None = None
    if loc == ():
        model = Plan
    elif len(loc) == 2 and loc[0] == "tasks":
        model = Task
    elif len(loc) == 5 and loc[0] == "tasks" and loc[2] == "assertions":
        model = _ASSERTIONS.get(str(loc[4]))  # pydantic names the union's branch by its tag
    if model is None:
        return []
    return [f.alias or name for name, f in model.model_fields.items()]


_ASSERTIONS: dict[str, type[BaseModel]] = {
    "json_schema": JsonSchemaAssertion,
    "contains": ContainsAssertion,
    "regex": RegexAssertion,
    "max_length": MaxLengthAssertion,
    "exit_code": ExitCodeAssertion,
}


# What other plan formats call a task's fields: spelling alone would not find these (`kind`
# looks more like `id` than like `executor`).
_SYNONYMS = {
    "kind": "executor",
    "type": "executor",
    "command": "argv",
    "cmd": "argv",
    "args": "argv",
    "depends_on": "needs",
    "deps": "needs",
    "after": "needs",
    "prompt": "instruction",
    "timeout": "timeout_s",
}


def _unknown_field(name: str, known: list[str]) -> str:
    if _SYNONYMS.get(name) in known:
        return f"unknown field {name!r}; did you mean `{_SYNONYMS[name]}`?"
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
    if close:
        return f"unknown field {name!r}; did you mean `{close[0]}`?"
    listing = ", ".join(known) if known else "none"
    return f"unknown field {name!r} (the fields here: {listing})"
