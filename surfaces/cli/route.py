"""`tally route`: show which lane a request would go to, and why."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from surfaces.cli.roster import roster_path

if TYPE_CHECKING:
    from daemon.router import Route
    from roster.models import Roster

WAIT_S = 60.0
"""How long an offline route waits for the embedding member's example vectors (embedded once,
then cached in the state dir); past it, the keyword score, said so in `embedding.why`."""
MAX_WAIT_S = 3600.0


def read_roster(path: Path | None = None) -> Roster:
    """Load a roster file (the packaged default when None); raises OSError or RosterError."""
    from roster.loading import default_roster_path, load_roster

    return load_roster(path or default_roster_path())


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "route",
        help="show the lane a request would go to and what submit will do; teach routing",
        description="Route request text to a lane (keywords, the lanes' examples; no model "
        "call) and print `decision`, what submit will do with it. With '-', read one request "
        "per line from stdin. --teach LANE adds the request to that lane's examples in the "
        "daemon's roster (admin); --suggest lists requests users sent to another lane than "
        "the router's, to teach.",
    )
    parser.add_argument(
        "text", nargs="?", help="the request text, or '-' to read one per line from stdin"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (one object per line)")
    parser.add_argument(
        "--roster",
        metavar="FILE",
        default=None,
        help="default: $TALLY_ROSTER, else the running daemon's, else the packaged one",
    )
    parser.add_argument(
        "--teach", metavar="LANE", help="add the request to LANE's examples (via the daemon)"
    )
    parser.add_argument(
        "--suggest", action="store_true", help="requests the record says to teach (via the daemon)"
    )
    parser.add_argument("--socket", type=Path, help="daemon socket (default: $TALLY_SOCKET)")
    parser.add_argument(
        "--state",
        metavar="DIR",
        default=None,
        help="with an embedding member: the state dir whose vector cache to use (default: "
        "$TALLY_STATE_DIR, $STATE_DIRECTORY, $XDG_STATE_HOME/tally)",
    )
    parser.add_argument(
        "--wait",
        metavar="SECONDS",
        type=float,
        default=WAIT_S,
        help="with an embedding member: how long to wait for its example vectors to be "
        f"built when they are not cached yet (default {WAIT_S:g})",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from daemon.router import Router
    from roster.loading import RosterError

    if args.suggest or args.teach:
        return _on_daemon(args)
    if args.text is None:
        print("tally route: give the request text (or --suggest)", file=sys.stderr)
        return 2
    if not 0 <= args.wait <= MAX_WAIT_S:
        print(f"tally route: --wait takes 0-{MAX_WAIT_S:g} seconds", file=sys.stderr)
        return 2
    path = roster_path(args.roster)
    served = _served_roster(args)  # a running daemon's roster is what its submit routes on
    try:
        roster = served or read_roster(path)
    except (OSError, RosterError) as error:
        print(f"tally route: cannot load the roster:\n{error}", file=sys.stderr)
        return 2
    texts = (line.rstrip("\n") for line in sys.stdin) if args.text == "-" else iter([args.text])
    if roster.policy.embeddings is not None:
        return asyncio.run(_with_embeddings(args, roster, path, texts))
    router = Router(roster)
    for text in texts:  # a blank line gets its (escalating) route too: output lines match input
        _show(args, router.route(text))
    return 0


def _show(args: argparse.Namespace, route: Route) -> None:
    print(as_json(route) if args.json else as_text(route), flush=args.text == "-")


async def _with_embeddings(
    args: argparse.Namespace, roster: Roster, path: Path, texts: Iterator[str]
) -> int:
    """Route as the daemon does (`Router.aroute`), with the roster's embedding member: a
    pool of its own (a member with a command is spawned, one with a URL is called), the
    vector cache of the state dir (the daemon's, by default), and the same fallback to the
    keyword score when the member is down or its example vectors are not built in time."""
    from daemon import embeddings
    from daemon.config import default_state_dir
    from daemon.router import Router
    from daemon.slots import Pool, PoolOptions

    state = Path(args.state) if args.state else default_state_dir()
    pool = Pool(roster, state, options=PoolOptions(roster_dir=path.parent))
    found = embeddings.of(roster, pool, state)
    router = Router(roster, embeddings=found)
    try:
        await pool.start()
        for text in texts:
            _show(args, await router.aroute(text, args.wait))
    finally:
        if found is not None:
            await found.aclose()
        await pool.stop()
    return 0


def _served_roster(args: argparse.Namespace) -> Roster | None:
    """With no --roster and no $TALLY_ROSTER: the running daemon's roster, read from it (the
    packaged one is not what its submit uses when it serves `--roster FILE`); None when no
    daemon answers. Routed here, with no model call and nothing witnessed."""
    import asyncio
    import os

    if args.roster or os.environ.get("TALLY_ROSTER"):
        return None
    if not os.environ.get("TALLY_URL"):  # no socket, no daemon: the HTTP client stays unloaded
        from daemon.config import default_socket_path

        env = os.environ.get("TALLY_SOCKET")
        if not (args.socket or (Path(env) if env else default_socket_path())).exists():
            return None
    from pydantic import ValidationError

    from roster.models import Roster
    from surfaces.client import DaemonClient, DaemonDown, DaemonError, Endpoint

    async def fetch() -> Any:
        async with DaemonClient(Endpoint.from_env(args.socket), timeout=5.0) as client:
            return (await client.call("roster_get", {}))["roster"]

    try:
        return Roster.model_validate(asyncio.run(fetch()))
    except (DaemonDown, DaemonError, OSError, TimeoutError, KeyError, TypeError, ValidationError):
        return None  # no daemon (or one that cannot say): the packaged roster, as before


def _on_daemon(args: argparse.Namespace) -> int:
    """--teach and --suggest: the daemon edits its roster and reads its record."""
    from surfaces.client import DaemonClient, Endpoint, run_client

    if args.teach and (args.text is None or args.text == "-"):
        print("tally route: --teach LANE needs the request text", file=sys.stderr)
        return 2
    tool, body = (
        ("route_teach", {"lane": args.teach, "text": args.text})
        if args.teach
        else ("route_suggest", {})
    )

    async def main() -> int:
        async with DaemonClient(Endpoint.from_env(args.socket)) as client:
            answer = await client.call(tool, body)
        if args.json:
            print(json.dumps(answer, ensure_ascii=False))
        else:
            print(taught_text(answer) if args.teach else suggest_text(answer))
        return 0

    return run_client(main())


def taught_text(answer: dict[str, Any]) -> str:
    kept = "comments kept" if answer["kept_comments"] else "REGENERATED: its comments are gone"
    return "\n".join(
        [
            f"taught {answer['lane']} (now {answer['examples']} examples) in {answer['roster']}"
            f" ({kept}); witnessed at seq {answer['seq']}",
            f"before: {answer['before']['summary']}",
            f"now:    {answer['after']['summary']}",
        ]
    )


def suggest_text(answer: dict[str, Any]) -> str:
    found = answer["suggestions"]
    lines = [f"{answer['overrides']} runs overrode the router; {len(found)} to teach"]
    for s in found:
        router = s["router"] or "classifier"
        lines.append(f"  {len(s['runs'])}x  {s['lane']} (router: {router}, now: {s['now']})")
        lines.append(f"      {s['teach']}")
    return "\n".join(lines)


def as_json(route: Route) -> str:
    """The route tool's answer (`daemon.tools.roster.RouteOut`: the same fields, `decision` with its
    `summary`), scores as [lane, score] pairs; built here so `tally route` loads no HTTP stack."""
    data = route.model_dump(mode="json")
    data["decision"]["summary"] = str(route.decision)
    data["embedding"] = None if route.embedding is None else route.embedding.shown()
    return json.dumps(data, ensure_ascii=False)


def as_text(route: Route) -> str:
    decision = route.decision
    if route.lane is not None:
        how = f"decided, confidence {route.confidence:.3f}"
    elif route.scores:
        how = f"escalated, confidence {route.confidence:.3f} (too close to call)"
    else:
        how = "no lane's words or examples match it enough"
    lines = [f"decision:   {decision}", f"route:      {how}"]
    for lane, score in route.scores[:3]:
        why = []
        if words := route.matched.get(lane):
            why.append("keywords " + ", ".join(words))
        if similar := route.similar.get(lane):
            why.append("like its examples: " + ", ".join(similar))
        if example := route.examples.get(lane):
            why.append(f"nearest example {json.dumps(example, ensure_ascii=False)}")
        lines.append(f"  {score:.3f}  {lane:<14} {'; '.join(why)}")
    if (e := route.embedding) is not None:
        if not e.used:
            lines.append(f"embedding:  {e.member} not used: {e.why}")
        else:
            lines.append(f"embedding:  {e.member}, {e.examples} example vectors, {e.ms} ms")
            for lane, value, text in e.top(3):
                shown = json.dumps(text, ensure_ascii=False)
                lines.append(f"  {value:.3f}  {lane:<14} nearest example {shown}")
    return "\n".join(lines)
