"""Proofs, signed checkpoints and cosignatures of the ledger."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.config import JsonDict

from daemon.errors import Conflict, NotFound, Unavailable
from daemon.ledger.canonical import MAX_SAFE_INT
from daemon.tools.tool import Seq, Size, Tool, ToolContext, _In, _Out, require
from roster.models import Whole

if TYPE_CHECKING:
    from daemon.ledger import ConsistencyProof, InclusionProof
    from daemon.service import Daemon

_PROOF_SHAPES: JsonDict = {
    # The rule the validator below enforces, stated in the published schema: an inclusion
    # proof names `seq` (and maybe `size`), a consistency proof `old` (and maybe `new`).
    "oneOf": [
        {
            "properties": {
                "kind": {"const": "inclusion"},
                "seq": {"type": "integer"},
                "old": {"type": "null"},
                "new": {"type": "null"},
            },
            "required": ["seq"],
        },
        {
            "properties": {
                "kind": {"const": "consistency"},
                "old": {"type": "integer"},
                "seq": {"type": "null"},
                "size": {"type": "null"},
            },
            "required": ["old"],
        },
    ]
}


class ProofIn(_In):
    model_config = ConfigDict(json_schema_extra=_PROOF_SHAPES)

    kind: Literal["inclusion", "consistency"] = Field(
        description="inclusion: seq is in the tree of `size`; consistency: `old` extends to `new`."
    )
    seq: Seq | None = Field(default=None, description="inclusion: the entry.")
    size: Size | None = Field(default=None, description="inclusion: tree size (default now).")
    old: Size | None = Field(default=None, description="consistency: the old tree size.")
    new: Size | None = Field(default=None, description="consistency: new size (default now).")

    @model_validator(mode="after")
    def _needs(self) -> ProofIn:
        if self.kind == "inclusion":
            if self.seq is None:
                raise ValueError("an inclusion proof needs 'seq'")
            if self.old is not None or self.new is not None:
                raise ValueError("'old' and 'new' belong to a consistency proof")
        else:
            if self.old is None:
                raise ValueError("a consistency proof needs 'old'")
            if self.seq is not None or self.size is not None:
                raise ValueError("'seq' and 'size' belong to an inclusion proof")
        return self


class ProofOut(_Out):
    kind: Literal["inclusion", "consistency"]
    leaf_index: int | None = None
    tree_size: int | None = None
    root: str | None = None
    old_size: int | None = None
    new_size: int | None = None
    old_root: str | None = None
    new_root: str | None = None
    path: list[str] = Field(description="RFC 9162 audit path, hex SHA-256 hashes.")


async def ledger_proof(daemon: Daemon, data: ProofIn, ctx: ToolContext) -> ProofOut:
    proof: InclusionProof | ConsistencyProof
    if data.kind == "inclusion":
        assert data.seq is not None
        proof = await daemon.ledger.inclusion_proof(data.seq, size=data.size)
    else:
        assert data.old is not None
        proof = await daemon.ledger.consistency_proof(data.old, data.new)
    return ProofOut.model_validate({"kind": data.kind, **proof.model_dump(mode="json")})


LEDGER_PROOF = Tool(
    "ledger_proof",
    "Produce an RFC 9162 Merkle proof: inclusion (entry `seq` is in the tree of `size`) "
    "or consistency (the tree of size `old` is a prefix of the tree of size `new`). Use "
    "it to prove to a third party that an entry is recorded or that history was not "
    "rewritten since a pinned checkpoint.",
    ProofIn,
    ProofOut,
    ledger_proof,
    errors=(NotFound,),
)


class CheckpointIn(_In):
    create: bool = Field(default=False, description="Sign a new checkpoint instead of the latest.")


class CheckpointOut(_Out):
    checkpoint: dict[str, Any] | None = Field(
        description="Signed tree head (size, root, time, signed note); null if none yet."
    )
    vkey: str | None = Field(
        default=None,
        description="The signer's C2SP verifier key, as the daemon says: pin it out of band "
        "(`checkpoint.vkey` in the state dir) before trusting what it verifies.",
    )


async def ledger_checkpoint(daemon: Daemon, data: CheckpointIn, ctx: ToolContext) -> CheckpointOut:
    if data.create:
        require(ctx, "admin", "signing a checkpoint (create=true)")
    cp = await daemon.ledger.checkpoint() if data.create else daemon.ledger.latest_checkpoint()
    vkey = await asyncio.to_thread(lambda: daemon.ledger.vkey)  # may load the key: off the loop
    return CheckpointOut(checkpoint=None if cp is None else cp.model_dump(mode="json"), vkey=vkey)


LEDGER_CHECKPOINT = Tool(
    "ledger_checkpoint",
    "Get the latest signed checkpoint (tree size, root hash, ed25519-signed note), or "
    "sign a new one with create=true. Use it to pin the ledger's state for later "
    "consistency checks.",
    CheckpointIn,
    CheckpointOut,
    ledger_checkpoint,
    errors=(Unavailable,),
)


class CosignIn(_In):
    note: str = Field(
        max_length=16384, description="The checkpoint's signed note (C2SP signed-note text)."
    )
    old_size: Annotated[int, Field(ge=0, le=MAX_SAFE_INT), Whole] = Field(
        default=0, description="The size this daemon last cosigned for that origin (0: none)."
    )
    proof: list[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = Field(
        default_factory=list,
        max_length=64,
        description="RFC 9162 consistency proof (hex hashes) from old_size to the note's size.",
    )


class CosignOut(_Out):
    line: str = Field(description="The cosignature: one C2SP note signature line, to attach.")
    cosigner: str = Field(description="The cosigner's C2SP verifier key (type 0x04).")
    seq: int = Field(description="The `checkpoint.cosign` entry witnessing it here.")


async def ledger_cosign(daemon: Daemon, data: CosignIn, ctx: ToolContext) -> CosignOut:
    from daemon.cosigning import own_key
    from daemon.ledger.cosign import cosigner_vkey

    assert daemon.cosigner is not None
    line, seq = await daemon.cosigner.cosign(
        daemon.roster, data.note, data.old_size, data.proof, ctx.client.name
    )
    name, public = await asyncio.to_thread(own_key, daemon.ledger)
    return CosignOut(line=line, cosigner=cosigner_vkey(name, public), seq=seq)


LEDGER_COSIGN = Tool(
    "ledger_cosign",
    "Cosign another tally daemon's checkpoint (C2SP tlog-cosignature): the caller "
    "sends the signed note and a consistency proof from the size this daemon last "
    "cosigned for it. Its origin must be a roster member with tally = true whose pinned "
    "key signed it; a checkpoint not consistent with the last one cosigned is refused "
    "(409) and witnessed. Answers 409 cosign_conflict with `details.size` when "
    "old_size is not the size held. Each cosignature is witnessed (checkpoint.cosign).",
    CosignIn,
    CosignOut,
    ledger_cosign,
    scope="submit",
    errors=(NotFound, Conflict, Unavailable),
)


class CosignedIn(_In):
    pass


class CosignedOut(_Out):
    note: str | None = Field(
        description="The latest checkpoint cosigned by other daemons: its signed note with one "
        "signature line per cosigner after the origin's; null if none yet."
    )
    size: int | None = None
    root: str | None = Field(default=None, description="Hex root hash at `size`.")
    cosigners: list[str] = Field(
        default_factory=list, description="The key names of its cosignatures (unchecked here)."
    )
    cosigner_vkey: str | None = Field(
        default=None,
        description="This daemon's own cosigner key (type 0x04): what others list to count "
        "its cosignatures (`tally ledger verify --cosigner NAME=KEY`).",
    )


async def ledger_cosigned(daemon: Daemon, data: CosignedIn, ctx: ToolContext) -> CosignedOut:
    from daemon.cosigning import held_cosigned, own_key
    from daemon.ledger.checkpoint import CheckpointError, parse_note
    from daemon.ledger.cosign import CosignError, cosigner_names, cosigner_vkey

    name, public = await asyncio.to_thread(own_key, daemon.ledger)
    mine = cosigner_vkey(name, public)
    note = await held_cosigned(daemon.ledger)  # on a shared record, the record's too
    if note is None:
        return CosignedOut(note=None, cosigner_vkey=mine)
    try:
        checkpoint = parse_note(note)
        names = cosigner_names(note)
    except (CheckpointError, CosignError):
        return CosignedOut(note=None, cosigner_vkey=mine)
    return CosignedOut(
        note=note, size=checkpoint.size, root=checkpoint.root, cosigners=names, cosigner_vkey=mine
    )


LEDGER_COSIGNED = Tool(
    "ledger_cosigned",
    "Get the latest checkpoint of this ledger cosigned by other daemons: the signed "
    "note with the origin's signature line and one cosignature line per cosigner. "
    "Verify it yourself with the keys you trust and a quorum "
    "(`tally ledger verify --cosigned FILE --cosigner NAME=KEY --quorum N`).",
    CosignedIn,
    CosignedOut,
    ledger_cosigned,
    errors=(),
)


class CollectOut(_Out):
    size: int | None = Field(description="The checkpoint asked about; null: none signed yet.")
    note: str | None = Field(description="That checkpoint with the cosignatures held for it.")
    results: list[dict[str, Any]] = Field(
        description="Per `cosign = true` member: status cosigned or failed, with the reason."
    )


async def ledger_cosign_collect(daemon: Daemon, data: CheckpointIn, ctx: ToolContext) -> CollectOut:
    if data.create:
        await daemon.ledger.checkpoint()
    report = await daemon.collector.collect(daemon.ledger, daemon.roster)
    return CollectOut(
        size=report.size, note=report.note, results=[r.model_dump() for r in report.results]
    )


LEDGER_COSIGN_COLLECT = Tool(
    "ledger_cosign_collect",
    "Ask the roster's cosign = true members to cosign the latest checkpoint now (the "
    "daemon also asks after each checkpoint period); create=true signs a new "
    "checkpoint first. Reports each member's answer.",
    CheckpointIn,
    CollectOut,
    ledger_cosign_collect,
    scope="admin",
    errors=(Unavailable,),
)
