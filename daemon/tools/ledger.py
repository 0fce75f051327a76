"""The record: verify, entries, causes, redaction and the summary."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from daemon.clients import CLIENT_NAME
from daemon.errors import NotFound, Unavailable
from daemon.gateway import REPLY as GATEWAY_REPLY
from daemon.ledger.summary import Vocabulary, summarize
from daemon.runs import entries as k
from daemon.tools.tool import (
    HEX64,
    EntriesOut,
    EntryOut,
    Seq,
    Tool,
    ToolContext,
    _In,
    _Out,
    _with_bodies,
    entry_out,
)
from roster.models import Whole

if TYPE_CHECKING:
    from daemon.service import Daemon


class VerifyOut(_Out):
    ok: bool
    size: int
    root: str | None = None
    first_bad_seq: int | None = None
    reason: str | None = None
    redacted: list[str] | None = Field(
        default=None, description="Hashes of bodies removed by a witnessed redaction (deep)."
    )
    tampered: list[str] | None = Field(
        default=None, description="Hashes of bodies missing or changed without a witness (deep)."
    )
    tampered_why: dict[str, str] | None = Field(
        default=None,
        description='Per tampered body: "changed" or "missing (no redaction witnessed)".',
    )
    derived: list[str] | None = Field(
        default=None,
        description="Derived files (index, tree levels, body table) that do not match the "
        "entries: caches, the entries are intact.",
    )
    rebuilt: list[str] | None = Field(
        default=None, description="The derived files the daemon rebuilt after finding them wrong."
    )


# ---------------------------------------------------------------- ledger


class VerifyIn(_In):
    deep: bool = Field(default=False, description="Also re-hash every stored body (slower).")


async def ledger_verify(daemon: Daemon, data: VerifyIn, ctx: ToolContext) -> VerifyOut:
    return VerifyOut.model_validate(
        (await daemon.ledger.verify(deep=data.deep)).model_dump(mode="json")
    )


LEDGER_VERIFY = Tool(
    "ledger_verify",
    "Verify the ledger: the hash chain, the Merkle tree and (deep=true) every stored "
    "body. Reports the first bad entry, redacted and tampered bodies. Use it to check "
    "that the record of what tally did is intact.",
    VerifyIn,
    VerifyOut,
    ledger_verify,
    errors=(),
)


class RemoteVerifyIn(_In):
    run: str | None = Field(
        default=None, min_length=1, max_length=128, description="Only this run's calls."
    )
    limit: Annotated[int, Field(ge=1, le=100_000), Whole] = Field(
        default=1000, description="Check at most this many."
    )


class RemoteCheckOut(_Out):
    seq: int = Field(description="Our model.reply entry.")
    member: str
    remote_seq: int = Field(description="The other daemon's gateway.reply entry.")
    status: Literal["ok", "failed", "pending"]
    reason: str | None = None
    checkpoint_size: int | None = None


class RemoteVerifyOut(_Out):
    checked: int
    ok: int
    failed: int
    pending: int = Field(description="Calls its latest signed checkpoint does not cover yet.")
    results: list[RemoteCheckOut]


async def ledger_verify_remote(
    daemon: Daemon, data: RemoteVerifyIn, ctx: ToolContext
) -> RemoteVerifyOut:
    from daemon.remotes import verify_remote

    report = await verify_remote(daemon.ledger, daemon.roster, data.run, data.limit)
    return RemoteVerifyOut.model_validate(report.model_dump())


LEDGER_VERIFY_REMOTE = Tool(
    "ledger_verify_remote",
    "Prove the calls other tally daemons answered for us (roster members with "
    "tally = true) are in their ledgers: each one's signed checkpoint is checked "
    "against the key pinned in the roster, then the entry's inclusion proof and the "
    "answer's hash. Calls a checkpoint does not cover yet are `pending`.",
    RemoteVerifyIn,
    RemoteVerifyOut,
    ledger_verify_remote,
    errors=(),
)


class EntriesIn(_In):
    start: Seq = Field(default=0, description="First seq to return.")
    limit: Annotated[int, Field(ge=1, le=1000), Whole] = 100
    kind: str | None = Field(default=None, description="Only entries of this kind.")
    run: str | None = Field(default=None, description="Only entries of this run.")
    actor: str | None = None
    bodies: bool = Field(default=False, description="Include each entry's body content.")


async def ledger_entries(daemon: Daemon, data: EntriesIn, ctx: ToolContext) -> EntriesOut:
    found = await daemon.ledger.entries(
        start=data.start, limit=data.limit, kind=data.kind, run=data.run, actor=data.actor
    )
    return EntriesOut(
        entries=await _with_bodies(daemon, list(found), data.bodies), size=daemon.ledger.size
    )


LEDGER_ENTRIES = Tool(
    "ledger_entries",
    "Read ledger entries in sequence order, filtered by kind, run or actor, optionally "
    "with their bodies (prompts, outputs, plans, verdicts). Use it to audit what "
    "happened in a run, step by step.",
    EntriesIn,
    EntriesOut,
    ledger_entries,
    errors=(),
)


class SeqIn(_In):
    seq: Seq = Field(description="The entry's sequence number.")
    bodies: bool = Field(default=True, description="Include body content.")
    line: bool = Field(
        default=False, description="Include the stored line, to check its inclusion yourself."
    )


async def ledger_get(daemon: Daemon, data: SeqIn, ctx: ToolContext) -> EntryOut:
    entry = await daemon.ledger.get(data.seq)
    out = (await _with_bodies(daemon, [entry], data.bodies))[0]
    if data.line:
        out.line = entry.line().decode()
    return out


LEDGER_GET = Tool(
    "ledger_get",
    "Get one ledger entry by sequence number, with its body content unless redacted.",
    SeqIn,
    EntryOut,
    ledger_get,
    errors=(NotFound,),
)


class ChainIn(_In):
    seq: Seq = Field(description="The entry whose causes you want.")
    bodies: bool = False


async def causal_chain(daemon: Daemon, data: ChainIn, ctx: ToolContext) -> EntriesOut:
    chain = await daemon.ledger.causal_chain(data.seq)
    return EntriesOut(
        entries=await _with_bodies(daemon, list(chain), data.bodies), size=daemon.ledger.size
    )


CAUSAL_CHAIN = Tool(
    "causal_chain",
    "Walk an entry's causes back to the root (e.g. answer ← verdict ← task result ← "
    "plan ← route ← request). Use it to explain why tally produced something.",
    ChainIn,
    EntriesOut,
    causal_chain,
    errors=(NotFound,),
)


class RedactIn(_In):
    body_hash: str = Field(pattern=HEX64, description="The body hash (an entry's `body`).")
    reason: str = Field(min_length=1, max_length=2000, description="Why; witnessed.")
    actor: str = Field(default="user", min_length=1, max_length=200)


async def ledger_redact(daemon: Daemon, data: RedactIn, ctx: ToolContext) -> EntryOut:
    # The witnessed actor is the authenticated client; `actor` is only a label beside it.
    actor = ctx.client.name if data.actor == "user" else f"{ctx.client.name}/{data.actor}"
    entry = await daemon.ledger.redact(data.body_hash, actor=actor, reason=data.reason)
    return entry_out(entry)


LEDGER_REDACT = Tool(
    "ledger_redact",
    "Remove a body (e.g. a prompt containing a secret) from the ledger's store, "
    "witnessed by a redaction entry with actor and reason; the chain and proofs still "
    "verify. Irreversible: use only when content must be erased.",
    RedactIn,
    EntryOut,
    ledger_redact,
    scope="admin",
    errors=(NotFound, Unavailable),
)


class MemberUsage(_Out):
    calls: int = Field(default=0, description="model.call entries naming this member.")
    errors: int = Field(default=0, description="Replies that carry an error.")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ms: int = Field(default=0, description="Time from each model.call to its model.reply.")


class ClientUsage(_Out):
    runs: int = Field(default=0, description="Runs the client submitted.")
    entries: int = Field(default=0, description="Entries of its runs and of its own requests.")


class GatewayUsage(_Out):
    calls: int = Field(default=0, description="Answered gateway calls (gateway.reply, no error).")
    errors: int = Field(default=0, description="Attempts that ended in an error.")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ms: int = Field(default=0, description="Time the answered calls took, summed.")


class SummaryIn(_In):
    run: str | None = Field(default=None, description="One run's summary; default: all.")
    client: str | None = Field(
        default=None, pattern=CLIENT_NAME, description="Only what this named client caused."
    )
    verify: bool = Field(default=True, description="Include a (shallow) verify result.")


class SummaryOut(_Out):
    run: str | None
    entries: int
    by_kind: dict[str, int]
    model_calls: int = Field(
        description="Model calls of runs (model.call entries); /metrics' tally_model_calls_total"
    )
    gateway_calls: int = Field(
        default=0, description="Gateway calls answered (gateway.reply without an error)"
    )
    gateway_errors: int = Field(default=0, description="Gateway attempts that ended in an error")
    tokens: int = Field(description="Prompt + completion tokens the servers reported to runs.")
    per_member: dict[str, MemberUsage]
    by_purpose: dict[str, int] = Field(description="Model calls by purpose (task, plan, ...).")
    escalations: int = Field(description="task.escalate entries: a task moved up a tier.")
    route_escalations: int = Field(description="Routes that asked for a classifier.")
    runs_by_state: dict[str, int] = Field(description="Final states witnessed by run.state.")
    by_client: dict[str, ClientUsage] = Field(
        default={}, description="Runs submitted and entries caused, by named client."
    )
    gateway: dict[str, dict[str, GatewayUsage]] = Field(
        default={}, description="OpenAI-gateway traffic by client, then by model asked for."
    )
    verify: VerifyOut | None = None
    checkpoint: dict[str, Any] | None = None


_WORDS = Vocabulary(
    request=k.REQUEST,
    route=k.ROUTE,
    state=k.STATE,
    model_call=k.MODEL_CALL,
    model_reply=k.MODEL_REPLY,
    gateway_reply=GATEWAY_REPLY,
    system=frozenset({"daemon", "pool", k.ACTOR}),
)


async def ledger_summary(daemon: Daemon, data: SummaryIn, ctx: ToolContext) -> SummaryOut:
    acc = await summarize(daemon.ledger, _WORDS, run=data.run, client=data.client)
    report = None
    if data.verify:
        report = VerifyOut.model_validate((await daemon.ledger.verify()).model_dump(mode="json"))
    cp = daemon.ledger.latest_checkpoint()
    members = {name: MemberUsage(**asdict(m)) for name, m in acc.members.items()}
    return SummaryOut(
        run=data.run,
        entries=acc.count,
        by_kind=acc.by_kind,
        model_calls=acc.by_kind.get(k.MODEL_CALL, 0),
        gateway_calls=sum(g.calls for models in acc.gateway.values() for g in models.values()),
        gateway_errors=sum(g.errors for models in acc.gateway.values() for g in models.values()),
        tokens=sum(m.prompt_tokens + m.completion_tokens for m in members.values()),
        per_member=members,
        by_purpose=acc.by_purpose,
        escalations=acc.by_kind.get(k.TASK_ESCALATE, 0),
        route_escalations=acc.route_escalations,
        runs_by_state=acc.states,
        by_client={name: ClientUsage(**asdict(c)) for name, c in acc.by_client.items()},
        gateway={
            who: {model: GatewayUsage(**asdict(g)) for model, g in models.items()}
            for who, models in acc.gateway.items()
        },
        verify=report,
        checkpoint=None if cp is None else cp.model_dump(mode="json"),
    )


LEDGER_SUMMARY = Tool(
    "ledger_summary",
    "Summarize the record for one run or the whole ledger: entries by kind, model calls "
    "and tokens and time per member, escalations, verify result and latest checkpoint; "
    "read only from the ledger. Use it for a cost/audit overview.",
    SummaryIn,
    SummaryOut,
    ledger_summary,
    errors=(),
)
