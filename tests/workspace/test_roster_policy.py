"""The roster's workspace settings and lane checks: defaults, and located errors."""

from __future__ import annotations

import pytest

from roster.loading import RosterError, load_roster_text

BASE = """version = 1
[policy]
attempts_per_rung = {attempts}
[policy.workspace]
roots = {roots}
[[models]]
name = "m"
url = "http://127.0.0.1:9/v1"
[tiers]
ladder = ["cheap"]
cheap = ["m"]
[[lanes]]
name = "testing"
keywords = ["test"]
tier = "cheap"
system = "s"
checks = {checks}
"""


def roster(attempts: object = 2, roots: str = '["/srv/code"]', checks: str = "[]") -> str:
    return BASE.format(attempts=attempts, roots=roots, checks=checks)


def test_defaults_hide_secrets_and_allow_no_root() -> None:
    loaded = load_roster_text(
        roster(checks='[{ type = "tests" }, { type = "run", argv = ["make"] }]')
    )
    assert loaded.policy.workspace.roots == ["/srv/code"]
    assert loaded.policy.workspace.hide == [".env*", "*.pem", "*.key", "id_*"]
    assert [c.type for c in loaded.lanes[0].checks] == ["tests", "run"]
    bare = load_roster_text(roster().replace('roots = ["/srv/code"]\n', ""))
    assert bare.policy.workspace.roots == []
    assert bare.policy.attempts_per_rung == 2


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (roster(roots='["relative/dir"]'), "roots"),
        (roster(attempts=0), "attempts_per_rung"),
        (roster(checks='[{ type = "run" }]'), "checks"),
        (roster(checks='[{ type = "tests", argv = ["x"] }]'), "checks"),
        (roster(checks='[{ type = "shell", argv = ["x"] }]'), "checks"),
    ],
)
def test_bad_settings_are_located(text: str, where: str) -> None:
    with pytest.raises(RosterError) as caught:
        load_roster_text(text)
    assert where in str(caught.value)
    assert "roster.toml:" in str(caught.value)
