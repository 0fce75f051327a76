"""Other tally daemons used as pool members, and proving our calls in their ledgers.

A roster member with `tally = true` is another daemon's gateway. Each reply it gives names
its `gateway.reply` entry (`X-Tally-Seq`, or the `tally` object of a stream's last chunk),
which the engine keeps in its own `model.reply` as `remote`. Checking one such call:
1. fetch the other daemon's latest signed checkpoint and verify its note against the
   `tally_key` pinned in our roster (a key the other side could change proves nothing);
2. if the checkpoint does not cover the seq yet, the call is `pending` (checked next time);
3. fetch the entry and its RFC 9162 inclusion proof at the checkpoint's size, rebuild the
   entry's canonical line and its leaf hash, and check the path leads to the signed root;
4. check it is a `gateway.reply` whose answered text hashes to the text we recorded.
Everything the other daemon sends is treated as hostile: each answer is read up to
`_MAX_ANSWER` bytes within `_TIMEOUT_S`, its JSON nests at most `daemon.intake.MAX_DEPTH`,
shapes are checked, and any surprise is a `failed` result with its reason, never an exception:
one call's failure does not stop the others. A member whose checkpoint cannot be had, or that
does not answer in time, fails its remaining calls with that reason without being asked again,
so one dead or dripping member costs one timeout, not one per call.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import TYPE_CHECKING, Any, Literal

import aiohttp
from pydantic import BaseModel, ValidationError

from daemon.intake import loads, read_body
from daemon.ledger.canonical import NotCanonical, canonicalize
from daemon.ledger.checkpoint import CheckpointError, verify_note
from daemon.ledger.entry import Entry
from daemon.ledger.merkle import leaf_hash, verify_inclusion
from daemon.record import GatewayReply, ModelReply, Remote
from daemon.slots.discovery import split_url
from daemon.tls import client_ssl
from roster import Member

if TYPE_CHECKING:
    from daemon.ledger import Ledger
    from roster import Roster

log = logging.getLogger("tally.remotes")

Status = Literal["ok", "failed", "pending"]
_MAX_ANSWER = 1 << 20  # a proof, an entry or a checkpoint is far smaller
_TIMEOUT_S = 10.0


class RemoteCheck(BaseModel):
    """One call of ours checked against the other daemon's ledger."""

    seq: int
    """Our `model.reply` entry."""
    member: str
    remote_seq: int
    status: Status
    reason: str | None = None
    checkpoint_size: int | None = None


class RemoteReport(BaseModel):
    checked: int
    ok: int
    failed: int
    pending: int
    results: list[RemoteCheck]


class _Remote:
    """One tally member's tool endpoint, with its token and pinned key."""

    def __init__(self, member: Member, session: aiohttp.ClientSession) -> None:
        assert member.url is not None
        assert member.tally_key is not None
        self.member = member
        self.root, _ = split_url(member.url)
        self.key = member.tally_key
        env = member.api_key_env
        token = os.environ.get(env) if env else None
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.session = session
        # an https member: its pinned certificate or CA, exactly as the pool's calls check it
        self.ssl = client_ssl(member.tls_fingerprint, member.tls_ca)
        self._checkpoint: Any = None
        self.broken: str | None = None
        self.checkpoint_failed = False
        """Why its remaining calls fail without asking (no checkpoint, no answer in time)."""

    async def _post(self, name: str, arguments: dict[str, Any]) -> tuple[int, bytes]:
        """One call of the other daemon's tool: its HTTP status and body, bounded and in time."""
        timeout = aiohttp.ClientTimeout(total=_TIMEOUT_S)
        async with self.session.post(
            f"{self.root}/v1/tools/{name}",
            json=arguments,
            headers=self.headers,
            timeout=timeout,
            allow_redirects=False,
            ssl=self.ssl,
        ) as resp:
            return resp.status, await read_body(resp, _MAX_ANSWER, f"{name}: the answer")

    async def tool(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        status, raw = await self._post(name, arguments)
        if status != 200:
            text = raw[:200].decode("utf-8", "replace")
            raise ValueError(f"{name}: HTTP {status}: {text}")
        data = loads(raw, f"{name}: the answer")  # Malformed is a ValueError
        if not isinstance(data, dict):
            raise ValueError(f"{name}: the answer is not a JSON object")
        return data

    async def answer(self, name: str, arguments: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The tool's HTTP status and JSON object, error answers included (read as `tool`
        reads: bounded, in time, shapes checked), for a caller that acts on an error's code."""
        status, raw = await self._post(name, arguments)
        try:
            data = loads(raw, f"{name}: the answer")
        except ValueError:
            data = None
        if not isinstance(data, dict):
            text = raw[:200].decode("utf-8", "replace")
            raise ValueError(f"{name}: HTTP {status}: not a JSON object: {text}")
        return status, data

    async def checkpoint(self) -> Any:
        """The other daemon's latest checkpoint, its signature checked (fetched once)."""
        if self._checkpoint is None:
            self.checkpoint_failed = True  # until it is had
            answer = await self.tool("ledger_checkpoint", {})
            held = answer.get("checkpoint")
            if held is None:
                return None  # none signed yet: every call is pending
            note = held.get("note") if isinstance(held, dict) else None
            if not isinstance(note, str) or len(note) > 8192:
                raise ValueError("ledger_checkpoint: the answer holds no checkpoint note")
            self._checkpoint = verify_note(note, self.key)
        self.checkpoint_failed = False
        return self._checkpoint


async def check_call(remote: _Remote, seq: int, remote_seq: int, text: str) -> RemoteCheck:
    """Steps 1-4 of the module docstring for one call."""
    result = RemoteCheck(seq=seq, member=remote.member.name, remote_seq=remote_seq, status="ok")
    try:
        checkpoint = await remote.checkpoint()
    except CheckpointError as err:
        remote.broken = f"the checkpoint's signature does not verify: {err}"
        return _failed(result, remote.broken)
    if checkpoint is None or remote_seq >= checkpoint.size:
        size = checkpoint.size if checkpoint is not None else 0
        result.status = "pending"
        result.reason = f"its latest signed checkpoint (size {size}) does not cover it yet"
        return result
    result.checkpoint_size = checkpoint.size
    got = await remote.tool("ledger_get", {"seq": remote_seq, "bodies": True})
    content = got.pop("content", None)
    if not isinstance(got.get("kind"), str):
        return _failed(result, f"ledger_get: entry {remote_seq} has no kind")
    fields = {k: got.get(k) for k in ("v", "seq", "ts", "actor", "kind", "run", "parent", "body")}
    fields["prev"] = got.get("prev")
    try:
        line = canonicalize(fields)  # untrusted: the subset check first, as for its body
        Entry.from_line(line)
    except ValueError as err:
        return _failed(result, f"the entry is not a valid ledger entry: {err}")
    proof = await remote.tool(
        "ledger_proof", {"kind": "inclusion", "seq": remote_seq, "size": checkpoint.size}
    )
    path_hex = proof.get("path") or []
    try:
        if not isinstance(path_hex, list) or len(path_hex) > 64:
            raise TypeError
        path = [bytes.fromhex(h) for h in path_hex]
    except (TypeError, ValueError):
        return _failed(result, "the proof's path is not a list of hex hashes")
    if any(len(h) != 32 for h in path):
        return _failed(result, "the proof's path holds a hash that is not 32 bytes")
    root = bytes.fromhex(checkpoint.root)
    if not verify_inclusion(remote_seq, checkpoint.size, leaf_hash(line), path, root):
        return _failed(result, "the entry is not in the signed tree (inclusion proof fails)")
    if fields["kind"] != "gateway.reply" or fields["seq"] != remote_seq:
        return _failed(result, f"entry {remote_seq} is a {fields['kind']!r}, not a gateway.reply")
    return _content_matches(result, fields, content, text)


def _content_matches(
    result: RemoteCheck, fields: dict[str, Any], content: Any, text: str
) -> RemoteCheck:
    if not isinstance(content, dict):
        result.reason = "the entry's body is redacted there: its text was not compared"
        return result
    try:
        served = canonicalize(content)
    except NotCanonical as err:  # a float, a lone surrogate: no body of a ledger holds one
        return _failed(result, f"the body it served is not storable in a ledger: {err}")
    if hashlib.sha256(served).hexdigest() != fields["body"]:
        return _failed(result, "the body it served does not hash to the entry's body")
    # Read as the kind it claims: a body that does not fit a gateway.reply (its record's own
    # schema) proves nothing about the answer, so the call is not taken as verified.
    reply = GatewayReply.parsed(content)
    if reply is None:
        return _failed(result, "the body it served is not a gateway.reply's (`ledger schema`)")
    if reply.text_sha256 != hashlib.sha256(text.encode()).hexdigest():
        return _failed(result, "the answer it recorded is not the answer we received")
    return result


def _failed(result: RemoteCheck, reason: str) -> RemoteCheck:
    result.status = "failed"
    result.reason = reason
    return result


async def verify_remote(
    ledger: Ledger, roster: Roster, run: str | None = None, limit: int = 1000
) -> RemoteReport:
    """Check every call of ours (or of one run) that another tally daemon answered."""
    results: list[RemoteCheck] = []
    remotes: dict[str, _Remote] = {}
    async with aiohttp.ClientSession() as session:
        for entry, reply, info in await _remote_replies(ledger, run, limit):
            name = info.member
            check = RemoteCheck(seq=entry.seq, member=name, remote_seq=info.seq, status="failed")
            member = roster.member(name)
            if member is None or not member.tally or member.tally_key is None:
                results.append(_failed(check, f"{name!r} is no longer a tally member with a key"))
                continue
            remote = remotes.setdefault(name, _Remote(member, session))
            if remote.broken is not None:
                results.append(_failed(check, remote.broken))
                continue
            results.append(await _checked(remote, check, reply.text))
    return RemoteReport(
        checked=len(results),
        ok=sum(r.status == "ok" for r in results),
        failed=sum(r.status == "failed" for r in results),
        pending=sum(r.status == "pending" for r in results),
        results=results,
    )


async def _checked(remote: _Remote, check: RemoteCheck, text: str) -> RemoteCheck:
    """`check_call`, with every surprise from the member a `failed` result with its reason."""
    name = remote.member.name
    try:
        return await check_call(remote, check.seq, check.remote_seq, text)
    except TimeoutError:
        remote.broken = f"{name} did not answer within {_TIMEOUT_S:g} s (not asked again)"
        return _failed(check, remote.broken)
    except aiohttp.ServerFingerprintMismatch as err:
        got = "sha256:" + err.got.hex()
        why = f"asking {name} failed: its TLS certificate ({got}) is not the pinned one"
        remote.broken = why + " (not asked again)"
        return _failed(check, remote.broken)
    except (aiohttp.ClientError, ValueError) as err:
        why = f"asking {name} failed: {_short(err)}"
    except Exception as err:
        log.warning("checking call %d at %s: %s", check.seq, name, _short(err))
        why = f"asking {name} failed: {type(err).__name__}: {_short(err)}"
    if remote.checkpoint_failed:
        remote.broken = f"{why} (its checkpoint could not be had: not asked again)"
    return _failed(check, why)


def _short(err: BaseException) -> str:
    """The error's text, short and printable: it may quote the member (an error body), and a
    control character in it (a terminal escape) would rewrite the screen that shows it."""
    text = str(err) or type(err).__name__
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= 300 else text[:299] + "…"


async def _remote_replies(
    ledger: Ledger, run: str | None, limit: int
) -> list[tuple[Any, ModelReply, Remote]]:
    """Our model.reply entries another tally daemon answered (a body that is not a
    model.reply, `tally ledger verify --deep` names; it claims no remote call here)."""
    found: list[tuple[Any, ModelReply, Remote]] = []
    start = 0
    while len(found) < limit:
        batch = await ledger.entries(start=start, limit=1000, kind="model.reply", run=run)
        bodies = await ledger.read_bodies([entry.body for entry in batch])
        for entry, (_, body) in zip(batch, bodies, strict=True):
            try:
                reply = ModelReply.read(body)
            except ValidationError:
                continue
            if reply.remote is not None:
                found.append((entry, reply, reply.remote))
        if len(batch) < 1000:
            break
        start = batch[-1].seq + 1
    return found[:limit]
