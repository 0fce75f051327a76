"""Prometheus text for GET /metrics, from in-memory counters only (never O(ledger) or O(runs)).

Sources: the engine's run census (totals kept as runs change), `pool.status()` (PoolStatus)
and `ledger.stats` (LedgerStats: counters and cumulative fsync buckets).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from daemon.runs.state import RunState

if TYPE_CHECKING:
    from daemon.service import Daemon
    from surfaces.connections import Gate

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


def render(daemon: Daemon, gate: Gate | None = None) -> str:
    out = _Text()
    if gate is not None:
        _connections(out, gate)
    _runs(out, daemon)
    _slots(out, daemon)
    _ledger(out, daemon)
    _gateway(out, daemon)
    _clients(out, daemon)
    lag = daemon.lag.histogram
    name = "tally_event_loop_lag_seconds"
    out.family(name, "histogram", "How late the event loop woke a 100 ms timer.")
    _histogram(out, name, lag.cumulative(), lag.total)
    _histograms(out, daemon)
    return "\n".join(out.lines) + "\n"


def _runs(out: _Text, daemon: Daemon) -> None:
    census = daemon.engine.census
    by_state = {state: census.runs[state] for state in RUN_STATES}
    tasks = census.tasks
    calls, tokens = census.model_calls, census.tokens
    out.family("tally_runs", "gauge", "Runs known to the daemon, by state.")
    for state, n in by_state.items():
        out.sample("tally_runs", n, state=state)
    policy = daemon.roster.policy
    out.family("tally_run_queue_depth", "gauge", "Runs admitted and waiting for a run slot.")
    out.sample("tally_run_queue_depth", daemon.engine.queued())
    out.family(
        "tally_run_queue_limit", "gauge", "Runs that may wait beyond max_runs before 503 (busy)."
    )
    out.sample("tally_run_queue_limit", policy.max_queued_runs)
    out.family("tally_tasks", "gauge", "Tasks of known runs, by state.")
    for state, n in sorted(tasks.items()):
        out.sample("tally_tasks", n, state=state)
    out.family(
        "tally_model_calls_total",
        "counter",
        "Model calls of runs (model.call entries), over the runs the daemon knows: the 'runs' "
        "count of `tally ledger summary`. Gateway calls are tally_gateway_calls_total.",
    )
    out.sample("tally_model_calls_total", calls)
    out.family("tally_tokens_total", "counter", "Tokens spent by known runs.")
    out.sample("tally_tokens_total", tokens)


def _slots(out: _Text, daemon: Daemon) -> None:
    from daemon.tools import slots_out  # the daemon listens without the tool registry

    status = slots_out(daemon.pool.status())
    out.family("tally_slots", "gauge", "Model server slots of running instances, by state.")
    for m in status.members:
        ready = [i for i in m.instances if i.state == "ready"]
        out.sample("tally_slots", sum(i.slots_busy for i in ready), member=m.name, state="busy")
        out.sample("tally_slots", sum(i.slots_idle for i in ready), member=m.name, state="idle")
    out.family("tally_instances", "gauge", "Model server instances, by member and state.")
    for m in status.members:
        states: dict[str, int] = {}
        for i in m.instances:
            states[i.state] = states.get(i.state, 0) + 1
        for state, n in sorted(states.items()):
            out.sample("tally_instances", n, member=m.name, state=state)
    out.family("tally_queue_depth", "gauge", "Callers waiting for a slot, by member.")
    for m in status.members:
        out.sample("tally_queue_depth", m.queue, member=m.name)
    out.family("tally_tier_queue_depth", "gauge", "Callers waiting for any member of a tier.")
    for t in status.tiers:
        out.sample("tally_tier_queue_depth", t.queue, tier=t.name)
    out.family("tally_slot_restarts_total", "counter", "Model server restarts, by member.")
    for m in status.members:
        out.sample("tally_slot_restarts_total", m.restarts, member=m.name)
    out.family("tally_member_healthy", "gauge", "1 if a member can take leases (0: down).")
    for m in status.members:
        out.sample("tally_member_healthy", int(m.healthy), member=m.name)
    name = "tally_member_unhealthy_total"
    out.family(name, "counter", "Times an external member became unreachable.")
    for m in status.members:
        out.sample(name, m.downs, member=m.name)
    name = "tally_member_recoveries_total"
    out.family(name, "counter", "Times an unreachable member answered again.")
    for m in status.members:
        out.sample(name, m.recoveries, member=m.name)
    name = "tally_tier_failovers_total"
    out.family(name, "counter", "Leases a higher tier served because no member here could.")
    for t in status.tiers:
        out.sample(name, t.failovers, tier=t.name)
    name = "tally_tier_in_flight_failovers_total"
    out.family(name, "counter", "Calls moved to another member after theirs failed under them.")
    for t in status.tiers:
        out.sample(name, t.in_flight_failovers, tier=t.name)


def _ledger(out: _Text, daemon: Daemon) -> None:
    ledger = daemon.ledger
    stats = ledger.stats
    out.family("tally_ledger_entries", "gauge", "Entries committed to the ledger.")
    out.sample("tally_ledger_entries", ledger.size)
    out.family("tally_ledger_appends_total", "counter", "Appends since the daemon started.")
    out.sample("tally_ledger_appends_total", stats.appends)
    out.family("tally_ledger_batches_total", "counter", "Group commits since start.")
    out.sample("tally_ledger_batches_total", stats.batches)
    health = ledger.health
    out.family("tally_ledger_writable", "gauge", "1 if the ledger can write, 0 while it cannot.")
    out.sample("tally_ledger_writable", int(health.writable))
    name = "tally_ledger_write_failures_total"
    out.family(name, "counter", "Failed ledger writes or fsyncs (disk full, I/O error).")
    out.sample(name, health.write_failures)
    name = "tally_ledger_fsync_seconds"
    out.family(name, "histogram", "Latency of the ledger's fsync per group commit.")
    # The ledger keeps cumulative (le, count) buckets ending with +Inf, as Prometheus wants.
    for bound, count in stats.fsync_buckets:
        le = "+Inf" if math.isinf(bound) else repr(float(bound))
        out.sample(f"{name}_bucket", count, le=le)
    if not stats.fsync_buckets or not math.isinf(stats.fsync_buckets[-1][0]):
        out.sample(f"{name}_bucket", stats.fsync_count, le="+Inf")
    out.sample(f"{name}_sum", float(stats.fsync_seconds_sum))
    out.sample(f"{name}_count", stats.fsync_count)


def _histogram(
    out: _Text, name: str, buckets: list[tuple[float, int]], total: float, **labels: str
) -> None:
    for bound, count in buckets:
        le = "+Inf" if math.isinf(bound) else repr(float(bound))
        out.sample(f"{name}_bucket", count, **labels, le=le)
    out.sample(f"{name}_sum", float(total), **labels)
    out.sample(f"{name}_count", buckets[-1][1] if buckets else 0, **labels)


def _gateway(out: _Text, daemon: Daemon) -> None:
    """OpenAI-gateway traffic by client and model asked for, since the daemon started."""
    usage = sorted(daemon.gateway.usage.items())
    out.family(
        "tally_gateway_calls_total",
        "counter",
        "Gateway calls answered since this daemon started (gateway.reply entries without an "
        "error); `tally ledger summary` counts the same over the whole record.",
    )
    for (client, model), u in usage:
        out.sample("tally_gateway_calls_total", u.calls, client=client, model=model)
    out.family("tally_gateway_errors_total", "counter", "Gateway attempts that ended in an error.")
    for (client, model), u in usage:
        out.sample("tally_gateway_errors_total", u.errors, client=client, model=model)
    name = "tally_gateway_tokens_total"
    out.family(name, "counter", "Tokens of answered gateway calls, by kind.")
    for (client, model), u in usage:
        out.sample(name, u.prompt_tokens, client=client, model=model, kind="prompt")
        out.sample(name, u.completion_tokens, client=client, model=model, kind="completion")
    families = (
        ("tally_gateway_ttft_seconds", "Time to the first token of gateway calls.", "ttft"),
        ("tally_gateway_latency_seconds", "Duration of answered gateway calls.", "latency"),
        ("tally_gateway_tokens_per_second", "Generation speed of gateway calls.", "rate"),
    )
    for name, text, attr in families:
        out.family(name, "histogram", text)
        for (client, model), u in usage:
            h = getattr(u, attr)
            _histogram(out, name, h.cumulative(), h.total, client=client, model=model)


def _clients(out: _Text, daemon: Daemon) -> None:
    """Named clients' limits (`tally client add --rpm/--tpm/--tokens-per-day`), what they used
    over the same windows, and the requests the limits refused since the daemon started."""
    records = daemon.clients.known()
    out.family("tally_client_limit", "gauge", "A client's limit (rpm, tpm, tokens_per_day).")
    for r in records:
        for limit, value in (r.limits.model_dump(exclude_none=True) if r.limits else {}).items():
            out.sample("tally_client_limit", value, client=r.name, limit=limit)
    name = "tally_client_usage"
    out.family(name, "gauge", "What a client used: requests and tokens, by window.")
    for r in records:
        for window, value in daemon.quotas.snapshot(r.name).items():
            out.sample(name, value, client=r.name, window=window)
    name = "tally_client_limited_total"
    out.family(name, "counter", "Requests a client's limit refused (429), since start.")
    for (client, limit), n in daemon.quotas.refused().items():
        out.sample(name, n, client=client, limit=limit)


def _histograms(out: _Text, daemon: Daemon) -> None:
    for h in daemon.timings.histograms:
        out.family(h.name, "histogram", h.help)
        for label in sorted(h.counts):
            labels = {h.label: label}
            pairs = h.cumulative(label)
            for bound, count in pairs:
                le = "+Inf" if math.isinf(bound) else repr(float(bound))
                out.sample(f"{h.name}_bucket", count, **labels, le=le)
            out.sample(f"{h.name}_sum", float(h.sums[label]), **labels)
            out.sample(f"{h.name}_count", pairs[-1][1], **labels)


def _connections(out: _Text, gate: Gate) -> None:
    """The TCP gate's limits and counts (surfaces.connections)."""
    from surfaces.connections import fd_count

    limits = gate.limits
    name = "tally_limit"
    out.family(name, "gauge", "Connection and descriptor limits in force, by name.")
    for key, value in (
        ("nofile", gate.nofile),
        ("fd_reserve", limits.fd_reserve),
        ("tcp_connections", gate.max_connections),
        ("tcp_pending_per_peer", limits.max_pending_per_peer),
        ("tcp_auth_timeout_seconds", limits.auth_timeout_s),
        ("sse_streams_per_client", limits.sse_per_client),
    ):
        out.sample(name, value, limit=key)
    out.family("tally_open_fds", "gauge", "Descriptors open in the daemon process.")
    out.sample("tally_open_fds", fd_count() or 0)
    out.family("tally_tcp_connections", "gauge", "Open TCP connections, by authentication.")
    pending = sum(gate.pending.values())
    out.sample("tally_tcp_connections", pending, state="pending")
    out.sample("tally_tcp_connections", len(gate.conns) - pending, state="authenticated")
    name = "tally_tcp_refused_total"
    out.family(name, "counter", "Connections and event streams refused at a limit, by limit.")
    for reason in ("total", "pending_per_peer", "sse_per_client"):
        out.sample(name, gate.refused[reason], limit=reason)
    name = "tally_tcp_auth_timeouts_total"
    out.family(name, "counter", "TCP connections closed for not authenticating in time.")
    out.sample(name, gate.timed_out)
    out.family("tally_sse_streams", "gauge", "Event streams open over TCP.")
    out.sample("tally_sse_streams", sum(gate.streams.values()))
