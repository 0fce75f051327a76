"""Load and dump the roster, with every problem located at file:line:column and field path.

Loading parses with `tomllib`, validates with the pydantic models, then cross-checks the
names that refer to one another (lanes -> tiers -> members, the ladder). The cross-checks run
on the raw document even when pydantic already failed, so a user sees all problems at once.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tomllib
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import ErrorDetails

from daemon import files  # the lowest layer (standard library only): one set of write guarantees
from roster.models import MAX_EXAMPLES, Roster
from roster.positions import FieldPath, PositionIndex, format_path

_TOML_AT = re.compile(r"\s*\(at (?:line (\d+), column (\d+)|end of document)\)$")
_HEADER = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.\-]+)\s*\]\]?")
_KEY = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*=")


class RosterProblem(BaseModel):
    """One located problem; `line` and `column` are 0 when the file could not be read."""

    model_config = ConfigDict(frozen=True)

    file: str
    line: int
    column: int
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.column}" if self.line else self.file
        return f"{where} {self.field}: {self.message}" if self.field else f"{where}: {self.message}"


class RosterError(ValueError):
    """The roster is unusable; `problems` holds every problem found, in file order.

    The roster package depends on nothing of the daemon's: this carries what the daemon's
    error answer needs (`code`, `message`, `details`), and the daemon turns it into its own
    `InvalidRoster` where a client can see it."""

    code = "invalid_roster"

    def __init__(self, problems: list[RosterProblem]) -> None:
        self.problems = problems
        self.message = "\n".join(str(p) for p in problems)
        self.details: dict[str, Any] = {"errors": [p.model_dump() for p in problems]}
        super().__init__(self.message)


def default_roster_path() -> Path:
    """The roster shipped inside the package (`roster/default.toml`)."""
    return Path(str(resources.files("roster").joinpath("default.toml")))


MAX_ROSTER_BYTES = 1024 * 1024
"""A roster is a few KiB; anything past this is refused before it is read into memory."""


def read_roster_bytes(path: Path) -> bytes:
    """The file's bytes, if it is a regular file of at most MAX_ROSTER_BYTES.

    Opened non-blocking (a FIFO must not hang the reader) and checked with fstat on the open
    descriptor (no race with a swap), read with a bound (/dev/zero must not fill memory).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if info.st_size > MAX_ROSTER_BYTES:
            raise OSError(errno.EFBIG, f"larger than {MAX_ROSTER_BYTES} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_ROSTER_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_ROSTER_BYTES:  # it grew while we read
        raise OSError(errno.EFBIG, f"larger than {MAX_ROSTER_BYTES} bytes")
    return raw


def load_roster(path: Path) -> Roster:
    name = str(path)
    try:
        raw = read_roster_bytes(Path(path))
    except OSError as exc:
        problem = RosterProblem(file=name, line=0, column=0, field="", message=_os(exc))
        raise RosterError([problem]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        problem = RosterProblem(
            file=name, line=line, column=column, field="", message="file is not valid UTF-8"
        )
        raise RosterError([problem]) from None
    return load_roster_text(text, name)


def load_roster_text(text: str, name: str = "roster.toml") -> Roster:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RosterError([_syntax_problem(name, text, exc)]) from None
    except RecursionError:  # tomllib recurses per nested array or inline table
        problem = RosterProblem(
            file=name,
            line=0,
            column=0,
            field="",
            message="arrays or inline tables nest too deep to read: a roster nests a few levels",
        )
        raise RosterError([problem]) from None
    found: list[tuple[FieldPath, str, bool]] = []
    roster: Roster | None = None
    try:
        roster = Roster.model_validate(data)
    except ValidationError as exc:
        found.extend(_pydantic_problem(err, data) for err in exc.errors())
    found.extend((path, message, False) for path, message in _cross_checks(data))
    if roster is None or found:
        index = PositionIndex(text)  # a second scan of the text, needed only to locate problems
        problems: dict[tuple[int, int, str, str], RosterProblem] = {}
        for path, message, at_key in found:
            where = index.locate(path, key=at_key)
            field = format_path(path)
            problem = RosterProblem(
                file=name, line=where.line, column=where.column, field=field, message=message
            )
            problems.setdefault((where.line, where.column, field, message), problem)
        raise RosterError([problems[k] for k in sorted(problems)])
    return roster


def dump_roster(roster: Roster, path: Path) -> None:
    """Write the roster as TOML (comments are not kept: `roster.edits` keeps them) atomically."""
    write_atomic(Path(path), tomli_w.dumps(roster.model_dump(mode="json", exclude_none=True)))


def write_atomic(path: Path, text: str) -> None:
    """Replace a roster file through `daemon.files` (old or new content, never a part, after a
    crash too); it keeps its mode, and a symlink stays a link (its target is replaced)."""
    files.write_atomic(Path(path), text, mode=None, follow=True)


# -- problems -------------------------------------------------------------------------------


def _os(exc: OSError) -> str:
    return f"cannot read: {exc.strerror or exc}"


def _syntax_problem(name: str, text: str, exc: tomllib.TOMLDecodeError) -> RosterProblem:
    message = str(exc)
    match = _TOML_AT.search(message)
    if match is None:
        line, column = 1, 1
    elif match.group(1) is None:  # "at end of document"
        line = text.count("\n") + 1
        column = len(text) - (text.rfind("\n") + 1) + 1
    else:
        line, column = int(match.group(1)), int(match.group(2))
    if match is not None:
        message = message[: match.start()]
    return RosterProblem(
        file=name,
        line=line,
        column=column,
        field=format_path(_syntax_field(text, line)),
        message=f"TOML syntax: {message}",
    )


def _syntax_field(text: str, line: int) -> FieldPath:
    """The field a broken line belongs to: the last table header and key at or above it.

    The document did not parse, so this is a line scan rather than PositionIndex; it is
    right for the flat tables and arrays of tables a roster is made of.
    """
    table: FieldPath = ()
    key: str | None = None
    seen: dict[str, int] = {}
    for raw in text.splitlines()[:line]:
        header = _HEADER.match(raw)
        if header:
            name = header.group(2)
            table = tuple(name.split("."))
            if header.group(1) == "[[":
                seen[name] = seen.get(name, -1) + 1
                table = (*table, seen[name])
            key = None
        elif found := _KEY.match(raw):
            key = found.group(1)
    return (*table, key) if key else table


def _pydantic_problem(err: ErrorDetails, data: Any) -> tuple[FieldPath, str, bool]:
    path = _data_path(err["loc"], data)
    kind = err["type"]
    message = err["msg"]
    if kind == "value_error":
        message = message.removeprefix("Value error, ")
    elif kind == "too_short" and path[-1:] == ("keywords",):
        message = "empty keyword list (a lane needs at least one keyword)"
    elif kind not in ("missing", "extra_forbidden"):
        value = err.get("input")
        if isinstance(value, str) and len(value) > 60:
            value = value[:60] + f"… ({len(value)} characters)"  # a hostile value stays short
        if isinstance(value, str | int | float | bool):
            message = f"{message} (got {value!r})"
    return path, message, kind == "extra_forbidden"


def _data_path(loc: tuple[int | str, ...], data: Any) -> FieldPath:
    """Turn a pydantic loc into the path in the document.

    Drops levels the models add that the document does not have: `tiers.members` (the tiers
    table is flattened in TOML) and union/validator tags pydantic appends below a value.
    """
    out: list[str | int] = []
    node = data
    parts = list(loc)
    i = 0
    while i < len(parts):
        part = parts[i]
        if isinstance(node, dict):
            if part not in node and i + 1 < len(parts) and parts[i + 1] in node:
                i += 1  # a level that exists only in the model
                continue
            out.append(part)
            node = node.get(part) if isinstance(part, str) else None
        elif isinstance(node, list) and isinstance(part, int):
            out.append(part)
            node = node[part] if 0 <= part < len(node) else None
        elif node is None:
            out.append(part)
        else:
            break  # below a scalar: a tag, not a place in the document
        i += 1
    return tuple(out)


def _names(items: Any) -> Iterator[tuple[int, str]]:
    if isinstance(items, list):
        for i, item in enumerate(items):
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                yield i, item["name"]


def _duplicates(section: str, kind: str, items: Any) -> Iterator[tuple[FieldPath, str]]:
    first: dict[str, int] = {}
    for i, name in _names(items):
        if name in first:
            yield (
                (section, i, "name"),
                f"duplicate {kind} name {name!r} (first at {section}[{first[name]}])",
            )
        else:
            first[name] = i


def _cross_checks(data: dict[str, Any]) -> Iterator[tuple[FieldPath, str]]:
    yield from _duplicates("models", "member", data.get("models"))
    yield from _duplicates("lanes", "lane", data.get("lanes"))
    members = list(dict.fromkeys(name for _, name in _names(data.get("models"))))
    tiers = data.get("tiers")
    defined: dict[str, Any] | None = None
    if isinstance(tiers, dict):
        nested = isinstance(tiers.get("members"), dict)
        defined = tiers["members"] if nested else {k: v for k, v in tiers.items() if k != "ladder"}
        prefix: FieldPath = ("tiers", "members") if nested else ("tiers",)
        yield from _tier_checks(tiers.get("ladder"), defined, prefix, members)
    yield from _policy_checks(data.get("policy"), defined, members)
    yield from _agent_cli_checks(data, defined)
    yield from _fallback_checks(data.get("gateway"), defined, members, data.get("lanes"))
    lanes = data.get("lanes")
    examples = 0
    for i, lane in enumerate(lanes if isinstance(lanes, list) else []):
        if not isinstance(lane, dict):
            continue
        own = lane.get("examples")
        if isinstance(own, list) and examples <= MAX_EXAMPLES < examples + len(own):
            yield (
                ("lanes", i, "examples"),
                f"more than {MAX_EXAMPLES} examples across the lanes (the router indexes "
                "every one at load): keep the ones that teach something",
            )
        examples += len(own) if isinstance(own, list) else 0
        tier = lane.get("tier")
        if defined is not None and isinstance(tier, str) and tier not in defined:
            yield (("lanes", i, "tier"), f"unknown tier {tier!r} (known: {_known(defined)})")
        for field in ("keywords", "phrases", "negative"):
            words = lane.get(field)
            for j, word in enumerate(words if isinstance(words, list) else []):
                if isinstance(word, str) and not word.strip():
                    yield ("lanes", i, field, j), f"blank entry in {field}"


def _agent_cli_checks(
    data: dict[str, Any], tiers: dict[str, Any] | None
) -> Iterator[tuple[FieldPath, str]]:
    """Agent-cli members run a task's prompt, not a chat: a tier holds them or servers, not
    both, and the coordinator, judge, classifier and gateway fallbacks (chat calls) name
    servers only."""
    models = data.get("models")
    clis = {
        name
        for i, name in _names(models)
        if isinstance(models, list) and models[i].get("kind") == "agent-cli"
    }
    if not clis:
        return
    nested = isinstance(data.get("tiers"), dict) and isinstance(data["tiers"].get("members"), dict)
    prefix: FieldPath = ("tiers", "members") if nested else ("tiers",)
    cli_tiers: set[str] = set()
    for tier, names in (tiers or {}).items():
        if not isinstance(names, list):
            continue
        named = [n for n in names if isinstance(n, str)]
        if named and all(n in clis for n in named):
            cli_tiers.add(tier)
        elif any(n in clis for n in named):
            mixed = ", ".join(n for n in named if n in clis)
            yield (
                (*prefix, tier),
                f"tier {tier!r} mixes agent-cli members ({mixed}) with model servers: put them "
                "in a tier of their own (a ladder may climb to it)",
            )
    policy = data.get("policy")
    for field in ("coordinator", "judge", "classifier"):
        name = policy.get(field) if isinstance(policy, dict) else None
        if isinstance(name, str) and (name in clis or name in cli_tiers):
            yield (
                ("policy", field),
                f"{name!r} is an agent CLI: the {field} needs a model server's chat",
            )
    gateway = data.get("gateway")
    fallbacks = gateway.get("fallbacks") if isinstance(gateway, dict) else None
    for model, targets in fallbacks.items() if isinstance(fallbacks, dict) else []:
        for j, target in enumerate([model, *(targets if isinstance(targets, list) else [])]):
            bare = target.removeprefix("tier:") if isinstance(target, str) else None
            if bare is not None and (bare in clis or bare in cli_tiers):
                where: FieldPath = ("gateway", "fallbacks", model) + (() if j == 0 else (j - 1,))
                yield where, f"{target!r} is an agent CLI: the gateway serves model servers only"


def _policy_checks(
    policy: Any, tiers: dict[str, Any] | None, members: list[str]
) -> Iterator[tuple[FieldPath, str]]:
    """The coordinator, judge, classifier and embeddings name a tier or a member, like a lease
    target."""
    if not isinstance(policy, dict):
        return
    known = [*(tiers or {}), *members]
    for field in ("coordinator", "judge", "classifier", "embeddings"):
        name = policy.get(field)
        if isinstance(name, str) and name not in known:
            yield ("policy", field), f"unknown tier or member {name!r} (known: {_known(known)})"


def _fallback_checks(
    gateway: Any, tiers: dict[str, Any] | None, members: list[str], lanes: Any
) -> Iterator[tuple[FieldPath, str]]:
    """`[gateway] fallbacks` name model ids the gateway serves: members, tier:X, lane:X."""
    if not isinstance(gateway, dict) or not isinstance(gateway.get("fallbacks"), dict):
        return
    lane_names = [name for _, name in _names(lanes)]
    known = [*members, *(f"tier:{t}" for t in tiers or {}), *(f"lane:{n}" for n in lane_names)]
    for model, targets in gateway["fallbacks"].items():
        if isinstance(model, str) and model not in known:
            yield (
                ("gateway", "fallbacks", model),
                (f"unknown model {model!r}: a member, tier:NAME or lane:NAME"),
            )
        seen: set[str] = set()
        for j, target in enumerate(targets if isinstance(targets, list) else []):
            if not isinstance(target, str):
                continue
            if target not in known:
                yield (
                    ("gateway", "fallbacks", model, j),
                    (
                        f"unknown model {target!r}: a member, tier:NAME or lane:NAME "
                        f"(known: {_known(known[:20])})"
                    ),
                )
            elif target == model or target in seen:
                yield ("gateway", "fallbacks", model, j), f"{target!r} is listed twice"
            seen.add(target)


def _tier_checks(
    ladder: Any, defined: dict[str, Any], prefix: FieldPath, members: list[str]
) -> Iterator[tuple[FieldPath, str]]:
    on_ladder: set[str] = set()
    for j, tier in enumerate(ladder if isinstance(ladder, list) else []):
        if not isinstance(tier, str):
            continue
        if tier not in defined:
            yield ("tiers", "ladder", j), f"unknown tier {tier!r} (known: {_known(defined)})"
        elif tier in on_ladder:
            yield ("tiers", "ladder", j), f"tier {tier!r} is on the ladder twice"
        on_ladder.add(tier)
    for tier, names in defined.items():
        if isinstance(ladder, list) and tier not in on_ladder:
            yield (*prefix, tier), f"tier {tier!r} is not on the ladder"
        if not isinstance(names, list):
            continue
        if not names:
            yield (*prefix, tier), f"tier {tier!r} names no members"
        for k, name in enumerate(names):
            if isinstance(name, str) and members and name not in members:
                yield (*prefix, tier, k), f"unknown member {name!r} (known: {_known(members)})"


def _known(names: Any) -> str:
    return ", ".join(names) or "none"
