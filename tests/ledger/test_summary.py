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
        req = await ledger.append(
            actor="engine", kind="run.request", run="r1", body={"client": "alice"}
        )
        await ledger.append(
            actor="engine", kind="run.route", run="r1", parent=req.seq, body={"escalate": True}
        )
        call = await ledger.append(
            actor="engine",
            kind="model.call",
            run="r1",
            body={"member": "small", "purpose": "task"},
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
        await ledger.append(actor="engine", kind="run.state", run="r1", body={"state": "done"})
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
        assert whole.count == 9
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
