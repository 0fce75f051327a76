"""Cosigned checkpoints between tally daemons (C2SP tlog-cosignature; formats in
`daemon.ledger.cosign`).

The flow is the origin's: it asks, the cosigner checks (C2SP tlog-witness's shape, over
tally's tool API). Asking needs no new trust: each side already names the other in its
roster as a `tally = true` member, with its URL, token, TLS pin and pinned checkpoint key.

- **Origin** (`collect`): for each roster member with `cosign = true`, call its
  `ledger_cosign` tool with our latest checkpoint note, the size it last cosigned for us
  (`old_size`) and our RFC 9162 consistency proof from that size. A 409 `cosign_conflict`
  says the size it holds: we prove from there and ask once more. Each returned line is
  checked against the member's pinned key before it is attached; the note with every
  cosignature (`checkpoint.cosigned` beside `checkpoint`) is what `ledger_cosigned` serves.
- **Cosigner** (`Cosigner.cosign`): cosigns a checkpoint only if its origin is the key name
  of a tally member's pinned key, its signature verifies under that key, and it is
  consistent with the last checkpoint it cosigned for that origin (a consistency proof from
  that size, or the same root at the same size); with a shared record (`same_record`), also
  the root of the record it reads itself at that size (for the daemons that joined it). Each
  cosignature is witnessed first in its own ledger (`checkpoint.cosign`: origin, size, root,
  the signed note); a checkpoint that is not consistent with what it cosigned is refused and
  witnessed (`checkpoint.inconsistent`, with both signed notes: two signed roots of one size
  prove a fork). Its state per origin is rebuilt from those entries, so it lives wherever
  the ledger lives.
- **Shared record** (`Cosigner.cosign_shared`, each period from `collect_loop`): daemons
  writing one PostgreSQL record need no roster: each cosigns the others' latest checkpoints in
  `tally_checkpoints` (keys from their `ledger.join` entries, roots checked against the tree
  it reads) into `tally_cosignatures`, where `tally ledger verify --ledger URL --quorum N` and
  the export read them.

Everything a member sends is hostile: bounded, checked, and a failure is a reason, never an
exception out of `collect`.

One module (past 600 lines) for both sides: they are the two ends of one exchange, whose
request, answers and error codes (409 `cosign_conflict` with `details.size`) must agree; the
shared record's cosigning is the same cosigner's, over the record instead of a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import aiohttp
from pydantic import BaseModel

from daemon import record as rec
from daemon.errors import Conflict, InvalidInput, NotFound, TallyError
from daemon.ledger.checkpoint import Checkpoint, CheckpointError, parse_note, verify_note
from daemon.ledger.cosign import (
    MAX_NOTE_CHARS,
    CosignError,
    attach,
    check_cosignature,
    cosign_line,
    cosigner_vkey,
    parse_cosigner_vkey,
    split_note,
)
from daemon.ledger.merkle import verify_consistency
from daemon.ledger.store import write_atomic

if TYPE_CHECKING:
    from daemon.ledger import Ledger
    from daemon.ledger.shared import SharedLedger
    from roster import Member, Roster

log = logging.getLogger("tally.cosigning")

COSIGN = rec.CheckpointCosign.KIND
"""Witnessed by a cosigner before it answers: it cosigned `origin`'s checkpoint at `size`."""
INCONSISTENT = rec.CheckpointInconsistent.KIND
"""Witnessed by a cosigner that refused a checkpoint not consistent with what it cosigned."""
COSIGNED_FILE = "checkpoint.cosigned"
MAX_PROOF = 64
HEALTH_READ_S = 1.0
"""How long `health` waits for the cosignatures stored in a shared record."""


class Witnessed(BaseModel):
    """The last checkpoint this daemon cosigned for one origin."""

    origin: str
    size: int
    root: str  # hex
    note: str
    seq: int | None = None


def cosigned_path(ledger: Ledger) -> Path:
    """Where the origin keeps its latest checkpoint with the cosignatures it collected.

    The one place the cosigned note is stored: a storage that is not the state dir's files
    wires its own here (with `load_cosigned` / `save_cosigned`)."""
    return ledger.dir / COSIGNED_FILE


def load_cosigned(ledger: Ledger) -> str | None:
    try:
        text = cosigned_path(ledger).read_text()
    except FileNotFoundError:
        return None
    return text if len(text) <= MAX_NOTE_CHARS else None


async def held_cosigned(ledger: Ledger) -> str | None:
    """The latest cosigned checkpoint this daemon holds: the state dir's file; on a shared
    record, its latest checkpoint with the cosignatures stored in the record (the other
    daemons', and the members' `collect` gathered), with the file's lines for the same note."""
    from daemon.ledger.shared import SharedLedger

    note = await asyncio.to_thread(load_cosigned, ledger)
    if not isinstance(ledger, SharedLedger):
        return note
    stored = await ledger.own_cosigned()
    if stored is None:
        return note
    if note is not None and note.partition("\n\n")[0] == stored.partition("\n\n")[0]:
        try:
            return attach(stored, split_note(note)[1][1:])
        except CosignError:
            return stored
    return stored


def save_cosigned(ledger: Ledger, note: str) -> None:
    write_atomic(cosigned_path(ledger), note.encode(), mode=0o644)


def own_key(ledger: Ledger) -> tuple[str, bytes]:
    """(name, public key) of this daemon's checkpoint key. Blocking (may load the key)."""
    vkey = ledger.vkey
    if vkey is None:
        raise NotFound("this ledger has no checkpoint key")
    return parse_cosigner_vkey(vkey)


class Cosigner:
    """This daemon as the cosigner of other daemons' checkpoints (module doc)."""

    def __init__(self, ledger: Ledger, *, same_record: bool = False) -> None:
        self.ledger = ledger
        self.same_record = same_record
        """The origins write the record this daemon reads (a shared record): a checkpoint is
        also checked against our own tree at its size, the first one from an origin too."""
        self._state: dict[str, Witnessed] | None = None
        self._lock = asyncio.Lock()
        self._refused: set[tuple[str, int, str]] = set()

    async def state(self) -> dict[str, Witnessed]:
        """The last cosigned checkpoint per origin, rebuilt once from our own entries."""
        if self._state is None:
            name, _ = await asyncio.to_thread(own_key, self.ledger)
            state: dict[str, Witnessed] = {}
            start = 0
            while True:
                batch = await self.ledger.entries(start=start, limit=1000, kind=COSIGN)
                bodies = await self.ledger.read_bodies([e.body for e in batch])
                for entry, (_, body) in zip(batch, bodies, strict=True):
                    # A body redacted or not of its kind's shape vouches for nothing: skipped.
                    cosigned = rec.CheckpointCosign.parsed(body)
                    if cosigned is not None and cosigned.cosigner == name:
                        state[cosigned.origin] = Witnessed(
                            origin=cosigned.origin,
                            size=cosigned.size,
                            root=cosigned.root,
                            note=cosigned.note,
                            seq=entry.seq,
                        )
                if len(batch) < 1000:
                    break
                start = batch[-1].seq + 1
            self._state = state
        return self._state

    async def cosign(
        self, roster: Roster, note: str, old_size: int, proof: list[str], client: str
    ) -> tuple[str, int]:
        """Check `note` and cosign it: (the cosignature line, the entry witnessing it)."""
        if len(note) > MAX_NOTE_CHARS:
            raise InvalidInput(f"the note is over {MAX_NOTE_CHARS} characters")
        try:
            checkpoint = parse_note(note)
            split_note(note)
        except (CheckpointError, CosignError) as err:
            raise InvalidInput(f"not a checkpoint note: {err}") from err
        member = _origin_member(roster, checkpoint.origin)
        assert member.tally_key is not None
        try:
            verify_note(note, member.tally_key)
        except (CheckpointError, ValueError) as err:
            raise InvalidInput(
                f"the checkpoint's signature does not verify under the key pinned for "
                f"member {member.name!r}: {err}",
                details={"origin": checkpoint.origin},
            ) from err
        if len(proof) > MAX_PROOF:
            raise InvalidInput(f"a consistency proof has at most {MAX_PROOF} hashes")
        try:
            path = [bytes.fromhex(h) for h in proof]
        except ValueError as err:
            raise InvalidInput("the proof is not a list of hex hashes") from err
        if any(len(h) != 32 for h in path):
            raise InvalidInput("the proof holds a hash that is not 32 bytes")
        async with self._lock:
            state = await self.state()
            if self.same_record and await self._shares_record(checkpoint.origin):
                await self._on_our_tree(checkpoint, member, client)
            last = state.get(checkpoint.origin)
            if last is not None:
                await self._check(last, checkpoint, old_size, path, member, client)
            elif old_size != 0:
                raise _conflict(checkpoint.origin, 0)
            return await self._sign(state, checkpoint, member, client)

    async def _shares_record(self, origin: str) -> bool:
        """Whether `origin` writes the record we read: on a shared record, a daemon that joined
        it (a federated member writing its own record is not checked against ours)."""
        from daemon.ledger.shared import SharedLedger

        if not isinstance(self.ledger, SharedLedger):
            return True
        return origin in await self.ledger.joined_keys()

    async def _on_our_tree(self, checkpoint: Checkpoint, member: Member, client: str) -> None:
        size = self.ledger.size
        if checkpoint.size > size:
            raise Conflict(
                f"the record here holds {size} entries, fewer than the checkpoint's "
                f"{checkpoint.size}: ask again once they are read",
                details={"origin": checkpoint.origin, "behind": size},
            )
        ours = (await self.ledger.consistency_proof(checkpoint.size, checkpoint.size)).new_root
        if ours != checkpoint.root:
            here = Witnessed(origin=checkpoint.origin, size=checkpoint.size, root=ours, note="")
            why = (
                f"{checkpoint.origin} signed a root for size {checkpoint.size} that is not the "
                "shared record's tree at that size: a fork"
            )
            await self._refuse(here, checkpoint, member, client, proven=True, why=why)

    async def _check(
        self,
        last: Witnessed,
        checkpoint: Checkpoint,
        old_size: int,
        path: list[bytes],
        member: Member,
        client: str,
    ) -> None:
        if checkpoint.size < last.size:
            raise Conflict(
                f"we cosigned {checkpoint.origin} at size {last.size}: a checkpoint of size "
                f"{checkpoint.size} is older (a rollback, or a stale request)",
                details={"size": last.size, "origin": checkpoint.origin},
            )
        if checkpoint.size == last.size:
            if checkpoint.root != last.root:
                await self._refuse(last, checkpoint, member, client, proven=True)
            return
        if old_size != last.size:
            raise _conflict(checkpoint.origin, last.size)
        consistent = verify_consistency(
            last.size,
            checkpoint.size,
            bytes.fromhex(last.root),
            bytes.fromhex(checkpoint.root),
            path,
        )
        if not consistent:
            await self._refuse(last, checkpoint, member, client, proven=False)

    async def _refuse(
        self,
        last: Witnessed,
        checkpoint: Checkpoint,
        member: Member | Peer,
        client: str,
        proven: bool,
        why: str | None = None,
    ) -> None:
        if why is None and proven:
            why = f"{checkpoint.origin} signed two roots for size {checkpoint.size}: a fork"
        elif why is None:
            why = (
                f"the checkpoint of size {checkpoint.size} is not proven consistent with the "
                f"one of size {last.size} we cosigned (the consistency proof fails)"
            )
        key = (checkpoint.origin, checkpoint.size, checkpoint.root)
        if key not in self._refused:  # one entry per refused checkpoint, however often sent
            refused = rec.CheckpointInconsistent(
                origin=checkpoint.origin,
                member=member.name,
                size=checkpoint.size,
                root=checkpoint.root,
                note=_origin_only(checkpoint.note, str(member.tally_key)),
                cosigned_size=last.size,
                cosigned_root=last.root,
                cosigned_note=last.note,
                proven_fork=proven,
                reason=why,
            )
            await self.ledger.append(actor=client, kind=refused.KIND, body=refused.written())
            if len(self._refused) >= 10_000:  # a memory bound: at worst one entry again
                self._refused.clear()
            self._refused.add(key)
        log.warning("cosigning: refused %s: %s", member.name, why)
        raise Conflict(
            why + ": refused and witnessed",
            details={"origin": checkpoint.origin, "size": last.size, "inconsistent": True},
        )

    async def _sign(
        self, state: dict[str, Witnessed], checkpoint: Checkpoint, member: Member, client: str
    ) -> tuple[str, int]:
        body = checkpoint.note.partition("\n\n")[0] + "\n"
        stamp = int(time.time())

        def sign() -> tuple[str, str]:
            name, public = own_key(self.ledger)
            line = cosign_line(name, public, _signer(self.ledger), body, stamp)
            return name, line

        name, line = await asyncio.to_thread(sign)
        last = state.get(checkpoint.origin)
        if (
            last is not None
            and last.seq is not None
            and (last.size, last.root)
            == (
                checkpoint.size,
                checkpoint.root,
            )
        ):
            return line, last.seq  # the same statement again: witnessed once, when first made
        assert member.tally_key is not None
        origin_note = _origin_only(checkpoint.note, member.tally_key)
        cosigned = rec.CheckpointCosign(
            origin=checkpoint.origin,
            member=member.name,
            size=checkpoint.size,
            root=checkpoint.root,
            note=origin_note,
            cosigner=name,
            time=stamp,
        )
        entry = await self.ledger.append(actor=client, kind=cosigned.KIND, body=cosigned.written())
        state[checkpoint.origin] = Witnessed(
            origin=checkpoint.origin,
            size=checkpoint.size,
            root=checkpoint.root,
            note=origin_note,
            seq=entry.seq,
        )
        return line, entry.seq

    async def cosign_shared(self, client: str = "cosigner") -> list[CosignAsk]:
        """With a shared record (`same_record`): cosign every other daemon's latest checkpoint
        not cosigned yet, into the record's `tally_cosignatures`.

        The other daemons are the record's: each one's key is the one its `ledger.join` entry
        witnesses (no roster member needed). A checkpoint is cosigned only if its signature
        verifies under that key and its root is the tree this daemon reads itself at that size
        (so it is consistent with every checkpoint cosigned before: one append-only tree); a
        root that is not the tree's is refused and witnessed (`checkpoint.inconsistent`). No
        `checkpoint.cosign` entry: the stored line is the evidence, and an entry per
        cosignature would grow the record each period, so checkpoints would never settle."""
        from daemon.ledger.shared import SharedLedger

        ledger = self.ledger
        if not self.same_record or not isinstance(ledger, SharedLedger):
            return []
        results: list[CosignAsk] = []
        async with self._lock:
            await ledger.refresh()
            keys = await ledger.joined_keys()
            for daemon, size, note in await ledger.uncosigned():
                peer = Peer(name=daemon, tally_key=keys.get(daemon))
                try:
                    results.append(await self._cosign_peer(ledger, peer, size, note, client))
                except (TallyError, CheckpointError, CosignError, ValueError) as err:
                    why = getattr(err, "message", None) or str(err)
                    results.append(CosignAsk(member=daemon, status="failed", reason=why[:300]))
        for result in results:
            if result.status == "failed":
                log.warning("cosigning: did not cosign %s: %s", result.member, result.reason)
        return results

    async def _cosign_peer(
        self, ledger: SharedLedger, peer: Peer, size: int, note: str, client: str
    ) -> CosignAsk:
        if peer.tally_key is None:
            raise CosignError(
                f"daemon {peer.name!r} has no key witnessed by its ledger.join entry in the record"
            )
        checkpoint = verify_note(note, peer.tally_key)
        if (checkpoint.origin, checkpoint.size) != (peer.name, size):
            raise CosignError(f"the note stored as {peer.name}'s at size {size} is another's")
        if checkpoint.size > ledger.size:
            raise CosignError(
                f"the record here holds {ledger.size} entries, fewer than the checkpoint's "
                f"{checkpoint.size}: the next period asks again"
            )
        ours = await asyncio.to_thread(ledger.root, checkpoint.size)  # reads stored nodes
        if ours != checkpoint.root:
            here = Witnessed(origin=checkpoint.origin, size=checkpoint.size, root=ours, note="")
            why = (
                f"{checkpoint.origin} signed a root for size {checkpoint.size} that is not the "
                "shared record's tree at that size: a fork"
            )
            await self._refuse(here, checkpoint, peer, client, proven=True, why=why)
        body = checkpoint.note.partition("\n\n")[0] + "\n"
        stamp = int(time.time())

        def sign() -> str:
            name, public = own_key(ledger)
            return cosign_line(name, public, _signer(ledger), body, stamp)

        line = await asyncio.to_thread(sign)
        await ledger.store_cosignature(peer.name, checkpoint.size, line)
        return CosignAsk(member=peer.name, status="cosigned", timestamp=stamp)


@dataclass(frozen=True, slots=True)
class Peer:
    """Another daemon of a shared record, as the record names it (not a roster member)."""

    name: str
    tally_key: str | None


def _origin_only(note: str, key: str) -> str:
    """The note with only the origin's verified signature line: the evidence kept of it."""
    body, _, lines = note.partition("\n\n")
    for line in lines.split("\n"):
        single = f"{body}\n\n{line}\n"
        try:
            verify_note(single, key)
        except (CheckpointError, ValueError):
            continue
        return single
    raise InvalidInput("the checkpoint has no signature line by its origin")  # checked before


def _signer(ledger: Ledger) -> Callable[[bytes], bytes]:
    """The owner's raw ed25519 signature: `Ledger.seal` signs with the checkpoint key (its MAC
    half is for derived files and unused here)."""

    def sign(message: bytes) -> bytes:
        return ledger.seal(message)[1]

    return sign


def _conflict(origin: str, size: int) -> Conflict:
    err = Conflict(
        f"we last cosigned {origin} at size {size}: send a consistency proof from there",
        details={"size": size, "origin": origin},
    )
    err.code = "cosign_conflict"
    return err


def _origin_member(roster: Roster, origin: str) -> Member:
    for member in roster.models:
        key = member.tally_key
        if member.tally and key is not None and key.split("+", 1)[0] == origin:
            return member
    raise NotFound(
        f"we cosign only the daemons our roster names: no tally member's pinned key is named "
        f"{origin!r}",
        details={"origin": origin},
    )


# ---- the origin: asking the cosigners ----------------------------------------------------

Outcome = Literal["cosigned", "failed"]


class CosignAsk(BaseModel):
    member: str
    status: Outcome
    reason: str | None = None
    timestamp: int | None = None


class CollectReport(BaseModel):
    size: int | None
    """The checkpoint asked about (none: no checkpoint yet)."""
    note: str | None
    """That checkpoint with every cosignature held for it."""
    results: list[CosignAsk]


class CosignerHealth(BaseModel):
    """One cosigner of this daemon's checkpoints, as `health` shows it."""

    name: str
    via: Literal["member", "record"]
    """`member`: a roster member this daemon asks; `record`: a daemon sharing the record."""
    last_size: int | None = None
    """The largest checkpoint of ours it cosigned (that we know of)."""
    age_s: float | None = None
    """Seconds since that cosignature (its own timestamp)."""
    failures: int = 0
    """Asks that failed since its last cosignature."""
    reason: str | None = None
    """Why the last ask failed."""


class CosignHealth(BaseModel):
    """Whether this daemon's latest checkpoint carries the cosignatures it should."""

    checkpoint_size: int | None
    cosigners: list[CosignerHealth]
    quorum: int
    """How many cosigners must cosign the latest checkpoint: every one known here."""
    cosigned: int
    """How many cosigned the latest checkpoint."""
    met: bool
    detail: str | None = None
    """What could not be read (the shared record unreachable)."""


@dataclass
class _Asked:
    size: int | None = None
    stamp: int | None = None
    failures: int = 0
    reason: str | None = None


class Collector:
    """The origin's side: remembers the size each member last cosigned, to prove from it."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.asked: dict[str, _Asked] = {}
        """Per member: its last cosignature and the failed asks since (for `health`)."""
        self._lock = asyncio.Lock()

    def _note(self, size: int, ask: CosignAsk) -> None:
        state = self.asked.setdefault(ask.member, _Asked())
        if ask.status == "cosigned":
            state.size, state.stamp, state.failures, state.reason = size, ask.timestamp, 0, None
        else:
            state.failures += 1
            state.reason = ask.reason

    async def health(self, ledger: Ledger, roster: Roster) -> CosignHealth | None:
        """Per cosigner: the last checkpoint it cosigned, how long ago, the failed asks since;
        and whether the latest checkpoint has them all. None: no cosigners are configured."""
        from daemon.ledger.cosign import split_note
        from daemon.ledger.shared import SharedLedger

        members: dict[str, str] = {}  # member name -> its key's name (on its lines)
        for m in roster.models:
            if m.tally and m.cosign:
                try:
                    members[m.name] = parse_cosigner_vkey(m.tally_key or "")[0]
                except (CosignError, ValueError):
                    members[m.name] = m.name
        shared = isinstance(ledger, SharedLedger)
        if not members and not shared:
            return None
        latest = ledger.latest_checkpoint()
        now = time.time()
        detail = None
        stamps: dict[str, int] = {}
        others: list[str] = []
        try:  # bounded: `health` answers at once even while the shared record does not
            async with asyncio.timeout(HEALTH_READ_S):
                held = await held_cosigned(ledger)
                if isinstance(ledger, SharedLedger):
                    others = sorted(set(await ledger.joined_keys()) - {ledger.name})
        except Exception as err:  # the record unreachable: say so, show what is known here
            held, detail = None, f"{type(err).__name__}: {err}"[:300]
        if (
            held is not None
            and latest is not None
            and held.partition("\n\n")[0] == (latest.note.partition("\n\n")[0])
        ):
            try:
                for line in split_note(held)[1][1:]:
                    name = line.removeprefix("— ").split(" ", 1)[0]
                    stamps[name] = int.from_bytes(_raw(line)[4:12], "big")
            except (CosignError, ValueError):
                pass
        out: list[CosignerHealth] = []
        for name, key in members.items():
            state = self.asked.get(name, _Asked())
            stamp = stamps.get(key, state.stamp)
            out.append(
                CosignerHealth(
                    name=name,
                    via="member",
                    last_size=latest.size if key in stamps and latest else state.size,
                    age_s=None if stamp is None else round(max(0.0, now - stamp), 1),
                    failures=state.failures,
                    reason=state.reason,
                )
            )
        for name in others:
            stamp = stamps.get(name)
            out.append(
                CosignerHealth(
                    name=name,
                    via="record",
                    last_size=latest.size if stamp is not None and latest else None,
                    age_s=None if stamp is None else round(max(0.0, now - stamp), 1),
                )
            )
        cosigned = sum(1 for c in out if members.get(c.name, c.name) in stamps)
        return CosignHealth(
            checkpoint_size=None if latest is None else latest.size,
            cosigners=out,
            quorum=len(out),
            cosigned=cosigned,
            met=latest is not None and cosigned >= len(out),
            detail=detail,
        )

    async def collect(self, ledger: Ledger, roster: Roster) -> CollectReport:
        from daemon.remotes import _Remote

        checkpoint = ledger.latest_checkpoint()
        members = [m for m in roster.models if m.tally and m.cosign]
        if checkpoint is None:
            return CollectReport(size=None, note=None, results=[])
        async with self._lock:
            held = await held_cosigned(ledger)
            note = checkpoint.note
            if held is not None and held.partition("\n\n")[0] == note.partition("\n\n")[0]:
                note = held  # the same checkpoint: keep what was collected for it
            results: list[CosignAsk] = []
            lines: list[str] = []
            async with aiohttp.ClientSession() as session:
                for member in members:
                    remote = _Remote(member, session)
                    ask = await self._ask(ledger, remote, checkpoint)
                    self._note(checkpoint.size, ask[0])
                    results.append(ask[0])
                    if ask[1] is not None:
                        lines.append(ask[1])
            if lines:
                note = attach(note, lines)
                await asyncio.to_thread(save_cosigned, ledger, note)
                await _store_shared(ledger, checkpoint, lines)
            return CollectReport(size=checkpoint.size, note=note, results=results)

    async def _ask(
        self, ledger: Ledger, remote: Any, checkpoint: Checkpoint
    ) -> tuple[CosignAsk, str | None]:
        name = remote.member.name
        body = checkpoint.note.partition("\n\n")[0] + "\n"
        try:
            key_name, public = parse_cosigner_vkey(remote.member.tally_key)
            old = self.sizes.get(name, 0)
            for _ in range(2):
                status, data = await remote.answer(
                    "ledger_cosign",
                    {
                        "note": checkpoint.note,
                        "old_size": old,
                        "proof": await _proof(ledger, old, checkpoint.size),
                    },
                )
                error = _object(data.get("error"))
                theirs = _object(error.get("details")).get("size")
                if (
                    status == 409
                    and error.get("code") == "cosign_conflict"
                    and isinstance(theirs, int)
                    and 0 <= theirs <= checkpoint.size
                    and theirs != old
                ):
                    old = theirs  # prove from the size it holds, once
                    continue
                break
            if status != 200:
                message = str(error.get("message") or f"HTTP {status}")[:300]
                return CosignAsk(member=name, status="failed", reason=message), None
            line = data.get("line")
            if not isinstance(line, str) or len(line) > 512:
                raise CosignError("the answer holds no cosignature line")
            stamp = check_cosignature(body, line, key_name, public)
        except (CosignError, ValueError) as err:
            reason = f"{name}: {err}"[:300]
            return CosignAsk(member=name, status="failed", reason=reason), None
        except aiohttp.ServerFingerprintMismatch as err:
            why = f"{name}: its TLS certificate (sha256:{err.got.hex()}) is not the pinned one"
            return CosignAsk(member=name, status="failed", reason=why), None
        except TimeoutError:
            return CosignAsk(
                member=name, status="failed", reason=f"{name}: no answer in time"
            ), None
        except Exception as err:  # a member's surprise is a reason, not our failure
            why = f"{name}: {type(err).__name__}: {err}"[:300]
            return CosignAsk(member=name, status="failed", reason=why), None
        self.sizes[name] = checkpoint.size
        return CosignAsk(member=name, status="cosigned", timestamp=stamp), line


async def _store_shared(ledger: Ledger, checkpoint: Checkpoint, lines: list[str]) -> None:
    """On a shared record, the members' checked cosignatures go to the record too, where
    `tally ledger verify --ledger URL` and the export read them (under each key's name)."""
    from daemon.ledger.shared import SharedLedger

    if not isinstance(ledger, SharedLedger):
        return
    for line in lines:
        name = line.removeprefix("— ").split(" ", 1)[0]
        await ledger.store_cosignature(ledger.name, checkpoint.size, line, cosigner=name)


def _raw(line: str) -> bytes:
    """A signature line's decoded bytes (key id, timestamp, signature)."""
    import base64

    return base64.b64decode(line.rsplit(" ", 1)[-1], validate=True)


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


async def _proof(ledger: Ledger, old: int, new: int) -> list[str]:
    if old == 0 or old >= new:
        return []
    return (await ledger.consistency_proof(old, new)).path


async def collect_loop(
    collector: Collector,
    ledger: Ledger,
    roster_of: Any,
    every: float,
    cosigner: Cosigner | None = None,
) -> None:
    """Ask the cosigners after each checkpoint period (the ledger's own timer signs); with a
    shared record, first cosign the other daemons' checkpoints (`Cosigner.cosign_shared`)."""
    asked = None
    while True:
        await asyncio.sleep(max(every, 1.0))
        if cosigner is not None and cosigner.same_record:
            try:
                await cosigner.cosign_shared()
            except Exception:  # logged; the next period cosigns again
                log.exception("cosigning: cosigning the shared record's checkpoints failed")
        checkpoint = ledger.latest_checkpoint()
        if checkpoint is None or checkpoint.note == asked:
            continue
        roster = roster_of()
        if not any(m.tally and m.cosign for m in roster.models):
            continue
        try:
            report = await collector.collect(ledger, roster)
            if all(r.status == "cosigned" for r in report.results):
                asked = checkpoint.note  # else the next period asks the others again
        except Exception:  # logged; the next period asks again
            log.exception("cosigning: collecting cosignatures failed")


__all__ = [
    "COSIGN",
    "INCONSISTENT",
    "CollectReport",
    "Collector",
    "CosignHealth",
    "Cosigner",
    "Peer",
    "cosigner_vkey",
]
