"""Latency histograms read off the run entries as the engine witnesses them (an Engine
watcher), so /metrics costs O(buckets) and the figures agree with the record:

- run latency by final state: run.request → the run.state that ends it;
- model-call latency by member: model.call → its model.reply;
- time to first token by member: the server's prompt time (llama.cpp `timings.prompt_us`);
- tokens per second by member: `predicted_n / predicted_us` (else completion tokens / latency);
- queue wait by tier: task.start → the task's model.call (the slot lease happens in between).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from daemon import record as rec
from daemon.runs.ports import EntryLike
from daemon.runs.state import FINAL

SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RATES = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
PENDING_CAP = 100_000
"""Open calls and starts remembered at most (a lost reply must not grow memory forever)."""


@dataclass
class Histogram:
    name: str
    help: str
    label: str
    bounds: tuple[float, ...]
    counts: dict[str, list[int]] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)

    def observe(self, label: str, value: float) -> None:
        counts = self.counts.setdefault(label, [0] * (len(self.bounds) + 1))
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                counts[i] += 1
                break
        else:
            counts[-1] += 1
        self.sums[label] = self.sums.get(label, 0.0) + value

    def cumulative(self, label: str) -> list[tuple[float, int]]:
        """(le, count) pairs ending with +Inf, as Prometheus wants them."""
        total, out = 0, []
        for bound, n in zip((*self.bounds, float("inf")), self.counts[label], strict=True):
            total += n
            out.append((bound, total))
        return out


class RunTimings:
    """The engine watcher that keeps the histograms."""

    def __init__(self) -> None:
        self.run_seconds = Histogram(
            "tally_run_seconds", "Run latency, request to final state.", "state", SECONDS
        )
        self.call_seconds = Histogram(
            "tally_model_call_seconds", "Model call latency, call to reply.", "member", SECONDS
        )
        self.ttft_seconds = Histogram(
            "tally_model_ttft_seconds",
            "Time to first token (the server's prompt processing time).",
            "member",
            SECONDS,
        )
        self.tokens_per_second = Histogram(
            "tally_model_tokens_per_second", "Generation speed per call.", "member", RATES
        )
        self.queue_seconds = Histogram(
            "tally_queue_wait_seconds", "Task start to its model call (slot wait).", "tier", SECONDS
        )
        self.histograms = (
            self.run_seconds,
            self.call_seconds,
            self.ttft_seconds,
            self.tokens_per_second,
            self.queue_seconds,
        )
        self._runs: dict[str, int] = {}
        self._calls: dict[int, tuple[str, int]] = {}
        self._starts: dict[tuple[str, str], tuple[str, int]] = {}

    def __call__(self, entry: EntryLike, body: rec.Body) -> None:
        run, seq, ts = str(entry.run), entry.seq, entry.ts
        if isinstance(body, rec.RunRequest):
            self._remember(self._runs, run, ts)
        elif isinstance(body, rec.RunState) and body.state in FINAL:
            started = self._runs.pop(run, None)
            if started is not None:
                self.run_seconds.observe(body.state, (ts - started) / 1e6)
        elif isinstance(body, rec.RunInterrupted):
            self._runs.pop(run, None)
        elif isinstance(body, rec.TaskStart) and body.tier:
            self._remember(self._starts, (run, body.task), (body.tier, ts))
        elif isinstance(body, rec.ModelCall):
            self._model_call(run, seq, ts, body)
        elif isinstance(body, rec.ModelReply):
            self._model_reply(entry.parent, ts, body)

    def _remember(self, table: dict[Any, Any], key: Any, value: Any) -> None:
        if len(table) >= PENDING_CAP:
            table.pop(next(iter(table)))
        table[key] = value

    def _model_call(self, run: str, seq: int, ts: int, body: rec.ModelCall) -> None:
        self._remember(self._calls, seq, (body.member, ts))
        if body.purpose == "task" and body.task is not None:
            start = self._starts.pop((run, body.task), None)
            if start is not None:
                self.queue_seconds.observe(start[0], (ts - start[1]) / 1e6)

    def _model_reply(self, parent: int | None, ts: int, reply: rec.ModelReply) -> None:
        call = self._calls.pop(parent, None) if parent is not None else None
        if call is None or reply.error is not None:
            return
        member, called = call
        latency = (ts - called) / 1e6
        self.call_seconds.observe(member, latency)
        timings = reply.timings
        prompt_us = timings.get("prompt_us")
        if prompt_us is not None:
            self.ttft_seconds.observe(member, prompt_us / 1e6)
        n, us = timings.get("predicted_n"), timings.get("predicted_us")
        completion = reply.usage.completion_tokens if reply.usage is not None else None
        if n and us:
            self.tokens_per_second.observe(member, n / (us / 1e6))
        elif completion and latency > 0:
            self.tokens_per_second.observe(member, completion / latency)
