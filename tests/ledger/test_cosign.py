"""Cosignature lines (C2SP tlog-cosignature, Ed25519 `cosignature/v1`), checked against the
spec's own example and an independent reading of the spec written here with `cryptography`,
and the quorum verifier against hostile notes."""

from __future__ import annotations

import base64
import hashlib
import os
import random
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from daemon.ledger.checkpoint import Signer, key_pem
from daemon.ledger.cosign import (
    CosignError,
    attach,
    check_cosignature,
    cosign_line,
    cosigner_names,
    cosigner_vkey,
    parse_cosigner_vkey,
    split_note,
    verify_quorum,
)

# The example of c2sp.org/tlog-cosignature: a checkpoint with its log's signature and one
# witness cosignature, and the message that witness signed.
SPEC_NOTE = (
    "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n\n"
    "— example.com/behind-the-sofa Az3grlgtzPICa5OS8npVmf1Myq/5IZniMp+ZJurmRDeOoRDe4URYN7u5/"
    "Zhcyv2q1gGzGku9nTo+zyWE+xeMcTOAYQ8=\n"
    "— witness.example.com/w1 jWbPPwAAAABkGFDLEZMHwSRaJNiIDoe9DYn/zXcrtPHeolMI5OWXEhZCB9dlrDJs"
    "X3b2oyin1nPZqhf5nNo0xUe+mbIUBkBIfZ+qnA==\n"
)


def _signer() -> Signer:
    return Signer.load(key_pem(os.urandom(32)), Path("test"))


def _note(signer: Signer, size: int = 7) -> str:
    return signer.sign(
        size, hashlib.sha256(str(size).encode()).digest(), 1_700_000_000_000_000
    ).note


def test_the_spec_example_parses_as_its_layout_says() -> None:
    """key id (4) || u64 big-endian timestamp || signature (64): the witness line holds the
    timestamp of the spec's signed-message example, `time 1679315147`."""
    body, lines = split_note(SPEC_NOTE)
    assert body.endswith("q2I=\n")
    assert cosigner_names(SPEC_NOTE) == ["witness.example.com/w1"]
    raw = base64.b64decode(lines[1].split(" ")[2])
    assert len(raw) == 76
    assert int.from_bytes(raw[4:12], "big") == 1679315147


def test_a_line_verifies_by_an_independent_reading_of_the_spec() -> None:
    private = Ed25519PrivateKey.generate()
    public = private.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    name = "witness.example/w"
    body = "example.com/log\n5\n" + base64.b64encode(bytes(32)).decode() + "\n"
    line = cosign_line(name, public, private.sign, body, 1679315147)
    # the spec, step by step: the line, the key id, the timestamp, the message
    prefix = f"— {name} "
    assert line.startswith(prefix)
    raw = base64.b64decode(line[len(prefix) :])
    want_id = hashlib.sha256(name.encode() + b"\n\x04" + public).digest()[:4]
    assert raw[:4] == want_id
    assert raw[4:12] == (1679315147).to_bytes(8, "big")
    message = b"cosignature/v1\ntime 1679315147\n" + body.encode()
    private.public_key().verify(raw[12:], message)  # raises if not
    # and the vkey a verifier is given: name+hex(key id)+base64(0x04 || key)
    vkey = cosigner_vkey(name, public)
    typed = base64.b64encode(b"\x04" + public).decode()
    assert vkey == f"{name}+{want_id.hex()}+{typed}"
    assert parse_cosigner_vkey(vkey) == (name, public)
    assert check_cosignature(body, line, name, public) == 1679315147


def test_the_daemon_key_cosigns_and_either_vkey_form_verifies() -> None:
    origin, b, c = _signer(), _signer(), _signer()
    note = _note(origin)
    body = split_note(note)[0]
    lines = [cosign_line(s.name, s.public, s.sign_message, body, 1_700_000_000) for s in (b, c)]
    cosigned = attach(note, lines)
    listed = {"b": b.vkey, "c": cosigner_vkey(c.name, c.public)}  # type 0x01 and type 0x04
    report = verify_quorum(cosigned, listed, 2, origin_vkey=origin.vkey, now=1_700_000_100)
    assert report.ok, report
    assert report.origin_signature == "valid"
    assert [r.timestamp for r in report.results] == [1_700_000_000] * 2
    # a fresher line by the same key replaces the old one; another key's is added
    newer = cosign_line(b.name, b.public, b.sign_message, body, 1_700_000_050)
    again = attach(cosigned, [newer])
    assert again.count("\n— ") == 3
    assert verify_quorum(again, listed, 2, now=1_700_000_100).results[0].timestamp == 1_700_000_050


def test_quorum_failures_say_which_and_why() -> None:
    origin, b, c, d = _signer(), _signer(), _signer(), _signer()
    note = _note(origin)
    body = split_note(note)[0]
    cosigned = attach(note, [cosign_line(b.name, b.public, b.sign_message, body, 100)])
    listed = {"b": b.vkey, "c": c.vkey}
    report = verify_quorum(cosigned, listed, 2, origin_vkey=origin.vkey, now=200)
    assert not report.ok
    assert [r.status for r in report.results] == ["verified", "missing"]
    assert report.reason == "1 of the 2 listed cosigners verified; the quorum is 2"
    # the origin's key not the one given
    wrong = verify_quorum(cosigned, listed, 1, origin_vkey=d.vkey, now=200)
    assert not wrong.ok
    assert "origin's signature does not verify" in (wrong.reason or "")
    # in the future, too old
    future = verify_quorum(cosigned, {"b": b.vkey}, 1, now=100 - 3600)
    assert "in the future" in (future.results[0].reason or "")
    stale = verify_quorum(cosigned, {"b": b.vkey}, 1, now=100 + 3600, max_age_s=60)
    assert "stale" in (stale.results[0].reason or "")
    # a key that does not parse is the caller's: named
    bad = verify_quorum(cosigned, {"x": "nonsense"}, 1)
    assert bad.results[0].status == "failed"
    assert "bad cosigner key" in (bad.results[0].reason or "")
    # a line with b's name and key id and someone else's signature
    forged = cosign_line(b.name, b.public, c.sign_message, body, 100)
    report = verify_quorum(attach(note, [forged]), {"b": b.vkey}, 1, now=200)
    assert report.results[0].status == "failed"
    assert "does not verify over this checkpoint" in (report.results[0].reason or "")


@pytest.mark.parametrize(
    ("note", "problem"),
    [
        ("", "no blank line"),
        ("a\n1\nAAAA\n\n— a AAAAAAAA", "no final newline"),
        ("a\n1\nAAAA\n\nnot a signature\n", "does not begin with"),
        ("a\n1\nAAAA\n\n— a b c\n", "is not '— <name> <base64>'"),
        ("a\n1\nAAAA\n\n— a !!!!\n", "bad base64"),
        ("a\n1\nAAAA\n\n— a AAAA\n", "too short"),
        ("a\n1\nAAAA\n\n" + "— a AAAAAAAA\n" * 101, "over 100 signature lines"),
        ("x" * 20000, "over 16384 characters"),
    ],
)
def test_malformed_notes_are_named(note: str, problem: str) -> None:
    with pytest.raises(CosignError, match=problem):
        split_note(note)
    report = verify_quorum(note, {"b": _signer().vkey}, 1)
    assert not report.ok
    assert problem in (report.reason or "")


def test_garbage_never_raises() -> None:
    signer = _signer()
    note = attach(
        _note(signer),
        [cosign_line(signer.name, signer.public, signer.sign_message, "x\n", 5)],
    )
    rng = random.Random(33)
    for _ in range(300):
        chars = list(note)
        for _ in range(rng.randint(1, 4)):
            chars[rng.randrange(len(chars))] = rng.choice("\n —+=A/\x00é")
        report = verify_quorum("".join(chars), {"s": signer.vkey}, 1, origin_vkey=signer.vkey)
        assert isinstance(report.ok, bool)
