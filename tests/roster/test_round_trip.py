"""Property: load(dump(r)) == r for generated rosters."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from roster import (
    Budget,
    Lane,
    Member,
    Policy,
    Roster,
    Sampling,
    Tiers,
    dump_roster,
    load_roster,
)

names = st.from_regex(r"[a-z0-9][a-z0-9_.-]{0,8}", fullmatch=True)
words = st.text(
    st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=15
).filter(str.strip)
# Extra argv words must not look like placeholders.
argv_words = words.map(lambda w: w.replace("{", "("))
maybe_float = st.none() | st.floats(0.01, 5, allow_nan=False)


@st.composite
def rosters(draw: st.DrawFn) -> Roster:
    member_names = draw(st.lists(names, min_size=1, max_size=3, unique=True))
    models = []
    for name in member_names:
        sampling = Sampling(
            temperature=draw(maybe_float),
            top_k=draw(st.none() | st.integers(0, 100)),
            seed=draw(st.none() | st.integers(-(2**31), 2**31)),
        )
        if draw(st.booleans()):
            argv = ["{python}", "-m", "srv", "--port", "{port}"]
            member = Member(
                name=name,
                command=argv + draw(st.lists(argv_words, max_size=2)),
                model=draw(st.none() | words),
                slots=draw(st.integers(1, 8)),
                idle_unload_s=draw(st.none() | st.floats(1, 1e6)),
                sampling=sampling,
            )
        else:
            member = Member(
                name=name, url="http://127.0.0.1:1/v1", model_id=draw(words), sampling=sampling
            )
        models.append(member)
    tier_names = draw(st.lists(names, min_size=1, max_size=3, unique=True))
    tiers = Tiers(
        ladder=tier_names,
        members={
            t: draw(st.lists(st.sampled_from(member_names), min_size=1, max_size=2))
            for t in tier_names
        },
    )
    lanes = [
        Lane(
            name=name,
            keywords=draw(st.lists(words, min_size=1, max_size=4)),
            phrases=draw(st.lists(words, max_size=2)),
            negative=draw(st.lists(words, max_size=2)),
            tier=draw(st.sampled_from(tier_names)),
            system=draw(words),
            max_concurrency=draw(st.none() | st.integers(1, 9)),
        )
        for name in draw(st.lists(names, min_size=1, max_size=4, unique=True))
    ]
    policy = Policy(
        max_parallel=draw(st.integers(1, 64)),
        threshold=draw(st.floats(0, 1)),
        budget=Budget(model_calls=draw(st.none() | st.integers(1, 100)), wall_s=draw(maybe_float)),
        on_task_failure=draw(st.sampled_from(["fail", "continue"])),
    )
    return Roster(policy=policy, models=models, tiers=tiers, lanes=lanes)


@settings(max_examples=60, deadline=None)
@given(rosters())
def test_load_of_dump_is_identity(roster: Roster) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "roster.toml"
        dump_roster(roster, path)
        assert load_roster(path) == roster
