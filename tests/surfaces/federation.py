"""Two daemons, the second calling the first as a member: its roster and a run through it."""

from __future__ import annotations

from daemon.service import Daemon

TOKEN_ENV = "FEDERATION_TEST_TOKEN"


def second_roster(url: str, key: str) -> str:
    return f"""version = 1
[[models]]
name = "first"
url = "{url}"
model_id = "tier:cheap"
tally = true
tally_key = "{key}"
api_key_env = "{TOKEN_ENV}"
slots = 2

[tiers]
ladder = ["remote"]
remote = ["first"]

[[lanes]]
name = "docs"
keywords = ["docs"]
tier = "remote"
system = "You write docs."
"""


async def run_through(second: Daemon) -> str:
    view = await second.engine.submit("write the docs", lane="docs")
    view = await second.engine.wait(view.id, timeout=30)
    assert view.state == "done", view.error
    return view.id
