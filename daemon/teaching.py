"""Routing that learns from the user: teach a lane an example, and find what to teach.

* `teach` adds a request to a lane's examples in the daemon's own roster file (comments kept,
  `roster.edits.add_example`), writes it atomically, loads it as a roster reload does, and
  witnesses a `route.teach` entry with the route before and after. The next route of that
  request, and of close paraphrases, reads the new example (daemon.examples).
* `suggest` reads the record for the corrections users already made: runs whose client named
  a lane other than the router's choice (`run.route` with source "client" and `router`
  beside it). Those the router still gets wrong are proposed as examples to teach. It only
  reads.

The packaged default roster is never edited: a daemon on it refuses teach and says how to get
a roster of one's own.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from daemon import record as rec
from daemon.errors import Conflict, InvalidInput, InvalidRoster, NotFound
from daemon.router import Decision
from daemon.runs import entries as k
from roster.edits import EditRefused, add_example
from roster.loading import RosterError, read_roster_bytes, write_atomic

if TYPE_CHECKING:
    from daemon.service import Daemon

TEACH = rec.RouteTeach.KIND  # the body: daemon.record.operations.RouteTeach

_LOCK = asyncio.Lock()  # one roster edit at a time: each reads the file the last one wrote


@dataclass(frozen=True)
class Taught:
    lane: str
    roster: str
    kept_comments: bool
    examples: int
    before: Decision
    after: Decision
    seq: int


@dataclass(frozen=True)
class Suggestion:
    lane: str
    text: str
    router: str | None
    """The lane the router chose when the client overrode it (None: a classifier's pick)."""
    now: str | None
    """The lane the router's decision gives it today."""
    runs: list[str]


TEACH_WAIT_S = 30.0
"""How long teach waits for an embedding member to embed the new example before it says
what submit does now (past it, the keyword scores alone, as submit would then)."""


async def teach(daemon: Daemon, lane: str, text: str, client: str) -> Taught:
    if daemon.roster.lane(lane) is None:
        known = ", ".join(item.name for item in daemon.roster.lanes)
        raise NotFound(f"no lane {lane!r} (lanes: {known})", details={"lane": lane})
    path = daemon.settings.roster_path
    if path is None:
        raise InvalidInput(
            "the daemon runs the packaged default roster, which teach does not edit: save a "
            "copy (`tally roster show > roster.toml`), serve with `--roster roster.toml` (or "
            "TALLY_ROSTER), then teach"
        )
    async with _LOCK:
        before = (await daemon.router.aroute(text, TEACH_WAIT_S)).decision
        try:
            raw = await asyncio.to_thread(read_roster_bytes, Path(path))
            taught = add_example(raw.decode("utf-8"), str(path), lane, text)
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidInput(f"cannot read the roster {str(path)!r}: {exc}") from None
        except RosterError as exc:
            raise InvalidRoster(exc.message, details=exc.details) from None
        except EditRefused as exc:
            error = {"conflict": Conflict, "not_found": NotFound}.get(exc.code, InvalidInput)
            raise error(exc.message, details=exc.details) from None
        await asyncio.to_thread(write_atomic, Path(path), taught.text)
        await daemon.reload_roster(client=client)
        # the new example's vector is the one the embedding member must compute anew
        after = (await daemon.router.aroute(text, TEACH_WAIT_S)).decision
        body = rec.RouteTeach(
            lane=lane,
            text=text,
            roster=str(path),
            kept_comments=taught.kept_comments,
            examples=taught.examples,
            before=rec.Decision(lane=before.lane, source=before.source),
            after=rec.Decision(lane=after.lane, source=after.source),
            client=client,
        )
        entry = await daemon.ledger.append(actor=client, kind=body.KIND, body=body.written())
    return Taught(
        lane=lane,
        roster=str(path),
        kept_comments=taught.kept_comments,
        examples=taught.examples,
        before=before,
        after=after,
        seq=entry.seq,
    )


async def suggest(daemon: Daemon, last: int, limit: int) -> tuple[list[Suggestion], int]:
    """Overrides in the last `last` ledger entries whose request the router still sends
    elsewhere, most repeated first (at most `limit`), and how many overrides were read."""
    ledger = daemon.ledger
    start = max(0, ledger.size - last)
    found: dict[tuple[str, str], Suggestion] = {}
    overrides = 0
    while True:
        batch = await ledger.entries(start=start, limit=1000, kind=k.ROUTE)
        if not batch:
            break
        bodies = await ledger.read_bodies([e.body for e in batch])
        for entry, body in zip(batch, bodies, strict=True):
            route = rec.RunRoute.parsed(body.value)
            if route is None or not _override(route) or entry.parent is None:
                continue
            overrides += 1
            request = await ledger.get(entry.parent)
            stored = (await ledger.body(request.body)).value if request.body else None
            asked = rec.RunRequest.parsed(stored)
            if asked is None or route.lane is None:
                continue  # redacted (or not a request's): nothing to teach from
            text, lane = asked.request, route.lane
            key = (lane, text)
            if key in found:
                found[key].runs.append(str(entry.run))
                continue
            now = (await daemon.router.aroute(text)).decision.lane
            if now == lane:
                continue  # already learnt
            router = route.router.lane if route.router is not None else None
            found[key] = Suggestion(lane, text, router, now, [str(entry.run)])
        start = batch[-1].seq + 1
    ranked = sorted(found.values(), key=lambda s: (-len(s.runs), s.lane, s.text))
    return ranked[:limit], overrides


def _override(route: rec.RunRoute) -> bool:
    """A client-named lane the router would not have chosen (with the router's choice kept)."""
    if route.source != "client" or route.router is None:
        return False
    return route.router.lane != route.lane
