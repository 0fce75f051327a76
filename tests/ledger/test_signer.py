"""The checkpoint key at open, without the signature library, and at its first use.

Opening a ledger reads and checks its key but does not import `cryptography` (10–40 ms of a
daemon's start): the check must accept exactly the keys the library then loads as ed25519,
and a key that fails at the load must not take the ledger down with it.
"""

from __future__ import annotations

import base64
import os
import re
import textwrap
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from daemon.ledger import CheckpointError, Ledger, verify_note
from daemon.ledger.checkpoint import Signer, key_pem, read_key
from daemon.ledger.errors import SignerUnusable
from tests.interpreter import run_fresh

PKCS8 = (serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8)


PrivateKey = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def pem_of(
    key: PrivateKey, encryption: serialization.KeySerializationEncryption | None = None
) -> bytes:
    return key.private_bytes(*PKCS8, encryption or serialization.NoEncryption())


def test_a_new_key_is_the_pem_the_library_writes() -> None:
    for _ in range(20):
        seed = os.urandom(32)
        ours = key_pem(seed)
        assert ours == pem_of(ed25519.Ed25519PrivateKey.from_private_bytes(seed))
        loaded = serialization.load_pem_private_key(ours, password=None)
        assert isinstance(loaded, ed25519.Ed25519PrivateKey)


def candidates() -> dict[str, bytes]:
    """Files a key path may hold: ed25519 in the forms people have, and what is not one."""
    good = pem_of(ed25519.Ed25519PrivateKey.generate())
    seed = os.urandom(32)
    public = (
        ed25519.Ed25519PrivateKey.from_private_bytes(seed)
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )
    # RFC 8410's version-1 form, the public key after the seed.
    v1 = bytes.fromhex("3051020101300506032b657004220420") + seed + b"\x81\x21\x00" + public
    v1_pem = b"-----BEGIN PRIVATE KEY-----\n" + base64.encodebytes(v1)
    v1_pem += b"-----END PRIVATE KEY-----\n"
    lines = good.split(b"\n")
    return {
        "ed25519": good,
        "ed25519, CRLF": good.replace(b"\n", b"\r\n"),
        "ed25519, no final newline": good.rstrip(b"\n"),
        "ed25519, version 1 with its public key": v1_pem,
        "ed25519, encrypted": pem_of(
            ed25519.Ed25519PrivateKey.generate(), serialization.BestAvailableEncryption(b"pw")
        ),
        "ed448's header on an ed25519 seed": good.replace(b"MC4CAQAwBQYDK2Vw", b"MC4CAQAwBQYDK2Vx"),
        "ed25519, cut short": b"\n".join([lines[0], lines[1][:40], lines[-2], b""]),
        "ed25519, trailing data": good.replace(b"\n-----END", b"AAAA\n-----END"),
        "p-256": pem_of(ec.generate_private_key(ec.SECP256R1())),
        "rsa": pem_of(rsa.generate_private_key(public_exponent=65537, key_size=1024)),
        "public key": ed25519.Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo),
        "empty": b"",
        "binary": os.urandom(64),
        "not base64": b"-----BEGIN PRIVATE KEY-----\n!!!!\n-----END PRIVATE KEY-----\n",
    }


def library_loads_ed25519(pem: bytes) -> bool:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except Exception:  # ValueError, TypeError (encrypted), InternalError (an Ed448 header)
        return False
    return isinstance(key, ed25519.Ed25519PrivateKey)


def test_the_check_at_open_accepts_exactly_what_the_library_loads(tmp_path: Path) -> None:
    for name, pem in candidates().items():
        path = tmp_path / "key"
        path.write_bytes(pem)
        if library_loads_ed25519(pem):
            assert read_key(path) == pem, name
            assert Signer.load(pem, path).vkey  # and the loaded key signs
        else:
            with pytest.raises(CheckpointError, match=re.escape(str(path))):
                read_key(path)
    assert library_loads_ed25519(candidates()["ed25519"])  # the comparison can say yes


def test_open_reads_the_key_without_the_library_and_signs_at_first_use(tmp_path: Path) -> None:
    """In a fresh interpreter: open (a new key), append, no `cryptography`; then a checkpoint
    loads it, writes `checkpoint.vkey`, and the note verifies against it."""
    script = textwrap.dedent(
        """
        import asyncio, sys
        from pathlib import Path
        from daemon.ledger import Ledger, verify_note

        async def main(state):
            ledger = await Ledger.open(state)
            await ledger.append(actor="t", kind="note", body={"a": 1})
            key = state / "ledger" / "checkpoint.key"
            assert key.stat().st_mode & 0o777 == 0o600
            assert not (state / "ledger" / "checkpoint.vkey").exists()
            assert not any(m.startswith("cryptography") for m in sys.modules), "loaded at open"
            checkpoint = await ledger.checkpoint()
            vkey = (state / "ledger" / "checkpoint.vkey").read_text()
            assert vkey.strip() == ledger.vkey
            assert verify_note(checkpoint.note, vkey).size == 1
            await ledger.close()
            print("ok")

        asyncio.run(main(Path(sys.argv[1])))
        """
    )
    done = run_fresh(script, str(tmp_path / "state"), timeout=60)
    assert done.stdout.strip() == "ok"


async def test_a_key_that_is_not_ed25519_stops_the_open_and_names_it(state_dir: Path) -> None:
    (state_dir / "ledger").mkdir()
    key = state_dir / "ledger" / "checkpoint.key"
    key.write_bytes(candidates()["p-256"])
    with pytest.raises(CheckpointError, match=r"checkpoint\.key is not an ed25519 key"):
        await Ledger.open(state_dir)


async def test_a_key_that_fails_to_load_stops_signing_not_the_ledger(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = await Ledger.open(state_dir)

    def refuse(pem: bytes, where: Path) -> Signer:
        raise CheckpointError(f"{where} is not an ed25519 key: refused")

    monkeypatch.setattr(Signer, "load", staticmethod(refuse))
    await ledger.append(actor="t", kind="note")
    with pytest.raises(SignerUnusable, match="refused"):
        await ledger.checkpoint()
    entry = await ledger.append(actor="t", kind="note")  # appends go on
    assert entry.seq == 1
    await ledger.close()  # no final checkpoint, but closed: the lock is released
    monkeypatch.undo()
    again = await Ledger.open(state_dir)
    checkpoint = await again.checkpoint()
    assert checkpoint.size == 2
    assert again.vkey is not None
    assert verify_note(checkpoint.note, again.vkey).size == 2
    await again.close()


def test_a_key_file_past_the_bound_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_bytes(key_pem(os.urandom(32)) + b"\n" * (1 << 20))
    with pytest.raises(CheckpointError, match=re.escape(f"{path} is not an ed25519 key: over")):
        read_key(path)
