"""Per-set routing accuracy of a roster on the sets it may be tuned or checked on.

    python -m tests.routing.report [--roster PATH] [--errors SET ...]

Prints dev, dev2 (tuned on and holdout apart), fresh, blind and labelled. It never reads the
new-user set (the held-back one) and prints the errors only of the sets named with --errors,
so the holdout lines stay unread while tuning.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from daemon.router import Router
from surfaces.cli.route import read_roster
from tests.routing.labelled import LABELLED, Example, evaluate, load


def sets() -> dict[str, list[Example]]:
    folder = LABELLED.parent
    dev2 = load(folder / "dev2.jsonl")
    return {
        "dev": load(folder / "dev.jsonl"),
        "dev2-tuned": [e for e in dev2 if not e.holdout],
        "dev2-holdout": [e for e in dev2 if e.holdout],
        "fresh": load(folder / "fresh.jsonl"),
        "blind": load(folder / "blind.jsonl"),
        "labelled": load(LABELLED),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--roster", type=Path, help="a roster file (default: the packaged one)")
    parser.add_argument("--errors", nargs="*", default=[], help="sets whose errors to print")
    args = parser.parse_args()
    router = Router(read_roster(args.roster))
    print(f"{'set':13} {'n':>4} {'escalated':>15} {'top-1':>15} {'should-escalate':>15}")
    for name, examples in sets().items():
        acc = evaluate(router, examples)
        escalated = f"{acc.escalation_rate:.1%} ({acc.in_roster - acc.decided}/{acc.in_roster})"
        top1 = f"{acc.top1:.1%} ({acc.correct}/{acc.decided})"
        recall = f"{acc.escalation_recall:.1%} ({acc.escalated}/{acc.should_escalate})"
        print(f"{name:13} {len(examples):4} {escalated:>15} {top1:>15} {recall:>15}")
        if name in args.errors:
            for text, want, got in acc.errors:
                print(f"    want {want} got {got}: {text}")


if __name__ == "__main__":
    main()
