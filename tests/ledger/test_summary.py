"""The summary aggregation beside the record (`daemon.ledger.summary`): what it counts, whose
doing each entry is, and which bodies it reads."""

from __future__ import annotations

from pathlib import Path

from daemon import record as rec
from daemon.ledger import Ledger
from daemon.ledger.summary import Vocabulary, summarize

WORDS = Vocabulary(
    request="run.request",
    route="run.route",
    state="run.state",
    model_call="model.call",
    model_reply="model.reply",
    gateway_reply="gateway.reply",
    system=frozenset({"engine", "daemon", "pool"}),
)


async def test_a_summary_counts_usage_by_member_client_and_gateway(state_dir: Path) -> None:
    async with await Ledger.open(state_dir, checkpoint_interval=None) as ledger:
        asked = rec.RunRequest(
            request="x",
            lane=None,
            plan=None,
            budget=rec.Budget(model_calls=None, tokens=None, wall_ms=None),
            max_parallel=None,
            barrier=False,
            idempotency_key=None,
            client="alice",
        )
        req = await ledger.append(
            actor="engine", kind="run.request", run="r1", body=asked.written()
        )
        route = rec.RunRoute(
            lane=None, confidence_ppm=0, escalate=True, source="keywords", scores=[], matched={}
        )
        await ledger.append(
            actor="engine", kind="run.route", run="r1", parent=req.seq, body=route.written()
        )
        called = rec.ModelCall(
            purpose="task", task="T1", target="cheap", member="small", instance=0, slot=0,
            request={},
        )  # fmt: skip
        call = await ledger.append(
            actor="engine", kind="model.call", run="r1", body=called.written()
        )
        await ledger.append(
            actor="engine",
            kind="model.reply",
            run="r1",
            parent=call.seq,
            body=rec.ModelReply(
                text="x",
                finish_reason="stop",
                usage=rec.Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=None),
                timings={},
                member="small",
                instance=0,
                slot=0,
                error=None,
            ).written(),
        )
        ended = rec.RunState(state="done", error=None).written()
        await ledger.append(actor="engine", kind="run.state", run="r1", body=ended)
        await ledger.append(actor="pool", kind="slot.start", body={"member": "small"})
        ok = rec.GatewayReply(
            client="bob",
            model="m",
            member="small",
            instance=0,
            slot=0,
            finish_reason="stop",
            usage=rec.GatewayUsage(prompt_tokens=2, completion_tokens=0, cached_tokens=0),
            timings={},
            ttft_us=None,
            duration_us=4000,
            text_sha256=None,
            response_sha256=None,
            response_bytes=0,
            response=None,
            error=None,
        )
        await ledger.append(actor="bob", kind="gateway.reply", body=ok.written())
        failed = ok.model_copy(update={"usage": None, "error": "x", "duration_us": 9000})
        await ledger.append(actor="bob", kind="gateway.reply", body=failed.written())
        # not a gateway.reply body (a hostile or foreign one): counted by kind, numbers not read
        await ledger.append(actor="bob", kind="gateway.reply", body={"client": "bob", "usage": 1})

        whole = await summarize(ledger, WORDS)
        assert whole.count == 9, "every entry counts by kind, whether its body fits or not"
        assert whole.by_kind["gateway.reply"] == 3
        small = whole.members["small"]
        assert (small.calls, small.prompt_tokens, small.completion_tokens) == (1, 7, 3)
        assert whole.by_purpose == {"task": 1}
        assert whole.route_escalations == 1
        assert whole.states == {"done": 1}
        assert {k: (v.runs, v.entries) for k, v in whole.by_client.items()} == {
            "alice": (1, 5),
            "bob": (0, 3),
        }
        gateway = whole.gateway["bob"]["m"]
        assert (gateway.calls, gateway.errors, gateway.prompt_tokens, gateway.ms) == (1, 1, 2, 4)

        alice = await summarize(ledger, WORDS, client="alice")
        assert alice.count == 5
        assert set(alice.by_client) == {"alice"}
        one_run = await summarize(ledger, WORDS, run="r1")
        assert one_run.count == 5


async def test_bodies_that_do_not_fit_count_by_kind_only(state_dir: Path) -> None:
    """Old or hostile bodies (not their kind's shape) are counted, their fields are not read."""
    async with await Ledger.open(state_dir, checkpoint_interval=None) as ledger:
        req = await ledger.append(
            actor="engine", kind="run.request", run="r1", body={"client": ["alice"]}
        )
        await ledger.append(
            actor="engine", kind="run.route", run="r1", parent=req.seq, body={"escalate": "yes"}
        )
        await ledger.append(
            actor="engine", kind="model.call", run="r1", body={"member": 7, "purpose": "task"}
        )
        await ledger.append(actor="engine", kind="run.state", run="r1", body={"state": 1})
        whole = await summarize(ledger, WORDS)
    assert whole.count == 4
    assert set(whole.by_client) == {"unknown"}
    assert whole.route_escalations == 0
    assert set(whole.members) == {"unknown"}
    assert whole.members["unknown"].calls == 1
    assert whole.by_purpose == {"unknown": 1}
    assert whole.states == {"unknown": 1}
