"""Prometheus text for GET /metrics, from in-memory counters only (never O(ledger)).

Sources: the engine's runs in memory, the pool's status, the ledger's `stats` counters.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from daemon.tools import RunState, _plain

if TYPE_CHECKING:
    from daemon.service import Daemon

RUN_STATES: tuple[str, ...] = RunState.__args__  # type: ignore[attr-defined]


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Text:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, **labels: str) -> None:
        if labels:
            inner = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{inner}}} {_num(value)}")
        else:
            self.lines.append(f"{name} {_num(value)}")


def _num(value: float) -> str:
    if isinstance(value, float) and value == float("inf"):
        return "+Inf"
    return repr(value) if isinstance(value, float) else str(value)


def render(daemon: Daemon) -> str:
    out = _Text()
    _runs(out, daemon)
    _slots(out, daemon)
    _ledger(out, daemon)
    return "\n".join(out.lines) + "\n"


def _runs(out: _Text, daemon: Daemon) -> None:
    by_state = dict.fromkeys(RUN_STATES, 0)
    tasks: dict[str, int] = {}
    calls = tokens = 0
    for view in daemon.engine.list(limit=1_000_000):
        state = str(_plain(view.state))
        by_state[state] = by_state.get(state, 0) + 1
        for task in view.tasks:
            t_state = str(_plain(task.state))
            tasks[t_state] = tasks.get(t_state, 0) + 1
        calls += int(view.spent.model_calls)
        tokens += int(view.spent.tokens)
    out.family("tally_runs", "gauge", "Runs known to the daemon, by state.")
    for state, n in by_state.items():
        out.sample("tally_runs", n, state=state)
    out.family("tally_tasks", "gauge", "Tasks of known runs, by state.")
    for state, n in sorted(tasks.items()):
        out.sample("tally_tasks", n, state=state)
    out.family("tally_model_calls_total", "counter", "Model calls spent by known runs.")
    out.sample("tally_model_calls_total", calls)
    out.family("tally_tokens_total", "counter", "Tokens spent by known runs.")
    out.sample("tally_tokens_total", tokens)


def _walk(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str, int]]:
    """Every integer leaf named like a slot/queue counter, with its path of names."""
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, int) and not isinstance(value, bool):
                yield path, str(key), value
            else:
                yield from _walk(value, (*path, str(key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            name = value.get("name") if isinstance(value, dict) else None
            yield from _walk(value, (*path, str(name if name is not None else i)))


def _slots(out: _Text, daemon: Daemon) -> None:
    status = _plain(daemon.pool.status())
    busy: dict[str, int] = {}
    idle: dict[str, int] = {}
    queue: dict[str, int] = {}
    for path, key, value in _walk(status):
        member = _member_of(path)
        if key in ("busy", "slots_busy", "busy_slots"):
            busy[member] = busy.get(member, 0) + value
        elif key in ("idle", "slots_idle", "idle_slots"):
            idle[member] = idle.get(member, 0) + value
        elif key in ("queue", "queued", "queue_depth", "waiting"):
            queue[member] = queue.get(member, 0) + value
    out.family("tally_slots", "gauge", "Model server slots, by member and state.")
    for member in sorted(set(busy) | set(idle)):
        out.sample("tally_slots", busy.get(member, 0), member=member, state="busy")
        out.sample("tally_slots", idle.get(member, 0), member=member, state="idle")
    out.family("tally_queue_depth", "gauge", "Callers waiting for a slot, by member.")
    for member, n in sorted(queue.items()):
        out.sample("tally_queue_depth", n, member=member)


def _member_of(path: tuple[str, ...]) -> str:
    # {"members": {"tiny": {...}}} or {"members": [{"name": "tiny", ...}]} -> "tiny"
    for i, part in enumerate(path):
        if part == "members" and i + 1 < len(path):
            return path[i + 1]
    return path[0] if path else "pool"


def _ledger(out: _Text, daemon: Daemon) -> None:
    ledger = daemon.ledger
    stats = _plain(ledger.stats)
    stats = stats if isinstance(stats, dict) else {}
    out.family("tally_ledger_entries", "gauge", "Entries committed to the ledger.")
    out.sample("tally_ledger_entries", ledger.size)
    out.family("tally_ledger_appends_total", "counter", "Appends since the daemon started.")
    out.sample("tally_ledger_appends_total", int(stats.get("appends", 0)))
    out.family("tally_ledger_batches_total", "counter", "Group commits since start.")
    out.sample("tally_ledger_batches_total", int(stats.get("batches", 0)))
    name = "tally_ledger_fsync_seconds"
    out.family(name, "histogram", "Latency of the ledger's fsync per group commit.")
    cumulative = 0
    for bound, count in _buckets(stats):
        cumulative = count
        le = "+Inf" if bound == float("inf") else repr(float(bound))
        out.sample(f"{name}_bucket", count, le=le)
    total = int(stats.get("fsync_count", cumulative))
    if not any(line.startswith(f'{name}_bucket{{le="+Inf"') for line in out.lines):
        out.sample(f"{name}_bucket", total, le="+Inf")
    out.sample(f"{name}_sum", float(stats.get("fsync_seconds_sum", 0.0)))
    out.sample(f"{name}_count", total)


def _buckets(stats: dict[str, Any]) -> list[tuple[float, int]]:
    """Cumulative (upper bound, count) pairs from whatever shape the ledger keeps them in."""
    raw = None
    for key in ("fsync_buckets", "fsync_histogram", "buckets"):
        if key in stats:
            raw = stats[key]
            break
    pairs: list[tuple[float, int]] = []
    if isinstance(raw, dict):
        pairs = [(float(k), int(v)) for k, v in raw.items()]
    elif isinstance(raw, list):
        pairs = [
            (float(p[0]), int(p[1])) for p in raw if isinstance(p, list | tuple) and len(p) == 2
        ]
    pairs.sort()
    cumulative = all(b >= a for (_, a), (_, b) in itertools.pairwise(pairs))
    if not cumulative:
        running = 0
        acc = []
        for bound, n in pairs:
            running += n
            acc.append((bound, running))
        pairs = acc
    return pairs
