"""Loading with located errors, cross-checks, and the atomic dump."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from roster import (
    Roster,
    RosterError,
    RosterProblem,
    default_roster_path,
    dump_roster,
    load_roster,
    load_roster_text,
)
from tests.roster.conftest import GOOD


def problems_of(text: str) -> list[RosterProblem]:
    with pytest.raises(RosterError) as caught:
        load_roster_text(text)
    return caught.value.problems


def located(text: str) -> list[tuple[int, int, str]]:
    return [(p.line, p.column, p.field) for p in problems_of(text)]


def test_good_roster_loads() -> None:
    roster = load_roster_text(GOOD)
    assert [lane.name for lane in roster.lanes] == ["backend", "frontend"]
    assert roster.tiers.members == {"cheap": ["tiny"], "capable": ["big"]}
    assert roster.models[0].sampling.seed == 42
    assert roster.policy.max_parallel == 3


def test_syntax_error_carries_tomllib_line_and_column() -> None:
    text = GOOD.replace("slots = 2", "slots = = 2")
    [problem] = problems_of(text)
    assert (problem.line, problem.column) == (11, 9)
    assert problem.field == "models[0].slots"
    assert problem.message.startswith("TOML syntax: Invalid value")
    assert str(problem) == "roster.toml:11:9 models[0].slots: TOML syntax: Invalid value"


def test_syntax_error_at_end_of_document() -> None:
    [problem] = problems_of('a = "open\n'[:-1])
    assert problem.line == 1
    assert "TOML syntax" in problem.message


def test_all_validation_errors_at_once_with_their_lines() -> None:
    text = (
        GOOD.replace("max_parallel = 3", "max_parallel = 0")
        .replace('model_id = "qwen"', 'model_id = "qwen"\nslots = "two"')
        .replace('tier = "capable"', 'tier = "capabel"')
        .replace("max_concurrency = 2", 'max_concurrency = 2\ncolour = "red"')
    )
    assert located(text) == [
        (4, 16, "policy.max_parallel"),
        (18, 9, "models[1].slots"),
        (36, 8, "lanes[1].tier"),
        (39, 1, "lanes[1].colour"),
    ]
    with pytest.raises(RosterError) as caught:
        load_roster_text(text)
    err = caught.value
    lines = str(err).splitlines()
    assert len(lines) == 4
    assert (
        lines[2] == "roster.toml:36:8 lanes[1].tier: unknown tier 'capabel' (known: cheap, capable)"
    )
    assert err.code == "invalid_roster"
    assert err.details["errors"][0]["field"] == "policy.max_parallel"


@pytest.mark.parametrize(
    ("old", "new", "where", "message"),
    [
        ('tier = "cheap"', 'tier = "middle"', (28, 8, "lanes[0].tier"), "unknown tier 'middle'"),
        (
            'name = "frontend"',
            'name = "backend"',
            (32, 8, "lanes[1].name"),
            "duplicate lane name 'backend' (first at lanes[0])",
        ),
        (
            "[tiers]",
            '[[models]]\nname = "big"\nurl = "http://h/v1"\n\n[tiers]',
            (20, 8, "models[2].name"),
            "duplicate member name 'big' (first at models[1])",
        ),
        (
            'capable = ["big"]',
            'capable = ["big", "huge"]',
            (22, 19, "tiers.capable[1]"),
            "unknown member 'huge' (known: tiny, big)",
        ),
        (
            'ladder = ["cheap", "capable"]',
            'ladder = ["cheap", "capable", "best"]',
            (20, 31, "tiers.ladder[2]"),
            "unknown tier 'best'",
        ),
        (
            'ladder = ["cheap", "capable"]',
            'ladder = ["cheap"]',
            (22, 11, "tiers.capable"),
            "tier 'capable' is not on the ladder",
        ),
        ('cheap = ["tiny"]', "cheap = []", (21, 9, "tiers.cheap"), "tier 'cheap' names no members"),
        (
            'keywords = ["api", "server", "endpoint"]',
            "keywords = []",
            (26, 12, "lanes[0].keywords"),
            "empty keyword list",
        ),
        (
            'keywords = ["api", "server", "endpoint"]',
            'keywords = ["api", "  "]',
            (26, 20, "lanes[0].keywords[1]"),
            "blank entry in keywords",
        ),
        (
            '"--port", "{port}"]',
            '"--port", "8080"]',
            (9, 11, "models[0].command"),
            "template must contain {port}",
        ),
        (
            '"--port", "{port}"]',
            '"--port", "{port}", "{slot}"]',
            (9, 11, "models[0].command"),
            "unknown placeholder {slot}",
        ),
        (
            'url = "http://127.0.0.1:11434/v1"',
            "",
            (14, 1, "models[1]"),
            "exactly one of 'command'",
        ),
        (
            'system = "You build services."',
            "",
            (24, 1, "lanes[0].system"),
            "Field required",
        ),
        (
            "threshold = 0.3",
            'threshold = 0.3\ncoordinator = "capabel"',
            (6, 15, "policy.coordinator"),
            "unknown tier or member 'capabel' (known: cheap, capable, tiny, big)",
        ),
        (
            'name = "frontend"',
            'name = "Front End"',
            (32, 8, "lanes[1].name"),
            "String should match pattern",
        ),
    ],
)
def test_each_check_is_located(
    old: str, new: str, where: tuple[int, int, str], message: str
) -> None:
    assert old in GOOD
    problems = problems_of(GOOD.replace(old, new, 1))
    assert [(p.line, p.column, p.field) for p in problems] == [where], problems
    assert message in problems[0].message


def test_tiers_errors_are_located_without_the_model_only_members_level() -> None:
    problems = problems_of(GOOD.replace('cheap = ["tiny"]', 'cheap = ["tiny", 3]'))
    assert [(p.line, p.column, p.field) for p in problems] == [(21, 18, "tiers.cheap[1]")]


def test_load_roster_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(GOOD.replace('tier = "cheap"', 'tier = "x"'))
    with pytest.raises(RosterError) as caught:
        load_roster(path)
    assert str(caught.value).startswith(f"{path}:28:8 lanes[0].tier: unknown tier 'x'")


def test_missing_and_undecodable_files(tmp_path: Path) -> None:
    with pytest.raises(RosterError, match="cannot read"):
        load_roster(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'a = 1\nb = "\xff"\n')
    with pytest.raises(RosterError) as caught:
        load_roster(bad)
    [problem] = caught.value.problems
    assert (problem.line, problem.column, problem.message) == (2, 6, "file is not valid UTF-8")


def test_round_trip(tmp_path: Path) -> None:
    roster = load_roster_text(GOOD)
    path = tmp_path / "roster.toml"
    dump_roster(roster, path)
    assert load_roster(path) == roster
    dump_roster(roster, path)  # replacing an existing file
    assert load_roster(path) == roster


def test_dump_is_atomic_and_fsyncs_file_and_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    roster = load_roster_text(GOOD)
    path = tmp_path / "roster.toml"
    path.write_text("old")
    path.chmod(0o640)
    synced: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.path.isdir(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    dump_roster(roster, path)
    assert synced == [False, True]  # the temp file, then the directory
    assert path.stat().st_mode & 0o777 == 0o640
    assert os.listdir(tmp_path) == ["roster.toml"]


def test_failed_dump_leaves_the_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "roster.toml"
    path.write_text("old")

    def boom(src: str, dst: str) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        dump_roster(load_roster_text(GOOD), path)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["roster.toml"]


def test_default_roster_path_is_inside_the_package() -> None:
    path = default_roster_path()
    assert path.name == "default.toml"
    assert path.parent.name == "roster"


def test_the_packaged_default_roster_loads_cleanly() -> None:
    roster = load_roster(default_roster_path())
    assert isinstance(roster, Roster)
    assert len(roster.lanes) >= 24


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("threshold = 0.3", "threshold = 0.3.3", "policy.threshold"),
        ('name = "frontend"', 'name = "frontend', "lanes[1].name"),
        ('url = "http://127.0.0.1:11434/v1"', "url = http://127.0.0.1", "models[1].url"),
    ],
)
def test_syntax_errors_name_the_field_they_break(old: str, new: str, field: str) -> None:
    [problem] = problems_of(GOOD.replace(old, new, 1))
    assert problem.field == field, problem


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://host/v1", "http:// or https:// server URL with a host"),
        ("127.0.0.1:11434", "http:// or https:// server URL with a host"),
        ("http:///v1", "with a host"),
        ("http://host:99999/v1", "bad port"),
        ("http://host/v1?key=secret", "no spaces, query"),
        ("http://user:pw@host/v1", "no spaces, query"),
        ("http://host/v 1", "no spaces, query"),
    ],
)
def test_an_external_members_url_must_be_a_server_url(url: str, message: str) -> None:
    good = next(line for line in GOOD.splitlines() if line.startswith("url = "))
    [problem] = problems_of(GOOD.replace(good, f'url = "{url}"'))
    assert problem.field.endswith(".url")
    assert message in problem.message
