"""Cosignatures of checkpoints (C2SP tlog-cosignature, the Ed25519 `cosignature/v1` type).

A cosignature is a statement by a cosigner that, as of its timestamp, the checkpoint is the
largest consistent tree head it has seen for that origin. It is one more signature line on
the checkpoint's signed note::

    — <cosigner name> base64(key id || u64 big-endian timestamp || ed25519 signature)

- key id: the first 4 bytes of SHA-256(name || "\\n" || 0x04 || public key);
- signed message: "cosignature/v1\\n", "time <timestamp>\\n" (POSIX seconds, no leading
  zeros), then the note's whole body including its final newline (not its signatures).

A tally daemon cosigns with its checkpoint key, under its checkpoint key's name: one key per
daemon. The three messages that key signs cannot be confused: its checkpoint notes begin with
its name (`tally/ledger/…`), cosignatures with `cosignature/v1`, run snapshot seals with their
own domain. So the cosigner's verifier key is the daemon's `checkpoint.vkey` with type 0x04
(`cosigner_vkey`); `parse_cosigner_vkey` takes either form.

Everything here is pure (no I/O): parsing and checking what others send is the part that
must hold against hostile input, and it is tested on its own.
"""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from pydantic import BaseModel

from daemon.ledger.checkpoint import (
    ED25519,
    SIG_PREFIX,
    Checkpoint,
    CheckpointError,
    parse_note,
    parse_vkey,
    verify_note,
)

COSIGNATURE_V1 = b"\x04"
MAX_NOTE_CHARS = 16384
"""A checkpoint with a few dozen signature lines is under 8 KiB; more is refused unread."""
MAX_SIGNATURES = 100
"""As Go's note package: a note with more signature lines is refused."""
MAX_FUTURE_S = 300
"""A cosignature timestamped further ahead of the verifier's clock than this is refused."""


class CosignError(ValueError):
    """A cosigned note or a cosigner key that cannot be used, with what is wrong."""


def cosigner_key_id(name: str, public: bytes) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + COSIGNATURE_V1 + public).digest()[:4]


def cosigner_vkey(name: str, public: bytes) -> str:
    """The C2SP verifier key of a cosigner (signature type 0x04)."""
    raw = base64.b64encode(COSIGNATURE_V1 + public).decode()
    return f"{name}+{cosigner_key_id(name, public).hex()}+{raw}"


def parse_cosigner_vkey(vkey: str) -> tuple[str, bytes]:
    """(name, ed25519 public key) of a cosigner: its type-0x04 vkey, or the daemon's
    checkpoint vkey (type 0x01) for the same key and name. `CosignError` otherwise."""
    try:
        name, hexid, b64 = vkey.strip().split("+", 2)
        raw = base64.b64decode(b64, validate=True)
    except ValueError as err:
        raise CosignError(f"bad cosigner key {vkey[:80]!r}: not name+hexid+base64") from err
    if raw[:1] == ED25519:
        try:
            return parse_vkey(vkey)
        except CheckpointError as err:
            raise CosignError(f"bad cosigner key {vkey[:80]!r}: {err}") from err
    public = raw[1:]
    if raw[:1] != COSIGNATURE_V1 or len(public) != 32:
        raise CosignError(
            f"bad cosigner key {vkey[:80]!r}: not an ed25519 key of type 0x04 or 0x01"
        )
    if not name or cosigner_key_id(name, public).hex() != hexid:
        raise CosignError(f"bad cosigner key {vkey[:80]!r}: its key id does not match")
    return name, public


def cosignature_message(body: str, timestamp: int) -> bytes:
    return f"cosignature/v1\ntime {timestamp}\n".encode() + body.encode()


def split_note(note: str) -> tuple[str, list[str]]:
    """(body including its final newline, signature lines), each line checked for shape."""
    if len(note) > MAX_NOTE_CHARS:
        raise CosignError(f"the note is over {MAX_NOTE_CHARS} characters")
    body, sep, sigs = note.partition("\n\n")
    if not sep:
        raise CosignError("the note has no blank line before its signatures")
    if not sigs.endswith("\n"):
        raise CosignError("the note's last signature line has no final newline")
    lines = sigs[:-1].split("\n")
    if len(lines) > MAX_SIGNATURES:
        raise CosignError(f"the note has over {MAX_SIGNATURES} signature lines")
    for i, line in enumerate(lines, 1):
        _parse_line(line, i)
    return body + "\n", lines


def _parse_line(line: str, index: int) -> tuple[str, bytes]:
    """(key name, decoded signature bytes) of one signature line."""
    if not line.startswith(SIG_PREFIX):
        raise CosignError(f"signature line {index} does not begin with '— '")
    parts = line[len(SIG_PREFIX) :].split(" ")
    if len(parts) != 2 or not parts[0] or "+" in parts[0]:
        raise CosignError(f"signature line {index} is not '— <name> <base64>'")
    try:
        raw = base64.b64decode(parts[1], validate=True)
    except ValueError as err:
        raise CosignError(f"signature line {index}: bad base64: {err}") from err
    if len(raw) < 5:
        raise CosignError(f"signature line {index} is too short for a key id and signature")
    return parts[0], raw


def cosign_line(
    name: str, public: bytes, sign: Callable[[bytes], bytes], body: str, timestamp: int
) -> str:
    """A cosignature line on a note `body`, by the key `sign` signs with (name, public)."""
    if not 0 <= timestamp < 1 << 63:
        raise CosignError(f"timestamp {timestamp} out of range")
    signature = sign(cosignature_message(body, timestamp))
    raw = cosigner_key_id(name, public) + timestamp.to_bytes(8, "big") + signature
    return f"{SIG_PREFIX}{name} {base64.b64encode(raw).decode()}"


def check_cosignature(body: str, line: str, name: str, public: bytes) -> int:
    """The timestamp of `line` if it is `name`'s valid cosignature of `body`; else
    `CosignError` saying why (another key, a bad signature)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    got_name, raw = _parse_line(line, 1)
    if got_name != name or raw[:4] != cosigner_key_id(name, public):
        raise CosignError(f"the line is not a cosignature by {name}")
    if len(raw) != 4 + 8 + 64:
        raise CosignError(f"{name}'s cosignature is {len(raw)} bytes, not 76")
    timestamp = int.from_bytes(raw[4:12], "big")
    if timestamp >= 1 << 63:
        raise CosignError(f"{name}'s cosignature has a timestamp past 2^63 - 1")
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(
            raw[12:], cosignature_message(body, timestamp)
        )
    except InvalidSignature as err:
        raise CosignError(
            f"{name}'s cosignature does not verify over this checkpoint (made for another "
            "checkpoint, or altered)"
        ) from err
    return timestamp


def attach(note: str, lines: Iterable[str]) -> str:
    """The note with `lines` added; a line by a key (name and key id) already on the note
    replaces that key's line, so a fresh cosignature supersedes an older one."""
    body, present = split_note(note)
    out = list(present)
    for line in lines:
        name, raw = _parse_line(line, len(out) + 1)
        for i, old in enumerate(out):
            old_name, old_raw = _parse_line(old, i + 1)
            if (old_name, old_raw[:4]) == (name, raw[:4]):
                out[i] = line
                break
        else:
            out.append(line)
    return body + "\n" + "".join(line + "\n" for line in out)


def cosigner_names(note: str) -> list[str]:
    """The key names of a note's signature lines after the first (the origin's)."""
    _, lines = split_note(note)
    return [_parse_line(line, i)[0] for i, line in enumerate(lines[1:], 2)]


Status = Literal["verified", "failed", "missing"]


class CosignerResult(BaseModel):
    """One listed cosigner, as the verifier found it on the note."""

    cosigner: str
    """The verifier's name for it (`--cosigner NAME=KEY`)."""
    key_name: str
    status: Status
    timestamp: int | None = None
    reason: str | None = None


class QuorumReport(BaseModel):
    ok: bool
    quorum: int
    verified: int
    origin: str | None = None
    size: int | None = None
    root: str | None = None
    """Hex, as in `Checkpoint`."""
    origin_signature: str
    """`valid`, `unchecked` (no origin key given) or why it failed."""
    results: list[CosignerResult]
    reason: str | None = None
    """Why it is not ok, in one sentence."""


def verify_quorum(
    note: str,
    cosigners: Mapping[str, str],
    quorum: int,
    *,
    origin_vkey: str | None = None,
    now: float | None = None,
    max_age_s: float | None = None,
) -> QuorumReport:
    """Check a cosigned checkpoint: the origin's signature (if `origin_vkey`), then each
    listed cosigner (label -> vkey); ok when at least `quorum` distinct keys verified.

    Never raises on a bad note: every problem is in the report, with its reason. A label's
    key that does not parse is a `failed` result (the caller's mistake, named)."""
    now = time.time() if now is None else now
    report = QuorumReport(
        ok=False, quorum=quorum, verified=0, origin_signature="unchecked", results=[]
    )
    try:
        body, lines = split_note(note)
        checkpoint: Checkpoint = parse_note(note)
    except (CosignError, CheckpointError) as err:
        report.reason = f"the checkpoint is not a signed note: {err}"
        return report
    report.origin, report.size, report.root = checkpoint.origin, checkpoint.size, checkpoint.root
    if origin_vkey is not None:
        try:
            verify_note(note, origin_vkey)
            report.origin_signature = "valid"
        except (CheckpointError, ValueError) as err:
            report.origin_signature = f"INVALID: {err}"
    seen_keys: set[bytes] = set()
    for label, vkey in cosigners.items():
        report.results.append(_one(label, vkey, body, lines, now, max_age_s, seen_keys))
    report.verified = sum(r.status == "verified" for r in report.results)
    if report.origin_signature.startswith("INVALID"):
        report.reason = f"the origin's signature does not verify ({report.origin_signature})"
    elif quorum < 1:
        report.reason = "a quorum must be at least 1"
    elif report.verified < quorum:
        report.reason = (
            f"{report.verified} of the {len(cosigners)} listed cosigners verified; "
            f"the quorum is {quorum}"
        )
    else:
        report.ok = True
    return report


def _one(
    label: str,
    vkey: str,
    body: str,
    lines: list[str],
    now: float,
    max_age_s: float | None,
    seen_keys: set[bytes],
) -> CosignerResult:
    try:
        name, public = parse_cosigner_vkey(vkey)
    except CosignError as err:
        return CosignerResult(cosigner=label, key_name="?", status="failed", reason=str(err))
    result = CosignerResult(cosigner=label, key_name=name, status="missing")
    want_id = cosigner_key_id(name, public)
    mine = [
        line
        for i, line in enumerate(lines, 1)
        if _parse_line(line, i)[0] == name and _parse_line(line, i)[1][:4] == want_id
    ]
    if not mine:
        result.reason = f"the checkpoint carries no cosignature by {name}"
        return result
    if public in seen_keys:
        result.status = "failed"
        result.reason = "the same key is listed under another name: it counts once"
        return result
    try:
        timestamp = check_cosignature(body, mine[0], name, public)
    except CosignError as err:
        result.status, result.reason = "failed", str(err)
        return result
    result.timestamp = timestamp
    if timestamp > now + MAX_FUTURE_S:
        result.status = "failed"
        result.reason = f"its timestamp {timestamp} is in the future (now {int(now)})"
    elif max_age_s is not None and timestamp < now - max_age_s:
        result.status = "failed"
        age = int(now - timestamp)
        result.reason = f"stale: made {age} s ago, more than the {max_age_s:g} s allowed"
    else:
        result.status = "verified"
        seen_keys.add(public)
    return result


def same_key(vkey_a: str, vkey_b: str) -> bool:
    """Whether two verifier keys (either type) name the same ed25519 key under the same name."""
    try:
        return parse_cosigner_vkey(vkey_a) == parse_cosigner_vkey(vkey_b)
    except CosignError:
        return False


__all__ = [
    "COSIGNATURE_V1",
    "CosignError",
    "CosignerResult",
    "QuorumReport",
    "attach",
    "check_cosignature",
    "cosign_line",
    "cosignature_message",
    "cosigner_key_id",
    "cosigner_names",
    "cosigner_vkey",
    "parse_cosigner_vkey",
    "same_key",
    "split_note",
    "verify_quorum",
]
