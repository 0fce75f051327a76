"""The console's in-browser proof check, run in Node on the same vectors as the Python verifier:
real ledger entries (some non-ASCII), real inclusion proofs and a real signed checkpoint; each
tampered line, proof, root, signature or key must fail in both, at the step that shows it."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from daemon.ledger import Ledger
from daemon.ledger.checkpoint import CheckpointError, verify_note
from daemon.ledger.merkle import leaf_hash, verify_inclusion

ROOT = Path(__file__).resolve().parents[2]
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")


def _python_verdict(data: dict[str, Any]) -> bool:
    """The Python verifier's answer on the same data."""
    try:
        cp = verify_note(data["note"], data["vkey"])
    except CheckpointError:
        return False
    proof = data["proof"]
    entry = json.loads(data["line"])
    if entry.get("seq") != data["seq"] or proof["leaf_index"] != data["seq"]:
        return False
    if proof["tree_size"] != cp.size:
        return False
    try:
        path = [bytes.fromhex(p) for p in proof["path"]]
    except ValueError:
        return False
    leaf = leaf_hash(data["line"].encode())
    return verify_inclusion(data["seq"], cp.size, leaf, path, bytes.fromhex(cp.root))


def _flip_hex(value: str) -> str:
    return ("1" if value[0] == "0" else "0") + value[1:]


async def _vectors(state: Path) -> list[dict[str, Any]]:
    ledger = await Ledger.open(state)
    try:
        for i in range(13):
            await ledger.append(
                actor="test", kind="note", body={"i": i, "text": "ünïcødé ✓ \u2028"}
            )
        cp = await ledger.checkpoint()
        vkey = ledger.vkey
        assert vkey is not None
        cases: list[dict[str, Any]] = []
        for seq in (0, 5, 12):
            entry = await ledger.get(seq)
            proof = (await ledger.inclusion_proof(seq, size=cp.size)).model_dump()
            good = {
                "seq": seq,
                "line": entry.line().decode(),
                "proof": proof,
                "note": cp.note,
                "vkey": vkey,
            }
            cases.append({"name": f"entry {seq}", "ok": True, "data": good})
        good = cases[1]["data"]
        line = good["line"].replace('"actor":"test"', '"actor":"tset"')
        cases.append({"name": "tampered line", "ok": False, "data": good | {"line": line}})
        path = [_flip_hex(good["proof"]["path"][0]), *good["proof"]["path"][1:]]
        cases.append(
            {
                "name": "tampered proof",
                "ok": False,
                "data": good | {"proof": good["proof"] | {"path": path}},
            }
        )
        short = good["proof"] | {"path": good["proof"]["path"][:-1]}
        cases.append({"name": "truncated proof", "ok": False, "data": good | {"proof": short}})
        other = (await ledger.get(6)).line().decode()
        cases.append({"name": "another entry's line", "ok": False, "data": good | {"line": other}})
        body, _, sig = good["note"].partition("\n\n")
        name, b64 = sig.strip().removeprefix("— ").split(" ")
        raw = bytearray(base64.b64decode(b64))
        raw[-1] ^= 1
        bad_sig = f"{body}\n\n— {name} {base64.b64encode(bytes(raw)).decode()}\n"
        cases.append({"name": "tampered signature", "ok": False, "data": good | {"note": bad_sig}})
        lines = body.split("\n")
        lines[1] = str(int(lines[1]) + 1)
        cases.append(
            {
                "name": "tampered size",
                "ok": False,
                "data": good | {"note": "\n".join(lines) + "\n\n" + sig},
            }
        )
        other_ledger = await Ledger.open(state.parent / "other")
        try:
            foreign = other_ledger.vkey
        finally:
            await other_ledger.close()
        cases.append({"name": "another key", "ok": False, "data": good | {"vkey": foreign}})
        return cases
    finally:
        await ledger.close()


def test_node_and_python_agree_on_every_vector(tmp_path: Path) -> None:
    cases = asyncio.run(_vectors(tmp_path / "state"))
    for case in cases:
        assert _python_verdict(case["data"]) is case["ok"], case["name"]
    done = subprocess.run(
        [NODE or "node", str(ROOT / "tests/console/verify_node.mjs")],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    results = {r["name"]: r for r in json.loads(done.stdout)}
    for case in cases:
        got = results[case["name"]]
        assert got["ok"] is case["ok"], (case["name"], got["steps"])
        if case["ok"]:
            assert [s["ok"] for s in got["steps"]] == [True] * 5
            leaf = leaf_hash(case["data"]["line"].encode()).hex()
            assert got["steps"][2]["detail"] == leaf  # the leaf hash the browser shows
        else:
            assert got["steps"][-1]["ok"] is False
    assert results["tampered signature"]["steps"][-1]["step"].startswith("checkpoint signature")
    assert results["tampered proof"]["steps"][-1]["step"] == "root equals the signed root"


def test_every_console_module_parses_as_an_es_module(tmp_path: Path) -> None:
    static = ROOT / "surfaces/console/static"
    for module in sorted(static.glob("*.js")):
        copy = tmp_path / f"{module.stem}.mjs"  # .mjs: Node parses it as a module, as browsers do
        copy.write_text(module.read_text())
        done = subprocess.run(
            [NODE or "node", "--check", str(copy)], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, f"{module.name}: {done.stderr}"
