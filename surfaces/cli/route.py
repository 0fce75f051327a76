"""`tally route`: show which lane a request would go to, and why."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from surfaces.cli.roster import roster_path

if TYPE_CHECKING:
    from daemon.routing import Route
    from roster.models import Roster


def read_roster(path: Path | None = None) -> Roster:
    """Load a roster file (the packaged default when None); raises OSError or RosterError."""
    from roster.loading import default_roster_path, load_roster

    return load_roster(path or default_roster_path())


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "route",
        help="show the lane a request would be routed to",
        description="Route request text to a lane with the keyword router (no model call). "
        "With '-', read one request per line from stdin.",
    )
    parser.add_argument("text", help="the request text, or '-' to read one per line from stdin")
    parser.add_argument("--json", action="store_true", help="print JSON (one object per line)")
    parser.add_argument(
        "--roster", metavar="FILE", default=None, help="default: $TALLY_ROSTER or packaged"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from daemon.routing import Router
    from roster.loading import RosterError

    try:
        roster = read_roster(roster_path(args.roster))
    except (OSError, RosterError) as error:
        print(f"tally route: cannot load the roster:\n{error}", file=sys.stderr)
        return 2
    router = Router(roster)
    texts = (line.rstrip("\n") for line in sys.stdin) if args.text == "-" else iter([args.text])
    for text in texts:  # a blank line gets its (escalating) route too: output lines match input
        route = router.route(text)
        print(as_json(route) if args.json else as_text(route), flush=args.text == "-")
    return 0


def as_json(route: Route) -> str:
    return json.dumps(
        {
            "lane": route.lane,
            "confidence": route.confidence,
            "escalate": route.escalate,
            "scores": [[lane, score] for lane, score in route.scores],
            "matched": route.matched,
        },
        ensure_ascii=False,
    )


def as_text(route: Route) -> str:
    head = route.lane or "(escalate: no lane is clear enough; a classifier would decide)"
    lines = [f"lane:       {head}", f"confidence: {route.confidence:.3f}"]
    for lane, score in route.scores[:3]:
        words = ", ".join(route.matched.get(lane, []))
        lines.append(f"  {score:.3f}  {lane:<14} {words}")
    if not route.scores:
        lines.append("  (no keyword of any lane matched)")
    return "\n".join(lines)
