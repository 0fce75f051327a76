"""Adding a member to a roster file as text: the result always loads to exactly the roster the
edit means, comments stay where the text allows it, and a file the edit cannot follow is
regenerated instead of corrupted."""

from __future__ import annotations

import pytest

from roster import Member, RosterError, Sampling, default_roster_path, load_roster_text
from roster.edits import EditRefused, add_member, member_table

DEFAULT = default_roster_path().read_text()
QWEN = Member(name="qwen", url="http://127.0.0.1:11434/v1", model_id="qwen2.5:7b")


@pytest.mark.parametrize("tier", ["cheap", "capable", "new"])
@pytest.mark.parametrize("mode", ["only", "first"])
def test_every_tier_and_mode_on_the_default_roster_keeps_its_comments(tier: str, mode: str) -> None:
    added = add_member(DEFAULT, "r.toml", QWEN, tier=tier, mode=mode)  # type: ignore[arg-type]
    assert added.kept_comments
    assert load_roster_text(added.text) == added.roster
    assert "# Lanes. Engineering" in added.text
    members = added.roster.tiers.members[tier]
    if tier == "new":
        assert (members, added.roster.tiers.ladder[-1], added.tier_before) == (
            ["qwen"],
            "new",
            None,
        )
    elif mode == "only":
        assert members == ["qwen"]
    else:
        assert members == ["qwen", "tiny"]
    untouched = {"cheap", "capable"} - {tier}
    for other in untouched:
        assert added.roster.tiers.members[other] == ["tiny"]


def test_replacing_a_member_with_subtables_keeps_the_comments_after_it() -> None:
    first = add_member(DEFAULT, "r.toml", QWEN, tier="capable")
    sampled = QWEN.model_copy(update={"model_id": "qwen2.5:14b", "sampling": Sampling(seed=3)})
    again = add_member(first.text, "r.toml", sampled, tier=None, replace=True)
    assert again.kept_comments
    assert again.replaced
    member = again.roster.member("qwen")
    assert member is not None
    assert (member.model_id, member.sampling.seed) == ("qwen2.5:14b", 3)
    assert again.text.count("[[models]]") == first.text.count("[[models]]")
    assert "# Point capable at a stronger member" in again.text
    tiny = load_roster_text(DEFAULT).member("tiny")
    assert tiny is not None
    replaced_tiny = add_member(DEFAULT, "r.toml", tiny.model_copy(update={"slots": 3}), tier=None,
                               replace=True)  # fmt: skip
    assert replaced_tiny.kept_comments
    assert "# A stronger local member spawned" in replaced_tiny.text  # after its [models.sampling]


def test_an_existing_member_is_not_clobbered() -> None:
    with pytest.raises(EditRefused, match="already has a member named 'tiny'") as refused:
        add_member(DEFAULT, "r.toml", QWEN.model_copy(update={"name": "tiny"}), tier=None)
    assert refused.value.code == "conflict"


def test_an_invalid_roster_is_not_edited() -> None:
    with pytest.raises(RosterError):
        add_member(
            DEFAULT.replace('tier = "cheap"', 'tier = "cheep"', 1), "r.toml", QWEN, tier=None
        )


def test_header_lookalikes_inside_strings_do_not_fool_the_edit() -> None:
    # a header-shaped line inside a multi-line string, just where the new member would go
    text = (
        'version = 1\n[[models]]\nname = "a"\nurl = "http://127.0.0.1:1/v1"\n'
        'model_id = """\n[tiers]\n"""\n\n[tiers]\nladder = ["t"]\nt = ["a"]\n'
        '[[lanes]]\nname = "x"\nkeywords = ["x"]\ntier = "t"\nsystem = "s"\n'
    )
    base = load_roster_text(text)
    added = add_member(text, "r.toml", QWEN, tier="t", mode="first")
    assert load_roster_text(added.text) == added.roster
    assert added.roster.member("a") == base.member("a")  # the string is untouched
    assert added.roster.tiers.members["t"] == ["qwen", "a"]
    assert not added.kept_comments  # the text edit went wrong, so it was regenerated


def test_member_table_is_a_table_never_an_inline_one() -> None:
    table = member_table(Member(name="a", url="http://h/v1"))
    assert table.startswith('[[models]]\nname = "a"\n')
    assert "slots = 1" in table
    assert "ctx = 4096" in table
