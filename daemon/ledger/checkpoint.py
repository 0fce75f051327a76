"""Signed checkpoints: C2SP signed notes (https://c2sp.org/signed-note, tlog-checkpoint).

Note text::

    <origin>
    <tree size>
    <base64 root hash>
    time <unix microseconds>

    — <key name> <base64(4-byte key id || ed25519 signature of the text above the blank line)>

The key id is the first 4 bytes of SHA-256(name || "\\n" || 0x01 || public key). The public
key is also written as a C2SP verifier key string (`name+hexid+base64(0x01 || key)`) in
`checkpoint.vkey`, so checkpoints can be verified offline with nothing but that file.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict

from daemon.ledger.store import write_atomic

ED25519 = b"\x01"
SIG_PREFIX = "— "


class Checkpoint(BaseModel):
    """A parsed (and, once from `verify_note`, verified) checkpoint."""

    model_config = ConfigDict(frozen=True)

    origin: str
    size: int
    root: str  # hex
    time_us: int | None
    key_name: str
    key_id: str  # hex
    note: str


class CheckpointError(ValueError):
    """A note that does not parse or does not verify."""


def key_id(name: str, public: bytes) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + ED25519 + public).digest()[:4]


def vkey_string(name: str, public: bytes) -> str:
    return f"{name}+{key_id(name, public).hex()}+{base64.b64encode(ED25519 + public).decode()}"


def parse_vkey(vkey: str) -> tuple[str, bytes]:
    """(name, raw public key) from a verifier key string."""
    try:
        name, hexid, b64 = vkey.strip().split("+", 2)
        raw = base64.b64decode(b64, validate=True)
    except ValueError as err:
        raise CheckpointError(f"bad verifier key: {err}") from err
    if raw[:1] != ED25519 or len(raw) != 33 or key_id(name, raw[1:]).hex() != hexid:
        raise CheckpointError("bad verifier key: not a matching ed25519 key")
    return name, raw[1:]


CREDENTIAL = "tally-checkpoint.key"
"""The systemd credential name (`LoadCredential=tally-checkpoint.key:PATH`) of the signing key."""


def credential_key() -> Path | None:
    """The key systemd passed in $CREDENTIALS_DIRECTORY, if any.

    The units pair `LoadCredential=` with a `SetCredential=…:unset` default, so a credential
    that holds no PEM key means "none passed": the state dir's key is used.
    """
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        return None
    path = Path(directory) / CREDENTIAL
    try:
        with path.open("rb") as f:
            return path if f.read(11) == b"-----BEGIN " else None
    except OSError:
        return None


class Signer:
    """The state dir's ed25519 checkpoint key (created 0600 on first use)."""

    def __init__(self, private: Ed25519PrivateKey, name: str) -> None:
        self.private = private
        self.public = private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.name = name
        self.key_id = key_id(name, self.public)

    @classmethod
    def load_or_create(cls, ledger_dir: Path, writable: bool) -> Signer | None:
        """The credential's key if systemd passed one, else the state dir's (made if missing)."""
        key_path = credential_key() or ledger_dir / "checkpoint.key"
        if key_path.exists():
            private = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            if not isinstance(private, Ed25519PrivateKey):
                raise CheckpointError(f"{key_path} is not an ed25519 key")
        elif writable:
            private = Ed25519PrivateKey.generate()
            pem = private.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            write_atomic(key_path, pem, mode=0o600)
        else:
            return None
        signer = cls(private, cls.origin_for(private))
        vkey_path = ledger_dir / "checkpoint.vkey"
        if writable and not vkey_path.exists():
            write_atomic(vkey_path, (signer.vkey + "\n").encode(), mode=0o644)
        return signer

    @staticmethod
    def origin_for(private: Ed25519PrivateKey) -> str:
        public = private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return f"tally/ledger/{hashlib.sha256(public).hexdigest()[:16]}"

    @property
    def vkey(self) -> str:
        return vkey_string(self.name, self.public)

    def sign(self, size: int, root: bytes, time_us: int) -> Checkpoint:
        body = f"{self.name}\n{size}\n{base64.b64encode(root).decode()}\ntime {time_us}\n"
        sig = self.private.sign(body.encode())
        line = f"{SIG_PREFIX}{self.name} {base64.b64encode(self.key_id + sig).decode()}\n"
        return parse_note(body + "\n" + line)


def parse_note(text: str) -> Checkpoint:
    """Parse a checkpoint note (without checking its signature)."""
    body, sep, sigs = text.partition("\n\n")
    if not sep:
        raise CheckpointError("checkpoint note has no blank line before its signature")
    lines = body.split("\n")
    if len(lines) < 3:
        raise CheckpointError("checkpoint note needs origin, size and root lines")
    origin, size_text, root_b64, *extensions = lines
    try:
        size = int(size_text)
        root = base64.b64decode(root_b64, validate=True)
    except ValueError as err:
        raise CheckpointError(f"bad checkpoint field: {err}") from err
    if size < 0 or len(root) != 32 or str(size) != size_text:
        raise CheckpointError("bad checkpoint size or root")
    time_us = None
    for ext in extensions:
        if ext.startswith("time ") and ext[5:].isdigit():
            time_us = int(ext[5:])
    first = sigs.split("\n")[0]
    if not first.startswith(SIG_PREFIX):
        raise CheckpointError("checkpoint note has no signature line")
    try:
        name, b64 = first[len(SIG_PREFIX) :].split(" ")
        raw = base64.b64decode(b64, validate=True)
    except ValueError as err:
        raise CheckpointError(f"bad signature line: {err}") from err
    return Checkpoint(
        origin=origin,
        size=size,
        root=root.hex(),
        time_us=time_us,
        key_name=name,
        key_id=raw[:4].hex(),
        note=text,
    )


def verify_note(text: str, vkey: str) -> Checkpoint:
    """Parse and check the signature against a verifier key; raise `CheckpointError`."""
    name, public = parse_vkey(vkey)
    checkpoint = parse_note(text)
    body = text.partition("\n\n")[0] + "\n"
    want_id = key_id(name, public)
    for line in text.partition("\n\n")[2].split("\n"):
        if not line.startswith(SIG_PREFIX):
            continue
        sig_name, b64 = line[len(SIG_PREFIX) :].split(" ", 1)
        raw = base64.b64decode(b64)
        if sig_name != name or raw[:4] != want_id:
            continue
        try:
            Ed25519PublicKey.from_public_bytes(public).verify(raw[4:], body.encode())
        except InvalidSignature as err:
            raise CheckpointError("checkpoint signature does not verify") from err
        if checkpoint.origin != name:
            raise CheckpointError("checkpoint origin does not match the key name")
        return checkpoint
    raise CheckpointError(f"checkpoint has no signature by {name}")


def save_checkpoint(path: Path, checkpoint: Checkpoint) -> None:
    write_atomic(path, checkpoint.note.encode(), mode=0o644)


def load_checkpoint(path: Path) -> Checkpoint | None:
    try:
        return parse_note(path.read_text())
    except FileNotFoundError:
        return None
