"""OpenTelemetry traces of runs (opt-in), following the GenAI semantic conventions.

An Engine watcher turns the entries the engine witnesses into spans, with the entries' own
times, so a trace and the record tell the same story:
- `invoke_agent {lane}` per run (run.request → its final run.state);
- `task {id}` per task (first task.start → the verdict that ends it, or its skip);
- `chat {model}` per model call (model.call → model.reply), with `gen_ai.*` attributes and
  token usage; each span carries the ledger seqs of its entries (`tally.ledger.seq`, …), so a
  span can be checked against the record.
Message content stays out unless asked for (`capture_content`), as the conventions advise.

Exported over OTLP/HTTP (protobuf) by the SDK's batch processor, in its own thread. Settings come
from the standard variables (`OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`, `…_HEADERS`,
`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`) through `daemon.config.Settings`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from daemon import record as rec
from daemon.runs.ports import EntryLike
from daemon.runs.state import FINAL
from daemon.version import package_version

ENDED = frozenset({"done", "failed"})


@dataclass(frozen=True)
class OtlpOptions:
    endpoint: str
    """The traces URL, e.g. http://127.0.0.1:4318/v1/traces."""
    headers: tuple[tuple[str, str], ...] = ()
    capture_content: bool = False
    service_name: str = "tally"


def _ns(ts_us: int) -> int:
    return ts_us * 1000


class RunTracer:
    """The engine watcher that makes spans; `shutdown()` flushes them (blocking)."""

    def __init__(self, options: OtlpOptions) -> None:
        self.options = options
        resource = Resource.create(
            {"service.name": options.service_name, "service.version": package_version()}
        )
        self.provider = TracerProvider(resource=resource)
        exporter = OTLPSpanExporter(endpoint=options.endpoint, headers=dict(options.headers))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("tally")
        self._runs: dict[str, Span] = {}
        self._tasks: dict[tuple[str, str], Span] = {}
        self._calls: dict[int, Span] = {}

    def shutdown(self) -> None:
        for span in [*self._calls.values(), *self._tasks.values(), *self._runs.values()]:
            span.end()  # still open at stop: ended now rather than lost
        self.provider.shutdown()

    def __call__(self, entry: EntryLike, body: rec.Body) -> None:
        run = str(entry.run)
        if isinstance(body, rec.RunRequest):
            self._run_start(entry, body)
        elif isinstance(body, rec.RunRoute) and run in self._runs and body.lane:
            agent = self._runs[run]
            agent.update_name(f"invoke_agent {body.lane}")
            agent.set_attribute("gen_ai.agent.name", body.lane)
        elif isinstance(body, rec.TaskStart):
            self._task_start(entry, body)
        elif isinstance(body, rec.ModelCall):
            self._call(entry, body)
        elif isinstance(body, rec.ModelReply):
            self._reply(entry, body)
        elif (isinstance(body, rec.TaskVerdict) and body.next in ENDED) or isinstance(
            body, rec.TaskSkip
        ):
            task = self._tasks.pop((run, body.task), None)
            if task is not None:
                task.set_attribute("tally.ledger.end_seq", entry.seq)
                if isinstance(body, rec.TaskSkip) or body.next == "failed":
                    task.set_status(Status(StatusCode.ERROR, "failed or skipped"))
                task.end(end_time=_ns(entry.ts))
        elif isinstance(body, rec.RunState) and body.state in FINAL:
            self._run_end(entry, body.state)
        elif isinstance(body, rec.RunInterrupted):
            self._run_end(entry, "interrupted")

    def _run_start(self, entry: EntryLike, body: rec.RunRequest) -> None:
        lane = body.lane
        span = self.tracer.start_span(
            f"invoke_agent {lane}" if lane else "invoke_agent",
            kind=SpanKind.INTERNAL,
            start_time=_ns(entry.ts),
            attributes={
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.provider.name": "tally",
                "gen_ai.conversation.id": str(entry.run),
                "tally.run.id": str(entry.run),
                "tally.ledger.seq": entry.seq,
                **({"tally.client": body.client} if body.client else {}),
            },
        )
        self._runs[str(entry.run)] = span

    def _run_end(self, entry: EntryLike, state: str) -> None:
        run = str(entry.run)
        for key in [key for key in self._tasks if key[0] == run]:
            self._tasks.pop(key).end(end_time=_ns(entry.ts))
        span = self._runs.pop(run, None)
        if span is None:
            return
        span.set_attribute("tally.run.state", state)
        span.set_attribute("tally.ledger.end_seq", entry.seq)
        if state != "done":
            span.set_status(Status(StatusCode.ERROR, state))
        span.end(end_time=_ns(entry.ts))

    def _task_start(self, entry: EntryLike, body: rec.TaskStart) -> None:
        key = (str(entry.run), body.task)
        span = self._tasks.get(key)
        if span is None:
            parent = self._runs.get(key[0])
            span = self.tracer.start_span(
                f"task {key[1]}",
                context=trace.set_span_in_context(parent) if parent is not None else None,
                start_time=_ns(entry.ts),
                attributes={"tally.task.id": key[1], "tally.ledger.seq": entry.seq},
            )
            self._tasks[key] = span
        span.set_attribute("tally.task.attempts", body.attempt or 1)
        if body.tier:
            span.set_attribute("tally.task.tier", body.tier)

    def _call(self, entry: EntryLike, body: rec.ModelCall) -> None:
        run = str(entry.run)
        task = None if body.task is None else self._tasks.get((run, body.task))
        parent = task or self._runs.get(run)
        # `request` is the chat request as sent: a JSON object whose fields are the API's.
        request = body.request
        model = str(request.get("model") or body.member)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "llama.cpp",
            "gen_ai.request.model": model,
            "gen_ai.conversation.id": run,
            "tally.member": body.member,
            "tally.purpose": body.purpose,
            "tally.slot": body.slot,
            "tally.ledger.seq": entry.seq,
        }
        if isinstance(request.get("max_tokens"), int):
            attributes["gen_ai.request.max_tokens"] = request["max_tokens"]
        if self.options.capture_content and request.get("messages") is not None:
            attributes["gen_ai.input.messages"] = json.dumps(request["messages"])
        self._calls[entry.seq] = self.tracer.start_span(
            f"chat {model}",
            kind=SpanKind.CLIENT,
            context=trace.set_span_in_context(parent) if parent is not None else None,
            start_time=_ns(entry.ts),
            attributes=attributes,
        )

    def _reply(self, entry: EntryLike, body: rec.ModelReply) -> None:
        span = self._calls.pop(entry.parent, None) if entry.parent is not None else None
        if span is None:
            return
        span.set_attribute("tally.ledger.reply_seq", entry.seq)
        usage = body.usage
        if usage is not None:
            for value, name in (
                (usage.prompt_tokens, "input"),
                (usage.completion_tokens, "output"),
            ):
                if value is not None:
                    span.set_attribute(f"gen_ai.usage.{name}_tokens", value)
        if body.finish_reason:
            span.set_attribute("gen_ai.response.finish_reasons", [body.finish_reason])
        if self.options.capture_content:
            message = {"role": "assistant", "content": body.text}
            span.set_attribute("gen_ai.output.messages", json.dumps([message]))
        if body.error is not None:
            span.set_status(Status(StatusCode.ERROR, body.error[:200]))
            span.set_attribute("error.type", "model_error")
        span.end(end_time=_ns(entry.ts))
