"""`tally compare A B`, `tally replay RUN [--at SEQ]`, `tally ledger summary`: the console's
readings without a browser, answered by the daemon's tools (run_compare, run_replay,
ledger_summary)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

COMPARE_ROWS = (
    ("state", "state"),
    ("lane", "lane"),
    ("tasks", "tasks"),
    ("model calls", "model_calls"),
    ("tokens", "tokens"),
    ("wall ms", "wall_ms"),
    ("escalations", "escalations"),
    ("verdicts passed", "verdicts_ok"),
    ("verdicts failed", "verdicts_failed"),
    ("answer", "answer"),
)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--socket", type=Path, help="daemon socket (default: $TALLY_SOCKET or runtime)")


def register(commands: argparse._SubParsersAction[Any]) -> None:
    p = commands.add_parser("compare", help="two runs side by side (model calls, tokens, …)")
    p.add_argument("a", metavar="RUN_A")
    p.add_argument("b", metavar="RUN_B")
    _common(p)
    p.set_defaults(run=_on_daemon("run_compare", lambda a: {"a": a.a, "b": a.b}, compare_table))
    p = commands.add_parser("replay", help="a run's state as it stood at a seq (no model call)")
    p.add_argument("run_id", metavar="RUN")
    p.add_argument("--at", type=int, metavar="SEQ", help="the ledger seq to stop at")
    _common(p)
    p.set_defaults(run=_on_daemon("run_replay", _replay_args, replay_text))


def register_summary(sub: argparse._SubParsersAction[Any]) -> None:
    """`tally ledger summary`, added to the ledger group (through the daemon, not offline)."""
    p = sub.add_parser("summary", help="counts, tokens and time per member (via the daemon)")
    p.add_argument("--run", dest="run_id")
    p.add_argument("--client")
    _common(p)
    p.set_defaults(run=_on_daemon("ledger_summary", _summary_args, summary_text))


def _replay_args(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"run_id": args.run_id}
    if args.at is not None:
        body["at"] = args.at
    return body


def _summary_args(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if args.run_id:
        body["run"] = args.run_id
    if args.client:
        body["client"] = args.client
    return body


def _on_daemon(tool: str, arguments: Any, text: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        from surfaces.client import DaemonClient, Endpoint, run_client

        async def main() -> int:
            async with DaemonClient(Endpoint.from_env(args.socket)) as client:
                body = await client.call(tool, arguments(args))
            print(json.dumps(body, indent=2) if args.json else text(body))
            return 0

        return run_client(main())

    return run


def _cell(value: Any, width: int = 40) -> str:
    text = "" if value is None else " ".join(str(value).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def compare_table(body: dict[str, Any]) -> str:
    a, b = body["a"], body["b"]
    rows = [("", _cell(a["id"]), _cell(b["id"]))]
    rows += [(label, _cell(a.get(key)), _cell(b.get(key))) for label, key in COMPARE_ROWS]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def replay_text(run: dict[str, Any]) -> str:
    from surfaces.cli.runs import status_line

    lines = [status_line(run)]
    for task in run.get("tasks") or []:
        result = f" → {_cell(task.get('result'), 60)}" if task.get("result") else ""
        lines.append(f"  {task['id']} [{task.get('lane')}] {task['state']}{result}")
    if run.get("answer"):
        lines.append(f"answer: {run['answer']}")
    return "\n".join(lines)


def summary_text(body: dict[str, Any]) -> str:
    lines = [
        f"entries {body['entries']} · model calls: runs {body['model_calls']}, gateway "
        f"{body.get('gateway_calls', 0)} answered + {body.get('gateway_errors', 0)} failed"
        f" · run tokens {body['tokens']} · escalations {body['escalations']}",
        "by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(body["by_kind"].items())),
    ]
    for name, m in sorted(body["per_member"].items()):
        rate = m["completion_tokens"] / (m["ms"] / 1000) if m["ms"] else 0.0
        lines.append(  # runs' model.call entries only: the gateway's calls are below
            f"member {name} (runs): {m['calls']} calls, {m['prompt_tokens']}+"
            f"{m['completion_tokens']} tokens, {m['ms']} ms, {rate:.1f} tok/s, {m['errors']} errors"
        )
    for client, models in sorted(body.get("gateway", {}).items()):
        for model, g in sorted(models.items()):
            lines.append(
                f"gateway {client} → {model}: {g['calls']} answered + {g['errors']} failed, "
                f"{g['prompt_tokens']}+{g['completion_tokens']} tokens, {g['ms']} ms"
            )
    for name, c in sorted(body.get("by_client", {}).items()):
        lines.append(f"client {name}: {c['runs']} runs, {c['entries']} entries")
    if body.get("runs_by_state"):
        states = ", ".join(f"{k} {n}" for k, n in sorted(body["runs_by_state"].items()))
        lines.append(f"runs: {states}")
    verify = body.get("verify")
    if verify is not None:
        lines.append("verify: ok" if verify["ok"] else f"verify: FAILED ({verify.get('reason')})")
    return "\n".join(lines)
