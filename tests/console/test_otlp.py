"""Run traces over OTLP/HTTP to a real receiver (an aiohttp server on a free port that decodes
the protobufs with opentelemetry-proto), from a real daemon running a real plan (the fake model
server is the pool's only stand-in). Settings are passed explicitly, never from the ambient
environment."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from daemon.runs import entries as k
from daemon.service import Daemon
from tests.slots.fake_server import FakeServer
from tests.surfaces.conftest import daemon_settings, two_tasks

trace_pb = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")


class Receiver:
    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.content_types: set[str] = set()
        self.url = ""

    async def traces(self, request: web.Request) -> web.Response:
        self.content_types.add(request.content_type)
        message = trace_pb.ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource in message.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)
        reply = trace_pb.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    found = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", found.traces)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    found.url = f"http://127.0.0.1:{port}/v1/traces"
    try:
        yield found
    finally:
        await runner.cleanup()


def _attrs(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        value = kv.value
        which = value.WhichOneof("value")
        out[kv.key] = (
            [v.string_value for v in value.array_value.values]
            if which == "array_value"
            else getattr(value, which)
        )
    return out


async def _traced_run(
    tmp_path: Path, model: FakeServer, receiver: Receiver, capture: bool
) -> tuple[Daemon, str]:
    settings = daemon_settings(tmp_path, model.url).model_copy(
        update={"otlp_endpoint": receiver.url, "otel_capture_content": capture}
    )
    daemon = Daemon(settings)
    await daemon.start()
    try:
        view = await daemon.engine.submit("the api", plan=two_tasks())
        assert (await daemon.engine.wait(view.id, timeout=30)).state == "done"
        calls = await daemon.ledger.entries(run=view.id, kind=k.MODEL_CALL, limit=100)
        daemon.call_seqs = [e.seq for e in calls]  # type: ignore[attr-defined]
    finally:
        await daemon.stop()  # flushes the exporter
    return daemon, view.id


async def test_spans_follow_the_genai_conventions(
    tmp_path: Path, model: FakeServer, receiver: Receiver
) -> None:
    daemon, run_id = await _traced_run(tmp_path, model, receiver, capture=False)
    assert receiver.content_types == {"application/x-protobuf"}
    spans = receiver.spans
    agents = [s for s in spans if s.name.startswith("invoke_agent")]
    assert len(agents) == 1
    agent = agents[0]
    assert agent.name == "invoke_agent backend"
    attrs = _attrs(agent)
    assert attrs["gen_ai.operation.name"] == "invoke_agent"
    assert attrs["tally.run.id"] == run_id
    assert attrs["tally.run.state"] == "done"
    tasks = [s for s in spans if s.name.startswith("task ")]
    assert sorted(s.name for s in tasks) == ["task T1", "task T2"]
    assert all(s.parent_span_id == agent.span_id for s in tasks)
    assert all(s.trace_id == agent.trace_id for s in spans)
    chats = [s for s in spans if s.name.startswith("chat ")]
    assert len(chats) == 3  # two tasks and the synthesis
    by_task = {s.span_id: s.name for s in tasks}
    parents = sorted(by_task.get(s.parent_span_id, "run") for s in chats)
    assert parents == ["run", "task T1", "task T2"]
    seqs = []
    for chat in chats:
        a = _attrs(chat)
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.request.model"]
        assert a["gen_ai.usage.input_tokens"] > 0
        assert a["gen_ai.usage.output_tokens"] > 0
        assert a["tally.ledger.reply_seq"] > a["tally.ledger.seq"]
        assert "gen_ai.input.messages" not in a  # content is off by default
        assert "gen_ai.output.messages" not in a
        assert chat.start_time_unix_nano <= chat.end_time_unix_nano
        seqs.append(a["tally.ledger.seq"])
    assert sorted(seqs) == daemon.call_seqs  # type: ignore[attr-defined]


async def test_content_is_exported_only_when_asked(
    tmp_path: Path, model: FakeServer, receiver: Receiver
) -> None:
    await _traced_run(tmp_path, model, receiver, capture=True)
    chats = [_attrs(s) for s in receiver.spans if s.name.startswith("chat ")]
    assert chats
    for a in chats:
        assert "the api" in a["gen_ai.input.messages"] or "T1" in a["gen_ai.input.messages"]
        assert a["gen_ai.output.messages"].startswith('[{"role": "assistant"')
