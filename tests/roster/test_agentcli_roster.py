"""Agent-cli members in the roster: what loads, and hostile entries refused with the file,
line and field of the problem and what to do."""

from __future__ import annotations

import pytest

from roster import RosterError, RosterProblem, load_roster_text
from roster.models import Member

HEAD = """version = 1

[[models]]
name = "tiny"
url = "http://127.0.0.1:9/v1"

"""
TAIL = """
[tiers]
ladder = ["cheap", "agents"]
cheap = ["tiny"]
agents = ["cli"]

[[lanes]]
name = "backend"
keywords = ["backend"]
tier = "cheap"
system = "You do backend work."
"""
GOOD = """[[models]]
name = "cli"
kind = "agent-cli"
argv = ["aider", "--yes", "--message-file", "{prompt_file}"]
prompt = "file"
env = ["OPENAI_API_KEY"]
set_env = { AIDER_CHECK_UPDATE = "false" }
network = true
ro_binds = ["~/.config/aider", "/opt/aider"]
"""


def roster(member: str, tail: str = TAIL) -> str:
    return HEAD + member + tail


def problems(text: str) -> list[RosterProblem]:
    with pytest.raises(RosterError) as caught:
        load_roster_text(text, "agents.toml")
    return caught.value.problems


def test_an_agent_cli_member_loads_and_names_what_it_is() -> None:
    loaded = load_roster_text(roster(GOOD))
    member = loaded.member("cli")
    assert member is not None
    assert member.agent_cli
    assert member.argv == ["aider", "--yes", "--message-file", "{prompt_file}"]
    assert member.prompt == "file"
    assert member.env == ["OPENAI_API_KEY"]
    tiny = loaded.member("tiny")
    assert tiny is not None
    assert not tiny.agent_cli
    assert tiny.kind is None  # an existing member's fields and dump stay as they were
    assert "kind" not in tiny.model_dump(exclude_none=True)


def test_an_argv_that_is_not_a_list_is_located_at_its_line_and_field() -> None:
    member = GOOD.replace(
        'argv = ["aider", "--yes", "--message-file", "{prompt_file}"]',
        'argv = "aider --yes"',
    )
    (found,) = problems(roster(member))
    assert found.file == "agents.toml"
    assert (found.line, found.field) == (10, "models[1].argv")
    assert "list" in found.message


@pytest.mark.parametrize(
    ("line", "field", "said"),
    [
        ('argv = ["llm", "--key", "sk-abcdefghijklmnopqrstuv"]', "argv", "looks like a secret"),
        ('argv = ["llm", "--api-key=hunter2hunter2"]', "argv", "looks like a secret"),
        ('argv = ["llm", "--key", "literal"]', "argv", "looks like a secret"),
        ('argv = ["bin/aider"]', "argv", "a name found on PATH or an absolute path"),
        ('argv = ["{prompt}"]', "argv", "cannot be a placeholder"),
        ('argv = ["llm", "{secret}"]', "argv", "unknown placeholder {secret}"),
        ('argv = ["llm", "a\\u0000b"]', "argv", "NUL"),
        ("argv = []", "argv", "at least 1 item"),
        ('env = ["OPENAI_API_KEY=sk-abcdefghijklmnop"]', "env", "not an environment variable"),
        ('env = ["TALLY_TOKEN"]', "env", "never passed to a CLI"),
        ('env = ["HOME"]', "env", "set by the sandbox"),
        ('set_env = { OPENAI_API_KEY = "abc" }', "set_env", "looks like a secret"),
        ('set_env = { BASE = "sk-abcdefghijklmnopqrstu" }', "set_env", "like a secret"),
        ('ro_binds = ["config/llm"]', "ro_binds", "absolute path"),
        ('ro_binds = ["/opt/../root"]', "ro_binds", "without '..'"),
        ('ro_binds = ["/proc/1/root"]', "ro_binds", "not a place to bind"),
        ('ro_binds = ["/"]', "ro_binds", "not a place to bind"),
        ('ro_binds = ["/home"]', "ro_binds", "not a place to bind"),
        ('prompt = "pipe"', "prompt", "'stdin', 'file' or 'arg'"),
    ],
)
def test_a_hostile_field_is_refused_where_it_is(line: str, field: str, said: str) -> None:
    key = line.split(" =", 1)[0]
    lines = [ln for ln in GOOD.splitlines() if not ln.startswith(f"{key} =")]
    if key == "argv":  # keep the prompt consistent: only the argv is wrong
        lines = [ln for ln in lines if not ln.startswith("prompt =")]
    text = roster("\n".join([*lines, line]) + "\n")
    found = problems(text)
    assert any(p.field.startswith(f"models[1].{field}") and said in p.message for p in found), [
        str(p) for p in found
    ]
    where = text.splitlines().index(line) + 1
    assert any(p.line == where for p in found)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (('prompt = "file"', 'prompt = "arg"'), "no {prompt} to put it in"),
        (('prompt = "file"', 'prompt = "stdin"'), "uses {prompt_file} but prompt = 'stdin'"),
        (('kind = "agent-cli"', 'kind = "agent-cli"\nurl = "http://127.0.0.1:9/v1"'), "remove url"),
        (('kind = "agent-cli"\n', ""), "belong to agent-cli members"),
        (('argv = ["aider", "--yes", "--message-file", "{prompt_file}"]\n', ""), "needs 'argv'"),
    ],
)
def test_a_member_that_is_neither_a_server_nor_a_cli_says_which_it_should_be(
    change: tuple[str, str], said: str
) -> None:
    found = problems(roster(GOOD.replace(*change)))
    assert any(p.field == "models[1]" and said in p.message for p in found), [str(p) for p in found]
    assert all(p.line == 7 for p in found if p.field == "models[1]")  # its [[models]]


def test_a_tier_mixing_clis_and_servers_and_a_chat_role_on_a_cli_are_refused() -> None:
    mixed = TAIL.replace('cheap = ["tiny"]', 'cheap = ["tiny", "cli"]')
    (found,) = [p for p in problems(roster(GOOD, mixed)) if "mixes" in p.message]
    assert found.field == "tiers.cheap"
    assert "put them in a tier of their own" in found.message
    judged = '[policy]\njudge = "agents"\n\n' + roster(GOOD).removeprefix("version = 1\n")
    (found,) = problems("version = 1\n" + judged)
    assert found.field == "policy.judge"
    assert "needs a model server's chat" in found.message


def test_the_pool_and_the_gateway_leave_agent_clis_out() -> None:
    from daemon.slots.pool import Pool

    loaded = load_roster_text(roster(GOOD))
    pool = Pool(loaded, "/nonexistent-state")
    assert [m.name for m in pool.status().members] == ["tiny"]
    assert list(pool.tiers()) == ["cheap"]


def test_members_of_both_kinds_round_trip_through_their_dump() -> None:
    loaded = load_roster_text(roster(GOOD))
    for member in loaded.models:
        dumped = member.model_dump(mode="json", exclude_none=True)
        assert Member.model_validate(dumped) == member
