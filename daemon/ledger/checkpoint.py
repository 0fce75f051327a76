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

The signature library (`cryptography`, 10–40 ms to import) loads at the first signature or
check, not with the daemon: opening a ledger only finds its key, or writes a new one, and
checks that it is an ed25519 key (`SignerOnDemand`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from daemon import layout
from daemon.ledger.errors import SignerUnusable
from daemon.ledger.store import write_atomic

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

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


# RFC 8410: a PKCS #8 ed25519 private key is this DER header and the 32-byte seed. (The form
# with the public key after the seed is refused by `cryptography`'s loader, so here too.)
_PKCS8_ED25519 = bytes.fromhex("302e020100300506032b657004220420")
MAX_KEY_BYTES = 4096
_PEM_BEGIN, _PEM_END = "-----BEGIN PRIVATE KEY-----", "-----END PRIVATE KEY-----"


def key_pem(seed: bytes) -> bytes:
    """A new key's file: the PKCS #8 PEM that `cryptography` writes for this seed (a test holds
    the two equal), made without loading it."""
    der = base64.encodebytes(_PKCS8_ED25519 + seed).decode().replace("\n", "")
    lines = [der[i : i + 64] for i in range(0, len(der), 64)]
    return "\n".join([_PEM_BEGIN, *lines, _PEM_END, ""]).encode()


def read_key(path: Path) -> bytes:
    """The file's bytes if it holds a PKCS #8 PEM ed25519 private key, else `CheckpointError`:
    exactly the keys `cryptography` loads as ed25519 (a test holds the two to the same cases).
    Such a file is about 120 bytes: more than MAX_KEY_BYTES is refused unread."""
    with path.open("rb") as f:
        pem = f.read(MAX_KEY_BYTES + 1)
    if len(pem) > MAX_KEY_BYTES:
        raise CheckpointError(f"{path} is not an ed25519 key: over {MAX_KEY_BYTES} bytes")
    try:
        text = pem.decode("ascii").strip()
        body = text.removeprefix(_PEM_BEGIN).removesuffix(_PEM_END)
        der = base64.b64decode("".join(body.split()), validate=True)
    except (UnicodeDecodeError, binascii.Error) as err:
        raise CheckpointError(f"{path} is not an ed25519 key: {err}") from err
    armored = text.startswith(_PEM_BEGIN) and text.endswith(_PEM_END)
    if not (armored and len(der) == 48 and der.startswith(_PKCS8_ED25519)):
        raise CheckpointError(f"{path} is not an ed25519 key")
    return pem


def key_seed(pem: bytes) -> bytes:
    """The 32-byte seed of a key `read_key` accepted."""
    text = pem.decode("ascii").strip().removeprefix(_PEM_BEGIN).removesuffix(_PEM_END)
    return base64.b64decode("".join(text.split()))[len(_PKCS8_ED25519) :]


def verify_message(vkey: str, message: bytes, signature: bytes) -> bool:
    """Whether `signature` is the vkey's ed25519 signature of `message` (see `sign_message`)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    _, public = parse_vkey(vkey)
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except InvalidSignature:
        return False
    return True


class Signer:
    """An ed25519 checkpoint key, loaded."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        from cryptography.hazmat.primitives import serialization

        self.private = private
        self.public = private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.name = f"tally/ledger/{hashlib.sha256(self.public).hexdigest()[:16]}"
        self.key_id = key_id(self.name, self.public)

    @classmethod
    def load(cls, pem: bytes, where: Path) -> Signer:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        try:
            private = serialization.load_pem_private_key(pem, password=None)
        except ValueError as err:
            raise CheckpointError(f"{where} is not an ed25519 key: {err}") from err
        if not isinstance(private, Ed25519PrivateKey):
            raise CheckpointError(f"{where} is not an ed25519 key")
        return cls(private)

    @property
    def vkey(self) -> str:
        return vkey_string(self.name, self.public)

    def sign_message(self, message: bytes) -> bytes:
        """A raw ed25519 signature of `message` (derived data the daemon vouches for, such as
        the run snapshot: its messages never begin as a note does, with the key's name)."""
        return self.private.sign(message)

    def sign(self, size: int, root: bytes, time_us: int) -> Checkpoint:
        body = f"{self.name}\n{size}\n{base64.b64encode(root).decode()}\ntime {time_us}\n"
        sig = self.private.sign(body.encode())
        line = f"{SIG_PREFIX}{self.name} {base64.b64encode(self.key_id + sig).decode()}\n"
        return parse_note(body + "\n" + line)


class SignerOnDemand:
    """The ledger owner's signer, loaded at its first use (a checkpoint, `vkey`, or the daemon's
    warm-up) from any thread, once.

    Made at open: the key is the credential systemd passed, else the state dir's, written there
    (0600) from a fresh random seed when missing. It is read then, once, and checked to be an
    ed25519 key, so a wrong key still stops the open and names its path. `checkpoint.vkey` is
    written at the load if missing: before any checkpoint exists."""

    def __init__(self, ledger_dir: Path) -> None:
        self.dir = ledger_dir
        self.path = credential_key() or ledger_dir / layout.CHECKPOINT_KEY
        if not self.path.exists():
            write_atomic(self.path, key_pem(os.urandom(32)), mode=0o600)
        self._pem = read_key(self.path)
        # A MAC key derived from the seed (domain-separated): the owner checks what it sealed
        # itself without loading the signature library at start.
        self.mac_key = hashlib.sha256(b"tally mac key\0" + key_seed(self._pem)).digest()
        self._signer: Signer | None = None
        self._lock = threading.Lock()

    def get(self) -> Signer:
        with self._lock:
            if self._signer is None:
                try:
                    signer = Signer.load(self._pem, self.path)
                except CheckpointError as err:
                    raise SignerUnusable(str(err), details={"path": str(self.path)}) from err
                vkey_path = self.dir / layout.CHECKPOINT_VKEY
                if not vkey_path.exists():
                    write_atomic(vkey_path, (signer.vkey + "\n").encode(), mode=0o644)
                self._signer = signer
            return self._signer


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
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

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
